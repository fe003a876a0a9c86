"""Server-sent events framing (``text/event-stream``)."""

from __future__ import annotations

import json
from typing import Any

DONE = "data: [DONE]\n\n"
KEEPALIVE = ": waiting\n\n"


def sse_data(obj: Any) -> str:
    """One SSE event whose ``data`` is ``obj`` as compact JSON (never spans lines).

    Text is sent as UTF-8, unless it holds what UTF-8 cannot carry (a lone surrogate): then as
    JSON's ``\\u`` escapes, so that encoding the stream can never fail once it has begun.
    """
    data = json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    try:
        data.encode("utf-8")
    except UnicodeEncodeError:
        data = json.dumps(obj, separators=(",", ":"))
    return f"data: {data}\n\n"


def sse_event(name: str, obj: Any) -> str:
    """:func:`sse_data` under the event name ``name`` (an ``event:`` line first), as the
    Responses API's typed events are sent."""
    return f"event: {name}\n{sse_data(obj)}"
