"""The chat socket while the database is down: an ``error`` frame the page shows, not a dropped
socket.

A socket's session and user are read from the database when it opens (Channels' auth
middleware, then :func:`chat.authorization.authorize`). When the database cannot serve
(:func:`gateway.errors.database_unavailable`), :class:`DatabaseOutageGuard` accepts the socket,
sends :func:`unavailable_frame` (``"closing": true``) and closes it with
:data:`CLOSE_UNAVAILABLE`; the page shows the message and reconnects by itself, as after any
close it was not told to stay away for. On a socket already open, a frame the database fails gets
the same frame without ``closing`` (:mod:`chat.consumers`), and the socket keeps working.
"""

from __future__ import annotations

import json
from typing import Any

from gateway.errors import database_outage, database_unavailable, unexpected_error

# The application close code (4000-4999) of a socket closed because the server cannot serve it
# now; the page reconnects later (unlike 4401 and 4403 of chat.authorization).
CLOSE_UNAVAILABLE = 4503
MESSAGE = "The chat is unavailable right now: its database cannot be reached. Retrying…"


def unavailable_frame(*, closing: bool = False) -> dict[str, Any]:
    """The ``error`` frame of a database outage: the readable ``message``, ``code``
    ``service_unavailable``, ``retryable`` and ``retry_after_ms``; ``closing`` when the socket
    closes after it."""
    hints = database_outage().stream_body()["error"]
    frame = {"type": "error", "message": MESSAGE, "code": hints["code"],
             "retryable": hints["retryable"], "retry_after_ms": hints["retry_after_ms"]}
    if closing:
        frame["closing"] = True
    return frame


class DatabaseOutageGuard:
    """ASGI middleware around a websocket's stack (session, user, consumer): a database outage
    that ends the application (the socket's session or user could not be read) gets
    :func:`unavailable_frame` and the close :data:`CLOSE_UNAVAILABLE` instead of a dropped
    handshake. Other exceptions, and other kinds of connection, pass through."""

    def __init__(self, application: Any):
        self.application = application

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> Any:
        if scope["type"] != "websocket":
            return await self.application(scope, receive, send)
        seen: set[str] = set()  # the message types that went through: connect, accept, close

        async def receive_seen() -> dict[str, Any]:
            message = await receive()
            seen.add(message["type"])
            return message

        async def send_seen(message: dict[str, Any]) -> None:
            seen.add(message["type"])
            await send(message)

        try:
            return await self.application(scope, receive_seen, send_seen)
        except Exception as exc:
            if not database_unavailable(exc) or "websocket.close" in seen:
                raise
            unexpected_error(exc)  # logged (once in a while)
        if "websocket.disconnect" in seen:
            return None  # the client is gone: no one to tell
        if "websocket.accept" not in seen:
            if "websocket.connect" not in seen:
                message = await receive()
                if message["type"] != "websocket.connect":
                    return None  # the client left before its handshake was answered
            await send({"type": "websocket.accept"})
        await send({"type": "websocket.send", "text": json.dumps(unavailable_frame(closing=True))})
        await send({"type": "websocket.close", "code": CLOSE_UNAVAILABLE})
        return None
