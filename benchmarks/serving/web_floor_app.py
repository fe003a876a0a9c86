"""The applications :mod:`benchmarks.serving.web_floor` serves with daphne: an SSE stream of
``FLOOR_WRITES`` chunks, one every ``FLOOR_GAP_S`` seconds, each a completions chunk of the size
the platform writes.

``/ready`` answers 204 at once (the benchmark waits for it).

* ``asgi``: a bare ASGI application (no framework): what daphne and Twisted cost per write;
* ``django``: Django's ``StreamingHttpResponse`` of an async generator, no middleware, no
  database: what Django's streaming adds.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from typing import Any

WRITES = int(os.environ.get("FLOOR_WRITES", "256"))
GAP_S = float(os.environ.get("FLOOR_GAP_S", "0.1"))
# Two tokens' chunk, as the platform's completions stream writes it with its event hold.
CHUNK = (b'data: {"id":"cmpl-0123456789abcdef0123456789abcdef","object":"text_completion",'
         b'"created":1765000000,"model":"SmolLM2-135M-Instruct","choices":[{"index":0,'
         b'"text":" hello world","logprobs":null,"finish_reason":null}]}\n\n')


async def asgi(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """The bare ASGI application."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    if scope["type"] != "http":
        return
    if scope["path"] == "/ready":
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})
        return
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream")]})
    for _ in range(WRITES):
        await asyncio.sleep(GAP_S)
        await send({"type": "http.response.body", "body": CHUNK, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _chunks() -> AsyncIterator[bytes]:
    for _ in range(WRITES):
        await asyncio.sleep(GAP_S)
        yield CHUNK


def _django_application() -> Any:
    from django.conf import settings

    settings.configure(DEBUG=False, ROOT_URLCONF=__name__, ALLOWED_HOSTS=["*"], MIDDLEWARE=[],
                       SECRET_KEY="web-floor", INSTALLED_APPS=[])
    import django

    django.setup()
    from django.core.asgi import get_asgi_application

    return get_asgi_application()


async def _view(request: Any) -> Any:
    from django.http import StreamingHttpResponse

    return StreamingHttpResponse(_chunks(), content_type="text/event-stream")


def _ready(request: Any) -> Any:
    from django.http import HttpResponse

    return HttpResponse(status=204)


def _urls() -> list[Any]:
    if os.environ.get("FLOOR_APP") != "django":
        return []
    from django.urls import path

    return [path("", _view), path("ready", _ready)]


urlpatterns = _urls()
django = _django_application() if os.environ.get("FLOOR_APP") == "django" else None
