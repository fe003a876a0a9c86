"""A chat answer outlives its socket: a page that comes back gets exactly the answer generated,
and an answer no page comes back for is aborted after its grace period, stored as it was, with
its reservation settled and its leases released (reference backend, over real Redis)."""

from __future__ import annotations

import asyncio
import time

import pytest
from asgiref.sync import sync_to_async
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chat.models import Conversation, Message
from gateway import grace, tasks, usage
from inference.protocol.events import FinalEvent, FinishReason, TokenEvent, Usage, encode_event
from inference.protocol.keys import Keys
from tenants.models import UsageRecord
from tests.chat.test_chat_socket import frames_until, wait_stats
from tests.support.web import (
    session_cookie,
    signed_in_client,
    socket_to_site,
    worker_with_control,
)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.anyio]

PROMPT = "Tell me about the sea."
ANSWER_TOKENS = 40


@pytest.fixture
def slow_worker(redis_prefix, settings):
    """A worker that takes 5 ms a step, so a page can drop and come back mid-answer."""
    yield from worker_with_control(redis_prefix, settings.REDIS_URL, reference_step_delay_s=0.005)


async def open_socket(client):
    ws = socket_to_site(session_cookie(client))
    connected, _ = await ws.connect(timeout=10)
    assert connected
    return ws


async def until_done(ws, shown: str, last_seq: int) -> tuple[str, int]:
    """Read the answer's frames to its end, as the page shows them: (the text, the last seq).
    Fails on a token the socket sends twice or out of order."""
    while True:
        frame = await ws.receive_json_from(timeout=20)
        if frame["type"] == "token":
            assert frame["seq"] > last_seq, "a token sent again"
            shown, last_seq = shown + frame["text"], frame["seq"]
        elif frame["type"] == "done":
            assert frame["status"] == "complete", frame
            return shown, last_seq


@pytest.fixture
async def page(make_member, slow_worker, chat_conf):
    """A signed-in page's client, and the answer of an uninterrupted run of :data:`PROMPT`."""
    chat_conf(MAX_TOKENS=ANSWER_TOKENS)
    user = await sync_to_async(make_member)()
    client = await sync_to_async(signed_in_client)(user)
    ws = await open_socket(client)
    await ws.send_json_to({"type": "send", "conversation_id": None, "content": PROMPT})
    await frames_until(ws, "start")
    text, _ = await until_done(ws, "", -1)
    await ws.disconnect()
    assert len(text) == ANSWER_TOKENS  # one letter a token
    return client, text


@settings(max_examples=10, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(drops=st.lists(st.tuples(st.integers(0, ANSWER_TOKENS - 1), st.booleans()),
                      min_size=1, max_size=3))
async def test_an_answer_dropped_and_resumed_anywhere_is_the_answer_generated(drops, page):
    """Drop the socket after any number of tokens (sometimes again), come back as a
    reconnecting page (its last seq) or a reloaded one (nothing): the page's text is the
    uninterrupted run's, and so is the stored answer."""
    client, expected = page
    ws = await open_socket(client)
    await ws.send_json_to({"type": "send", "conversation_id": None, "content": PROMPT})
    frames = await frames_until(ws, "start")
    conversation_id, message_id = frames[0]["id"], frames[-1]["message_id"]
    shown, last_seq, tokens, ended = "", -1, 0, False
    for at, reload in sorted(drops):
        while tokens < at and not ended:
            frame = await ws.receive_json_from(timeout=20)
            if frame["type"] == "token":
                assert frame["seq"] > last_seq
                shown, last_seq, tokens = shown + frame["text"], frame["seq"], tokens + 1
            ended = frame["type"] == "done"
        if ended:
            break
        await ws.disconnect()
        ws = await open_socket(client)
        if reload:  # a reloaded page knows the answer from the page, none of its text
            shown, last_seq = "", -1
        await ws.send_json_to({"type": "resume", "conversation_id": conversation_id,
                               "message_id": message_id, "after_seq": last_seq})
        first = await ws.receive_json_from(timeout=10)
        if first["type"] == "answer":  # the old socket stored it before it closed
            shown, ended = first["message"]["content"], True
            break
        assert first == {"type": "resume", "conversation_id": conversation_id,
                         "message_id": message_id, "after_seq": last_seq}
    if not ended:
        shown, last_seq = await until_done(ws, shown, last_seq)
    await ws.disconnect()
    assert shown == expected
    stored = await Message.objects.aget(pk=message_id)
    assert (stored.status, stored.content) == ("complete", expected)


async def test_a_page_that_comes_back_after_the_answer_ended_gets_it_as_stored(page):
    client, expected = page
    ws = await open_socket(client)
    await ws.send_json_to({"type": "send", "conversation_id": None, "content": PROMPT})
    frames = await frames_until(ws, "token")
    conversation_id = frames[0]["id"]
    await ws.disconnect()
    await asyncio.sleep(ANSWER_TOKENS * 0.005 + 0.5)  # it ends with no page
    ws = await open_socket(client)
    # A page that lost its socket before the answer started asks for the last answer.
    await ws.send_json_to({"type": "resume", "conversation_id": conversation_id,
                           "message_id": None, "after_seq": None})
    frame = await ws.receive_json_from(timeout=10)
    assert frame["type"] == "resume" and frame["after_seq"] == -1
    shown, _ = await until_done(ws, "", -1)
    assert shown == expected
    # Once stored, a page coming back gets the answer whole.
    await ws.send_json_to({"type": "resume", "conversation_id": conversation_id,
                           "message_id": frame["message_id"], "after_seq": 3})
    again = await ws.receive_json_from(timeout=10)
    assert again["type"] == "answer" and again["message"]["content"] == expected
    assert again["message"]["status"] == "complete"
    await ws.disconnect()


async def test_only_the_user_who_asked_can_resume_an_answer(page, make_member, rclient, keys):
    client, _ = page
    ws = await open_socket(client)
    await ws.send_json_to({"type": "send", "conversation_id": None, "content": PROMPT})
    frames = await frames_until(ws, "token")
    await ws.disconnect()
    owner = await sync_to_async(lambda: Message.objects.get(pk=frames[2]["message_id"])
                                .conversation.user)()
    tenant = await sync_to_async(lambda: owner.membership.tenant)()
    other = await sync_to_async(make_member)(tenant=tenant)  # same tenant, another user
    intruder = await open_socket(await sync_to_async(signed_in_client)(other))
    await intruder.send_json_to({"type": "resume", "conversation_id": frames[0]["id"],
                                 "message_id": frames[2]["message_id"], "after_seq": -1})
    assert await intruder.receive_json_from(timeout=10) == {
        "type": "error", "message": "That conversation does not exist."}
    assert await intruder.receive_nothing(0.3)
    await intruder.disconnect()


async def test_no_page_for_the_grace_period_aborts_stores_and_frees_everything(
        make_member, make_tenant, slow_worker, chat_conf, rclient, keys: Keys):
    chat_conf(MAX_TOKENS=6000, RESUME_GRACE_S=1.0)
    tenant = (await sync_to_async(make_tenant)(max_concurrent_requests=3,
                                              token_budget=1_000_000))[0]
    user = await sync_to_async(make_member)(tenant=tenant)
    client = await sync_to_async(signed_in_client)(user)
    ws = await open_socket(client)
    await ws.send_json_to({"type": "send", "conversation_id": None, "content": PROMPT})
    frames = await frames_until(ws, "token")
    conversation_id, message_id = frames[0]["id"], frames[2]["message_id"]
    lease = f"{keys.prefix}:conc:tenant:{tenant.pk}"
    await ws.disconnect()
    # During the grace period the answer goes on, its lease held; the conversation is busy.
    assert rclient.zcard(lease) == 1 and slow_worker.engine.stats()["num_active"] == 1
    ws = await open_socket(client)
    await ws.send_json_to({"type": "send", "conversation_id": conversation_id,
                           "content": "and the mountains?"})
    assert "still being written" in (await ws.receive_json_from(timeout=10))["message"]
    await ws.disconnect()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        stored = await Message.objects.aget(pk=message_id)
        if stored.status != "streaming":
            break
        await asyncio.sleep(0.1)
    # Aborted: the worker's row, its KV blocks and the lease are free, nothing is held.
    assert stored.status == "stopped" and stored.finish_reason == "abort"
    stats = await wait_stats(slow_worker, lambda s: s["num_active"] == 0)
    assert stats["num_active"] == 0 and stats["active_kv_reserved"] == 0
    assert rclient.zcard(lease) == 0
    assert not rclient.exists(f"{keys.prefix}:grace", f"{keys.prefix}:grace:info",
                              f"{keys.prefix}:grace:ending")
    # Stored as generated (one letter a token), and billed once for exactly that; the
    # reservation (prompt + 6000) is settled to the real use.
    request_id = stored.request_id
    assert await sync_to_async(usage.record)(request_id)  # as the Celery task does
    record = await UsageRecord.objects.aget(request_id=request_id)
    assert record.status == 499 and record.completion_tokens == len(stored.content) > 0
    assert stored.completion_tokens == record.completion_tokens
    budget = [k for k in rclient.scan_iter(f"{keys.prefix}:budget:{tenant.pk}:*")]
    assert [int(rclient.get(k)) for k in budget] == [record.prompt_tokens
                                                     + record.completion_tokens]
    # A page coming back now gets the answer as stored.
    ws = await open_socket(client)
    await ws.send_json_to({"type": "resume", "conversation_id": conversation_id,
                           "message_id": message_id, "after_seq": 5})
    frame = await ws.receive_json_from(timeout=10)
    assert frame["type"] == "answer" and frame["message"]["status"] == "stopped"
    assert frame["message"]["content"] == stored.content
    await ws.disconnect()


async def test_the_celery_sweep_stores_an_answer_when_no_web_process_is_left(make_member,
                                                                            rclient, keys):
    """The grace period's end needs no web process: Celery beat's sweep stores the answer."""
    user = await sync_to_async(make_member)()
    conversation = await Conversation.objects.acreate(
        user=user, tenant_id=await sync_to_async(lambda: user.membership.tenant_id)())
    answer = await Message.objects.acreate(conversation=conversation, role="assistant",
                                           status="streaming", request_id="r-celery")
    for event in (TokenEvent(request_id="r-celery", seq=0, token_id=72, text="Hel"),
                  TokenEvent(request_id="r-celery", seq=1, token_id=108, text="lo"),
                  FinalEvent(request_id="r-celery", seq=2, finish_reason=FinishReason.STOP,
                             usage=Usage(prompt_tokens=5, completion_tokens=2))):
        rclient.xadd(keys.events("r-celery"), encode_event(event))
    await grace.hold("r-celery", "chat", 30.0)
    rclient.zadd(f"{keys.prefix}:grace", {"r-celery": 0})  # its web process died long ago
    await sync_to_async(tasks.sweep_queue)()
    await answer.arefresh_from_db()
    assert (answer.status, answer.content, answer.completion_tokens) == ("complete", "Hello", 2)
    assert not rclient.exists(f"{keys.prefix}:grace", f"{keys.prefix}:grace:info")


BAD_RESUMES = [
    ({}, "conversation_id"),
    ({"conversation_id": "1"}, "conversation_id"),
    ({"conversation_id": 1, "message_id": 0}, "message_id"),
    ({"conversation_id": 1, "after_seq": -2}, "after_seq"),
    ({"conversation_id": 1, "after_seq": 1.5}, "after_seq"),
    ({"conversation_id": 1, "after_seq": True}, "after_seq"),
    ({"conversation_id": 2**63 - 1}, "That conversation does not exist."),
]


async def test_a_resume_frame_it_cannot_act_on_gets_a_readable_error(make_member, chat_conf):
    client = await sync_to_async(signed_in_client)(await sync_to_async(make_member)())
    ws = await open_socket(client)
    for fields, says in BAD_RESUMES:
        await ws.send_json_to({"type": "resume", **fields})
        frame = await ws.receive_json_from(timeout=10)
        assert frame["type"] == "error" and says in frame["message"], (fields, frame)
    await ws.disconnect()
