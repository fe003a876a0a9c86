"""Websocket routes (Channels consumers), and the same-origin check every websocket passes.

A browser sends a page's cookies with a websocket handshake whatever page opens it, and says
which page did in the ``Origin`` header; so a socket is accepted only from this site's own origin
(the scheme, host and port the request came to: :func:`own_origin`) or an origin listed in
Django's ``CSRF_TRUSTED_ORIGINS``, the same list that may post forms here with the cookies
(``https://example.com``, ``https://*.example.com`` for its subdomains).

A handshake to a path no route serves (``/ws/``, ``/ws/chat`` without its slash, ``/v1/models``)
is refused by :class:`KnownRoutesOnly` before anything else, as a 403 handshake refusal, instead
of Channels' router failing on it (a 500 and a traceback for each).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from channels.security.websocket import WebsocketDenier
from django.conf import settings
from django.core.exceptions import DisallowedHost
from django.http import HttpRequest
from django.http.request import is_same_domain

from chat.routing import websocket_urlpatterns as chat_websockets

websocket_urlpatterns: list = [*chat_websockets]

DEFAULT_PORTS = {"http": 80, "https": 443}
Origin = tuple[str, str, int]  # scheme, host (lower case), port


class HandshakeRequest(HttpRequest):
    """A websocket handshake's scope seen as a Django request, for the host and scheme it was
    made to: ``get_host`` and ``scheme`` then follow ``ALLOWED_HOSTS``,
    ``USE_X_FORWARDED_HOST`` and ``SECURE_PROXY_SSL_HEADER`` as for any page."""

    def __init__(self, scope: dict[str, Any]):
        super().__init__()
        self._scope_scheme = "https" if scope.get("scheme") in ("wss", "https") else "http"
        server = scope.get("server") or ("", 80)
        self.META["SERVER_NAME"], self.META["SERVER_PORT"] = str(server[0]), str(server[1])
        for name, value in scope.get("headers", []):
            key = "HTTP_" + name.decode("latin1").upper().replace("-", "_")
            text = value.decode("latin1")
            self.META[key] = f"{self.META[key]},{text}" if key in self.META else text

    def _get_scheme(self) -> str:
        return self._scope_scheme


def parse_origin(value: str) -> Origin | None:
    """``scheme://host[:port]`` as (scheme, host, port), the port defaulted; None if it is not
    an http(s) origin (``null``, another scheme, a path, a bad port)."""
    try:
        parts = urlsplit(value.strip())
        port = parts.port
    except ValueError:
        return None
    scheme = parts.scheme.lower()
    if (scheme not in DEFAULT_PORTS or not parts.hostname or parts.path not in ("", "/")
            or parts.query or parts.fragment or parts.username or parts.password):
        return None
    return scheme, parts.hostname.lower(), port or DEFAULT_PORTS[scheme]


def own_origin(scope: dict[str, Any]) -> Origin | None:
    """The origin a handshake was made to; None when its host is not in ``ALLOWED_HOSTS``."""
    request = HandshakeRequest(scope)
    try:
        host = request.get_host()
    except DisallowedHost:
        return None
    return parse_origin(f"{request.scheme}://{host}")


def trusted_origin(origin: str) -> bool:
    """Whether ``origin`` is listed in ``CSRF_TRUSTED_ORIGINS`` (``*.`` for subdomains)."""
    parsed = parse_origin(origin)
    if parsed is None:
        return False
    for entry in settings.CSRF_TRUSTED_ORIGINS:
        if "*" in entry:
            pattern = urlsplit(entry)
            netloc = urlsplit(origin.strip()).netloc.lower()
            if pattern.scheme.lower() == parsed[0] and is_same_domain(
                    netloc, pattern.netloc.lower().lstrip("*")):
                return True
        elif parse_origin(entry) == parsed:
            return True
    return False


def origin_allowed(scope: dict[str, Any]) -> bool:
    """Whether a websocket handshake comes from this site's own origin or a trusted one.

    A handshake without exactly one ``Origin`` header (a browser always sends one) is refused.
    """
    origins = [value for name, value in scope.get("headers", []) if name.lower() == b"origin"]
    if len(origins) != 1:
        return False
    origin = origins[0].decode("latin1")
    parsed = parse_origin(origin)
    if parsed is None:
        return False
    return parsed == own_origin(scope) or trusted_origin(origin)


def has_route(scope: dict[str, Any], routes: list) -> bool:
    """Whether one of ``routes`` (Channels' ``URLRouter`` entries) serves the path of ``scope``,
    matched as ``URLRouter`` matches it."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    if root:
        if not path.startswith(root):
            return False
        path = path[len(root):]
    path = path.lstrip("/")
    return any(route.pattern.match(path) for route in routes)


class KnownRoutesOnly:
    """ASGI middleware: refuses a websocket handshake to a path that none of ``routes`` serves
    (a 403 refusal, Channels' ``WebsocketDenier``), before the origin check, the session or the
    user are looked at."""

    def __init__(self, application: Any, routes: list):
        self.application = application
        self.routes = routes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> Any:
        if scope["type"] == "websocket" and not has_route(scope, self.routes):
            return await WebsocketDenier()(scope, receive, send)
        return await self.application(scope, receive, send)


class SameOriginValidator:
    """ASGI middleware: refuses a websocket handshake that :func:`origin_allowed` refuses
    (before anything else sees it: the browser gets a failed handshake)."""

    def __init__(self, application: Any):
        self.application = application

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> Any:
        if scope["type"] == "websocket" and not origin_allowed(scope):
            return await WebsocketDenier()(scope, receive, send)
        return await self.application(scope, receive, send)
