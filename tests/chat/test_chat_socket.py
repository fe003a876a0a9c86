"""The chat websocket against an in-process worker (reference backend) over real Redis."""

from __future__ import annotations

import asyncio
import time

import pytest
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator

from chat.authorization import CLOSE_NO_TENANT, CLOSE_UNAUTHENTICATED
from chat.models import Conversation, Message
from tests.support.web import (
    InProcessWorker,
    session_cookie,
    signed_in_client,
    socket_to_site,
)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.anyio]


async def open_socket(user) -> WebsocketCommunicator:
    """A socket of ``user``, opened as the chat page opens it: signed in, from the site."""
    client = await sync_to_async(signed_in_client)(user)
    communicator = socket_to_site(session_cookie(client))
    connected, _ = await communicator.connect(timeout=10)
    assert connected
    return communicator


async def frames_until(communicator, kind: str, timeout: float = 20) -> list[dict]:
    frames = []
    while True:
        frame = await communicator.receive_json_from(timeout=timeout)
        frames.append(frame)
        if frame["type"] == kind:
            return frames


async def wait_stats(worker: InProcessWorker, predicate, timeout: float = 5) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = worker.engine.stats()
        if predicate(stats) or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.02)


async def test_a_turn_streams_in_several_frames_and_is_stored(make_member, worker, chat_conf):
    user = await sync_to_async(make_member)()
    ws = await open_socket(user)
    await ws.send_json_to({"type": "send", "conversation_id": None, "content": "Hello there"})
    frames = await frames_until(ws, "done")
    kinds = [f["type"] for f in frames]
    assert kinds[:3] == ["conversation", "user_message", "start"]
    tokens = [f["text"] for f in frames if f["type"] == "token"]
    assert len(tokens) > 3
    done = frames[-1]
    assert done["status"] == "complete" and done["finish_reason"] == "length"
    conversation = await Conversation.objects.aget(pk=frames[0]["id"])
    assert conversation.title == "Hello there"
    stored = [m async for m in conversation.messages.all()]
    assert [(m.role, m.status) for m in stored] == [("user", "complete"),
                                                    ("assistant", "complete")]
    assert stored[1].content == "".join(tokens)
    await ws.disconnect()


async def test_the_next_turn_sends_the_conversation_so_far(make_member, worker, chat_conf):
    user = await sync_to_async(make_member)()
    ws = await open_socket(user)
    await ws.send_json_to({"type": "send", "conversation_id": None, "content": "First"})
    first = await frames_until(ws, "done")
    await ws.send_json_to({"type": "send", "conversation_id": first[0]["id"],
                           "content": "Second"})
    second = await frames_until(ws, "done")
    assert second[0] == {"type": "conversation", "id": first[0]["id"], "title": "First",
                         "created": False}
    deadline = time.monotonic() + 5
    while len(worker.usage) < 2 and time.monotonic() < deadline:  # reported when each ends
        await asyncio.sleep(0.01)
    prompts = [u.usage.prompt_tokens for u in worker.usage]
    # byte-level tokens: the second prompt holds the first question and answer too
    assert len(prompts) == 2 and prompts[1] > prompts[0] + 24
    await ws.disconnect()


async def test_stop_ends_the_answer_keeps_it_and_frees_the_worker(make_member, worker,
                                                                   chat_conf):
    chat_conf(MAX_TOKENS=6000)
    user = await sync_to_async(make_member)()
    ws = await open_socket(user)
    await ws.send_json_to({"type": "send", "conversation_id": None,
                           "content": "Write a very long story"})
    frames = await frames_until(ws, "token")
    await ws.send_json_to({"type": "stop"})
    frames += await frames_until(ws, "done")
    done = frames[-1]
    assert done["status"] == "stopped" and done["finish_reason"] == "abort"
    message = await Message.objects.aget(pk=done["message_id"])
    assert message.status == "stopped" and message.content
    assert message.content == "".join(f["text"] for f in frames if f["type"] == "token")
    stats = await wait_stats(worker, lambda s: s["num_active"] == 0)
    assert stats["num_active"] == 0 and stats["active_kv_reserved"] == 0
    assert stats["tokens_generated"] < 6000
    await ws.disconnect()


async def test_closing_the_page_aborts_the_answer(make_member, worker, chat_conf):
    # Without a grace period for the page to come back (tests/chat/test_chat_resume.py).
    chat_conf(MAX_TOKENS=6000, RESUME_GRACE_S=0)
    user = await sync_to_async(make_member)()
    ws = await open_socket(user)
    await ws.send_json_to({"type": "send", "conversation_id": None, "content": "Go on and on"})
    frames = await frames_until(ws, "token")
    await ws.disconnect()
    stats = await wait_stats(worker, lambda s: s["num_active"] == 0)
    assert stats["num_active"] == 0 and stats["active_kv_reserved"] == 0
    start = next(f for f in frames if f["type"] == "start")
    for _ in range(100):
        message = await Message.objects.aget(pk=start["message_id"])
        if message.status != "streaming":
            break
        await asyncio.sleep(0.05)
    assert message.status == "stopped"


async def test_a_socket_cannot_reach_another_users_conversation(make_member, worker, chat_conf):
    owner = await sync_to_async(make_member)()
    other = await sync_to_async(make_member)()
    conversation = await Conversation.objects.acreate(user=owner, tenant_id=(
        await sync_to_async(lambda: owner.membership.tenant_id)()), title="private")
    ws = await open_socket(other)
    await ws.send_json_to({"type": "send", "conversation_id": conversation.pk,
                           "content": "let me in"})
    frame = await ws.receive_json_from(timeout=5)
    assert frame == {"type": "error", "message": "That conversation does not exist."}
    assert await conversation.messages.acount() == 0
    await ws.disconnect()


async def test_without_a_worker_the_page_gets_a_readable_error(make_member, chat_conf):
    user = await sync_to_async(make_member)()
    ws = await open_socket(user)
    await ws.send_json_to({"type": "send", "conversation_id": None, "content": "Anyone?"})
    frames = await frames_until(ws, "error")
    assert "No inference worker is running" in frames[-1]["message"]
    message = await Message.objects.aget(pk=frames[-1]["message_id"])
    assert message.status == "error" and "No inference worker" in message.error
    await ws.disconnect()


async def test_a_message_too_long_for_the_context_is_refused_readably(make_member, chat_conf,
                                                                     redis_prefix, settings):
    w = InProcessWorker(redis_prefix, settings.REDIS_URL, max_model_len=256,
                        max_batch_size=2).start()
    try:
        user = await sync_to_async(make_member)()
        ws = await open_socket(user)
        await ws.send_json_to({"type": "send", "conversation_id": None, "content": "x " * 400})
        frames = await frames_until(ws, "error")
        assert "too long" in frames[-1]["message"]
        await ws.disconnect()
    finally:
        w.stop()


async def test_anonymous_sockets_and_foreign_origins_are_refused(make_member):
    from llm_platform.asgi import application

    anonymous = WebsocketCommunicator(application, "/ws/chat/",
                                      headers=[(b"origin", b"http://localhost"),
                                               (b"host", b"localhost")])
    connected, code = await anonymous.connect(timeout=10)
    # The server sends a disconnect after a refused handshake; so does the test, so the
    # consumer ends and leaves no channel-layer read behind.
    await anonymous.disconnect()
    assert not connected and code == CLOSE_UNAUTHENTICATED
    foreign = WebsocketCommunicator(application, "/ws/chat/",
                                    headers=[(b"origin", b"http://evil.example"),
                                             (b"host", b"localhost")])
    connected, _ = await foreign.connect(timeout=10)
    await foreign.disconnect()
    assert not connected


async def test_a_user_without_a_tenant_is_refused(db):
    from django.contrib.auth import get_user_model

    user = await sync_to_async(get_user_model().objects.create_user)("loner", password="x")
    client = await sync_to_async(signed_in_client)(user)
    communicator = socket_to_site(session_cookie(client))
    connected, code = await communicator.connect(timeout=10)
    await communicator.disconnect()
    assert not connected and code == CLOSE_NO_TENANT


async def test_stop_ends_the_answer_even_if_the_worker_never_confirms(make_member, chat_conf,
                                                                      redis_prefix, settings):
    chat_conf(MAX_TOKENS=6000, STOP_GRACE_S=0.5)
    # No control channel: this worker never hears the abort.
    w = InProcessWorker(redis_prefix, settings.REDIS_URL, max_model_len=8192,
                        max_batch_size=2).start()
    try:
        user = await sync_to_async(make_member)()
        ws = await open_socket(user)
        await ws.send_json_to({"type": "send", "conversation_id": None, "content": "on and on"})
        await frames_until(ws, "token")
        started = time.monotonic()
        await ws.send_json_to({"type": "stop"})
        done = (await frames_until(ws, "done"))[-1]
        assert done["status"] == "stopped" and time.monotonic() - started < 3
        await ws.disconnect()
    finally:
        w.stop()


@pytest.mark.slow
async def test_a_socket_idle_longer_than_the_channel_layers_receive_timeout_still_works(
        make_member, worker, chat_conf):
    # The consumer also listens on the Redis channel layer, whose receive blocks for 5 s at a
    # time; an idle socket must survive those reads (a page open while the user is typing).
    user = await sync_to_async(make_member)()
    ws = await open_socket(user)
    await asyncio.sleep(7)
    await ws.send_json_to({"type": "send", "conversation_id": None, "content": "Still there?"})
    frames = await frames_until(ws, "done")
    assert [f for f in frames if f["type"] == "token"]
    await ws.disconnect()


async def test_a_message_that_is_not_valid_text_gets_a_readable_error(make_member, worker,
                                                                      chat_conf):
    user = await sync_to_async(make_member)()
    ws = await open_socket(user)
    await ws.send_json_to({"type": "send", "conversation_id": None, "content": "hi \ud800"})
    frame = await ws.receive_json_from(timeout=5)
    assert frame == {"type": "error",
                     "message": "The message contains characters that are not valid text."}
    # The socket keeps working.
    await ws.send_json_to({"type": "send", "conversation_id": None, "content": "hello"})
    assert [f for f in await frames_until(ws, "done") if f["type"] == "token"]
    await ws.disconnect()
