"""Websocket handshakes through the project's ASGI application: a path no route serves is
refused before the origin check, the session and the consumer (``KnownRoutesOnly``); the chat's
own path still reaches the chat consumer. The real process: ``test_http_guard_process.py``."""

from __future__ import annotations

import pytest

from chat.authorization import CLOSE_UNAUTHENTICATED
from tests.support.web import socket_to_site


@pytest.mark.anyio
@pytest.mark.parametrize("path", ["/ws/", "/ws/chat", "/ws/chat/x", "/v1/models", "/", ""])
async def test_a_path_without_a_route_is_refused_before_the_consumer(path):
    communicator = socket_to_site(path=path or "/")
    connected, code = await communicator.connect(timeout=10)
    await communicator.disconnect()  # so that the application ends
    assert not connected and code != CLOSE_UNAUTHENTICATED


@pytest.mark.anyio
async def test_the_chat_path_reaches_the_chat_consumer():
    communicator = socket_to_site()  # no session: the consumer refuses it, as its own
    connected, code = await communicator.connect(timeout=10)
    await communicator.disconnect()
    assert not connected and code == CLOSE_UNAUTHENTICATED
