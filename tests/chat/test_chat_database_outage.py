"""The chat while its database cannot serve: the socket gets an ``error`` frame of its protocol
(never a dropped socket), an answer already streaming reaches its end and is stored once the
database is back, and the pages answer a plain 503 page.

The database really fails (``tests.support.database``: its file cannot be opened); the socket is
the project's whole ASGI stack, as a browser reaches it.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from asgiref.sync import sync_to_async
from django.test import Client

from chat.models import Message
from chat.outages import CLOSE_UNAVAILABLE
from gateway import grace
from gateway.clients import aredis
from gateway.conf import redis_keys
from tests.chat.test_chat_socket import frames_until
from tests.support import database
from tests.support.web import (
    PASSWORD,
    output,
    session_cookie,
    signed_in_client,
    socket_to_site,
    worker_with_control,
)

database_fault = database.database_fault  # the fixture


def assert_unavailable_frame(frame: dict, *, closing: bool) -> None:
    assert frame["type"] == "error"
    assert frame["code"] == "service_unavailable"
    assert frame["retryable"] is True and frame["retry_after_ms"] == 1000
    assert "database" in frame["message"]
    assert frame.get("closing", False) is closing


@pytest.mark.django_db(transaction=True)
@pytest.mark.anyio
async def test_a_socket_opened_while_the_database_is_down_is_told_so_and_closed_to_retry(
        make_member, database_fault):
    user = await sync_to_async(make_member)()
    cookie = session_cookie(await sync_to_async(signed_in_client)(user))
    await sync_to_async(database_fault.down)()
    ws = socket_to_site(cookie)  # the session and the user cannot be read
    connected, _ = await ws.connect(timeout=10)
    assert connected
    assert_unavailable_frame(await output(ws), closing=True)
    # Not 4401 or 4403: the page reconnects by itself.
    assert await output(ws) == {"type": "websocket.close", "code": CLOSE_UNAVAILABLE}
    await sync_to_async(database_fault.restore)()
    again = socket_to_site(cookie)
    connected, _ = await again.connect(timeout=10)
    assert connected
    await again.disconnect()


@pytest.mark.django_db(transaction=True)
@pytest.mark.anyio
async def test_an_open_socket_gets_an_error_frame_per_turn_and_works_once_the_database_is_back(
        make_member, database_fault, chat_conf):
    user = await sync_to_async(make_member)()
    ws = socket_to_site(session_cookie(await sync_to_async(signed_in_client)(user)))
    connected, _ = await ws.connect(timeout=10)
    assert connected
    await sync_to_async(database_fault.down)()
    for _ in range(2):
        await ws.send_json_to({"type": "send", "conversation_id": None, "content": "Hello"})
        assert_unavailable_frame(await ws.receive_json_from(timeout=10), closing=False)
    await sync_to_async(database_fault.restore)()
    await ws.send_json_to({"type": "send", "conversation_id": None, "content": "Hello"})
    frame = await ws.receive_json_from(timeout=10)
    assert frame["type"] == "conversation" and frame["created"] is True
    await ws.disconnect()


@pytest.fixture
def slow_worker(redis_prefix, settings):
    """A worker that takes 5 ms a step: the answer is still streaming when the database goes."""
    yield from worker_with_control(redis_prefix, settings.REDIS_URL, reference_step_delay_s=0.005)


@pytest.mark.django_db(transaction=True)
@pytest.mark.anyio
async def test_an_answer_streaming_when_the_database_goes_ends_and_is_stored_when_it_is_back(
        make_member, slow_worker, chat_conf, database_fault):
    chat_conf(MAX_TOKENS=60)
    user = await sync_to_async(make_member)()
    ws = socket_to_site(session_cookie(await sync_to_async(signed_in_client)(user)))
    connected, _ = await ws.connect(timeout=10)
    assert connected
    await ws.send_json_to({"type": "send", "conversation_id": None, "content": "Tell me more"})
    frames = await frames_until(ws, "token")
    await sync_to_async(database_fault.down)()
    frames += await frames_until(ws, "done")
    done = frames[-1]
    # The page gets the whole answer and its end, though it cannot be stored yet.
    assert done["status"] == "complete" and done["finish_reason"] == "length"
    text = "".join(f["text"] for f in frames if f["type"] == "token")
    # Left to the grace sweep (the answer's entry, due at once), the only request held.
    held = await aredis().hkeys(f"{redis_keys().prefix}:grace:info")
    assert len(held) == 1
    request_id = held[0].decode()
    await sync_to_async(database_fault.restore)()
    deadline = time.monotonic() + 10
    while True:
        await sync_to_async(grace.sweep)()
        message = await Message.objects.aget(pk=done["message_id"])
        if message.status != "streaming" or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    assert (message.status, message.finish_reason, message.content) == ("complete", "length",
                                                                         text)
    assert message.completion_tokens == 60
    assert not await grace.is_held(request_id)
    await ws.disconnect()


# The pages ---------------------------------------------------------------------------------

def assert_unavailable_page(response) -> None:
    assert response.status_code == 503
    assert response["Retry-After"] == "1"
    assert response["Content-Type"] == "text/html; charset=utf-8"
    page = response.content.decode()
    assert "The database is unavailable" in page
    assert "Traceback" not in page and "OperationalError" not in page


def browser(user=None) -> Client:
    """A test client as a browser is: it takes HTML; a 500 is answered, not raised."""
    client = Client(raise_request_exception=False, HTTP_ACCEPT="text/html,*/*;q=0.8")
    if user is not None:
        client.force_login(user)
    return client


@pytest.mark.parametrize("path", ["/chat/", "/admin/", "/admin/tenants/tenant/",
                                  "/admin/scheduler/"])
def test_the_pages_answer_a_plain_503_page(make_member, database_fault, path):
    staff = make_member(is_staff=True, is_superuser=True)
    signed_in = browser(staff)
    assert signed_in.get(path).status_code == 200
    database_fault.down()
    assert_unavailable_page(signed_in.get(path))


def test_signing_in_answers_a_plain_503_page(make_member, database_fault):
    user = make_member()
    database_fault.down()
    for path in ("/chat/login/", "/admin/login/"):
        page = browser()
        assert page.get(path).status_code == 200  # the form needs no database
        assert_unavailable_page(page.post(path, {"username": user.username,
                                                 "password": PASSWORD}))

