"""The chat websocket's authorization holds at every use, not only at connect.

An open socket whose user signs out, is disabled, changes password, loses the membership or
whose tenant is disabled (or changed) takes no further turn: the next frame gets a closing error
frame and the socket closes with 4401 or 4403, nothing is stored and nothing generated; a socket
left idle is closed by the periodic re-check, and an answer being written is stopped and kept.
A frame acts only on the socket's own conversations and answer.
"""

from __future__ import annotations

import asyncio
import time
from importlib import import_module

import pytest
from asgiref.sync import sync_to_async
from channels.routing import URLRouter
from channels.testing import WebsocketCommunicator
from django.conf import settings

from chat.authorization import CLOSE_NO_TENANT, CLOSE_UNAUTHENTICATED
from chat.models import Conversation, Message
from chat.routing import websocket_urlpatterns
from tenants.models import Membership, Tenant
from tests.chat.test_chat_socket import frames_until, wait_stats
from tests.support.web import output, session_cookie, signed_in_client, socket_to_site

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.anyio]


async def signed_in_socket(user):
    """(the socket, the test client whose session opened it)."""
    client = await sync_to_async(signed_in_client)(user)
    ws = socket_to_site(session_cookie(client))
    connected, _ = await ws.connect(timeout=10)
    assert connected
    return ws, client


async def refused_turn(ws) -> tuple[dict, dict]:
    """Send a turn that must be refused: (the error frame, the close)."""
    await ws.send_json_to({"type": "send", "conversation_id": None, "content": "one more"})
    error, close = await output(ws), await output(ws)
    await ws.disconnect()
    return error, close


def _logout(client) -> None:
    assert client.post("/chat/logout/").status_code == 302


def _deactivate(user) -> None:
    type(user).objects.filter(pk=user.pk).update(is_active=False)


def _new_password(user) -> None:
    user.set_password("another-long-password")
    user.save()


def _drop_membership(user) -> None:
    Membership.objects.filter(user=user).delete()


def _disable_tenant(user) -> None:
    Tenant.objects.filter(memberships__user=user).update(is_active=False)


SIGNED_OUT_CASES = {"logout": _logout, "deactivated": _deactivate, "password": _new_password}
NO_TENANT_CASES = {"membership": _drop_membership, "tenant": _disable_tenant}


@pytest.mark.parametrize("case", [*SIGNED_OUT_CASES, *NO_TENANT_CASES])
async def test_a_socket_takes_no_turn_once_its_authorization_is_gone(case, make_member, worker,
                                                                     chat_conf):
    user = await sync_to_async(make_member)()
    ws, client = await signed_in_socket(user)
    await ws.send_json_to({"type": "send", "conversation_id": None, "content": "first"})
    first = await frames_until(ws, "done")
    assert first[-1]["status"] == "complete"
    stored = await Message.objects.acount()

    change = SIGNED_OUT_CASES.get(case) or NO_TENANT_CASES[case]
    await sync_to_async(change)(client if case == "logout" else user)
    error, close = await refused_turn(ws)

    assert error["type"] == "error" and error["closing"] is True and error["message"]
    expected = CLOSE_UNAUTHENTICATED if case in SIGNED_OUT_CASES else CLOSE_NO_TENANT
    assert close["type"] == "websocket.close" and close["code"] == expected
    assert await Message.objects.acount() == stored  # nothing stored
    deadline = time.monotonic() + 5
    while not worker.usage and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.3)
    assert len(worker.usage) == 1  # the first turn only: nothing more was generated


async def test_a_socket_is_closed_when_the_user_moves_to_another_tenant(make_member, make_tenant,
                                                                        worker, chat_conf):
    user = await sync_to_async(make_member)()
    ws, _ = await signed_in_socket(user)
    other = (await sync_to_async(make_tenant)())[0]
    await Membership.objects.filter(user=user).aupdate(tenant=other)
    error, close = await refused_turn(ws)
    assert error["closing"] is True and "another tenant" in error["message"]
    assert close["code"] == CLOSE_NO_TENANT
    assert await Conversation.objects.acount() == 0


async def test_an_idle_socket_is_closed_after_sign_out_and_its_answer_stops(make_member, worker,
                                                                           chat_conf):
    chat_conf(MAX_TOKENS=6000, REAUTHORIZE_INTERVAL_S=0.2)
    user = await sync_to_async(make_member)()
    ws, client = await signed_in_socket(user)
    await ws.send_json_to({"type": "send", "conversation_id": None, "content": "long story"})
    await frames_until(ws, "token")
    await sync_to_async(_logout)(client)  # the page sends nothing more
    frames = []
    while (frame := await output(ws)).get("type") != "websocket.close":
        frames.append(frame)
    assert frame["code"] == CLOSE_UNAUTHENTICATED
    done = next(f for f in frames if f["type"] == "done")
    assert done["status"] == "stopped"
    assert frames[-1]["type"] == "error" and frames[-1]["closing"] is True
    message = await Message.objects.aget(pk=done["message_id"])
    assert message.status == "stopped" and message.content
    stats = await wait_stats(worker, lambda s: s["num_active"] == 0)
    assert stats["num_active"] == 0 and stats["tokens_generated"] < 6000
    await ws.disconnect()


async def test_stop_on_one_socket_never_stops_another_sockets_answer(make_member, worker,
                                                                      chat_conf):
    chat_conf(MAX_TOKENS=1000)
    owner = await sync_to_async(make_member)()
    # Another user of the same tenant, and the same user on a second page.
    tenant = await sync_to_async(lambda: owner.membership.tenant)()
    other = await sync_to_async(make_member)(tenant=tenant)
    mine, _ = await signed_in_socket(owner)
    second_page, _ = await signed_in_socket(owner)
    theirs, _ = await signed_in_socket(other)
    await mine.send_json_to({"type": "send", "conversation_id": None, "content": "go on"})
    start = next(f for f in await frames_until(mine, "token") if f["type"] == "start")
    request_id = (await Message.objects.aget(pk=start["message_id"])).request_id
    for ws in (theirs, second_page):
        # Extra fields naming the answer are ignored: a socket stops only its own.
        await ws.send_json_to({"type": "stop", "message_id": start["message_id"],
                               "request_id": request_id, "conversation_id": 1})
        await ws.send_json_to({"type": "probe"})  # answered once the stop was handled
        assert "Unknown request" in (await output(ws))["message"]
    # The answer goes on after both stops were handled, to its end.
    frames = await frames_until(mine, "done", timeout=60)
    assert [f for f in frames if f["type"] == "token"]
    assert frames[-1]["status"] == "complete" and frames[-1]["finish_reason"] != "abort"
    for ws in (mine, second_page, theirs):
        await ws.disconnect()


@pytest.mark.parametrize("conversation_id", [True, 1.0, "1", [1], {"id": 1}, -1, 0, 2**64])
async def test_a_conversation_id_of_the_wrong_type_is_refused(conversation_id, make_member,
                                                              chat_conf):
    user = await sync_to_async(make_member)()
    own = await Conversation.objects.acreate(
        user=user, tenant_id=await sync_to_async(lambda: user.membership.tenant_id)(),
        title="mine")
    ws, _ = await signed_in_socket(user)
    await ws.send_json_to({"type": "send", "conversation_id": conversation_id,
                           "content": "hi"})
    frame = await output(ws)
    assert frame["type"] == "error" and "conversation_id" in frame["message"]
    assert await own.messages.acount() == 0 and await Message.objects.acount() == 0
    await ws.disconnect()


async def test_a_conversation_of_the_users_former_tenant_is_out_of_reach(make_member,
                                                                         make_tenant, chat_conf):
    user = await sync_to_async(make_member)()
    old_tenant = await sync_to_async(lambda: user.membership.tenant)()
    old = await Conversation.objects.acreate(user=user, tenant=old_tenant, title="old")
    new_tenant = (await sync_to_async(make_tenant)())[0]
    await Membership.objects.filter(user=user).aupdate(tenant=new_tenant)
    ws, _ = await signed_in_socket(user)
    await ws.send_json_to({"type": "send", "conversation_id": old.pk, "content": "hi"})
    assert await output(ws) == {"type": "error", "message": "That conversation does not exist."}
    assert await old.messages.acount() == 0
    await ws.disconnect()


async def test_a_socket_without_a_session_is_refused(make_member):
    """A user in the scope without the session that signed it in (no cookie): refused."""
    user = await sync_to_async(make_member)()
    ws = WebsocketCommunicator(URLRouter(websocket_urlpatterns), "/ws/chat/")
    ws.scope["user"] = user
    connected, code = await ws.connect(timeout=10)
    await ws.disconnect()
    assert not connected and code == CLOSE_UNAUTHENTICATED


async def test_a_session_of_another_user_is_refused(make_member):
    """The socket's user must be the one its session signs in."""
    alice, bob = await sync_to_async(make_member)(), await sync_to_async(make_member)()
    client = await sync_to_async(signed_in_client)(bob)
    store = import_module(settings.SESSION_ENGINE).SessionStore
    session = store(client.cookies[settings.SESSION_COOKIE_NAME].value)
    ws = WebsocketCommunicator(URLRouter(websocket_urlpatterns), "/ws/chat/")
    ws.scope.update(user=alice, session=session)
    connected, code = await ws.connect(timeout=10)
    await ws.disconnect()
    assert not connected and code == CLOSE_UNAUTHENTICATED
