"""The websocket handshake is accepted only from this site's own origin: scheme, host and port of
the request (behind the proxy settings), or one listed in ``CSRF_TRUSTED_ORIGINS``.

A page elsewhere (another port of the same host, another scheme) that opens the chat socket in a
signed-in user's browser sends the user's cookies with it; it must be refused before anything
reads them.
"""

from __future__ import annotations

import pytest
from asgiref.sync import sync_to_async

from tests.support.web import output, session_cookie, signed_in_client, socket_to_site

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.anyio]


@pytest.fixture
async def cookie(make_member):
    """A signed-in member's session cookie: what a hostile page rides on."""
    user = await sync_to_async(make_member)()
    return session_cookie(await sync_to_async(signed_in_client)(user))


async def handshake(cookie: str, origin: str | None, host: str = "127.0.0.1:8000",
                    headers: list[tuple[bytes, bytes]] = (), scheme: str = "ws") -> bool:
    ws = socket_to_site(cookie, origin=origin, host=host, headers=list(headers))
    ws.scope["scheme"] = scheme
    connected, _ = await ws.connect(timeout=10)
    if connected:
        # An accepted socket works: it answers a frame.
        await ws.send_to(text_data='{"type": "hello"}')
        assert (await output(ws))["type"] == "error"
    await ws.disconnect()
    return connected


@pytest.mark.parametrize("origin", [
    "http://127.0.0.1:9999",  # another port of the same host
    "http://localhost:8011",
    "https://localhost:4443",
    "https://127.0.0.1:8000",  # the same host and port, another scheme
    "http://127.0.0.1",  # port 80
    "http://127.0.0.1:8000.evil.example",
    "http://evil.example",
    "null",  # a sandboxed frame or a file
    "",
    "ws://127.0.0.1:8000",
    "http://127.0.0.1:8000/chat/",
])
async def test_a_page_of_another_origin_cannot_open_the_socket(cookie, origin):
    assert not await handshake(cookie, origin)


async def test_the_sites_own_origin_opens_it_and_a_missing_origin_does_not(cookie):
    assert await handshake(cookie, "http://127.0.0.1:8000")
    assert await handshake(cookie, "HTTP://127.0.0.1:8000")  # scheme and host are case-blind
    assert await handshake(cookie, "http://localhost", host="localhost:80")  # default port
    assert not await handshake(cookie, None)
    assert not await handshake(cookie, "http://127.0.0.1:8000",
                               headers=[(b"origin", b"http://127.0.0.1:9999")])


async def test_a_host_outside_allowed_hosts_is_refused_whatever_the_origin(cookie):
    assert not await handshake(cookie, "http://evil.example:8000", host="evil.example:8000")


async def test_over_tls_the_origin_must_be_https(cookie):
    assert await handshake(cookie, "https://localhost:8443", host="localhost:8443",
                           scheme="wss")
    assert not await handshake(cookie, "http://localhost:8443", host="localhost:8443",
                               scheme="wss")


async def test_behind_a_proxy_the_forwarded_scheme_and_host_count(cookie, settings):
    settings.ALLOWED_HOSTS = ["chat.example.com", "localhost"]
    settings.SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    settings.USE_X_FORWARDED_HOST = True
    proxied = [(b"x-forwarded-proto", b"https"), (b"x-forwarded-host", b"chat.example.com")]
    assert await handshake(cookie, "https://chat.example.com", host="localhost:8000",
                           headers=proxied)
    assert not await handshake(cookie, "http://chat.example.com", host="localhost:8000",
                               headers=proxied)
    assert not await handshake(cookie, "http://localhost:8000", host="localhost:8000",
                               headers=proxied)


async def test_trusted_origins_come_from_csrf_trusted_origins(cookie, settings):
    settings.CSRF_TRUSTED_ORIGINS = ["https://app.example.com", "https://*.example.org"]
    assert await handshake(cookie, "https://app.example.com")
    assert await handshake(cookie, "https://app.example.com:443")
    assert await handshake(cookie, "https://a.example.org")
    assert not await handshake(cookie, "http://app.example.com")
    assert not await handshake(cookie, "https://app.example.com:8443")
    assert not await handshake(cookie, "https://example.org.evil.example")
