"""Fixtures and helpers of the web pages' tests (chat, dashboard, admin): members, signed-in
clients, a chat-ready in-process worker, the chat websocket on the project's ASGI stack."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from tests.support.platform import InProcessWorker

# The fixtures a folder's conftest.py takes with ``from tests.support.web import *``.
__all__ = ["anyio_backend", "chat_conf", "make_member", "worker"]

PASSWORD = "a-long-test-password"


@pytest.fixture
def anyio_backend() -> str:
    """Async tests (``pytest.mark.anyio``) run on asyncio, as daphne does."""
    return "asyncio"


def worker_with_control(prefix: str, redis_url: str, **options):
    """An in-process worker with a long context (answers can run long enough to be stopped)
    that hears aborts on the control channel, as the worker process does; a generator for
    fixtures (``options``: more :class:`InProcessWorker` settings)."""
    w = InProcessWorker(prefix, redis_url, max_model_len=8192, max_batch_size=4,
                        **options).start()
    pubsub = w.client.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(**{w.bridge.keys.control: w.bridge.on_control})
    control = pubsub.run_in_thread(sleep_time=0.01, daemon=True)
    yield w
    control.stop()
    w.stop()


@pytest.fixture
def worker(redis_prefix, settings):
    """A worker with a long context, so answers can run long enough to be stopped."""
    yield from worker_with_control(redis_prefix, settings.REDIS_URL)


@pytest.fixture
def chat_conf(settings):
    def configure(**values):
        settings.CHAT = {**getattr(settings, "CHAT", {}), **values}

    configure(MAX_TOKENS=24, TEMPERATURE=0.0)
    return configure


@pytest.fixture
def make_member(make_tenant):
    """Create a user belonging to a tenant: ``make_member(tenant=None, **user_fields)``."""
    from django.contrib.auth import get_user_model

    from tenants.models import Membership

    def make(tenant=None, **fields: Any):
        if tenant is None:
            tenant = make_tenant()[0]
        username = fields.pop("username", f"u-{uuid.uuid4().hex[:8]}")
        user = get_user_model().objects.create_user(username, password=PASSWORD, **fields)
        Membership.objects.create(user=user, tenant=tenant)
        return user

    return make


# The websocket as a browser reaches it: the project's whole ASGI stack (origin check, session
# cookie, auth), with the page's own origin.
SITE_HOST = "localhost:8000"
SITE_ORIGIN = f"http://{SITE_HOST}"


def signed_in_client(user):
    """A Django test client signed in as ``user`` (a real session, as the login page makes)."""
    from django.test import Client

    client = Client()
    client.force_login(user)
    return client


def session_cookie(client) -> str:
    """The session cookie of a signed-in test client, as a ``Cookie`` header value."""
    from django.conf import settings

    return f"{settings.SESSION_COOKIE_NAME}={client.cookies[settings.SESSION_COOKIE_NAME].value}"


def socket_to_site(cookie: str | None = None, *, origin: str | None = SITE_ORIGIN,
                   host: str = SITE_HOST, path: str = "/ws/chat/",
                   headers: list[tuple[bytes, bytes]] = ()):
    """A ``WebsocketCommunicator`` on the project's ASGI application (not yet connected)."""
    from channels.testing import WebsocketCommunicator

    from llm_platform.asgi import application

    sent = [(b"host", host.encode())]
    if origin is not None:
        sent.append((b"origin", origin.encode()))
    if cookie:
        sent.append((b"cookie", cookie.encode()))
    return WebsocketCommunicator(application, path, headers=[*sent, *headers])


async def output(communicator, timeout: float = 10) -> dict:
    """The next thing the socket sends: a frame (decoded: ``{"type": ..., ...}``) or its close
    (``{"type": "websocket.close", "code": ...}``)."""
    import json

    message = await communicator.receive_output(timeout)
    if message["type"] == "websocket.send":
        assert message.get("text") is not None, f"a binary frame: {message!r}"
        return json.loads(message["text"])
    return message
