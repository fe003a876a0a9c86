"""Server-sent events framing (``text/event-stream``)."""

from __future__ import annotations

import json
from typing import Any

DONE = "data: [DONE]\n\n"
KEEPALIVE = ": waiting\n\n"


def sse_data(obj: Any) -> str:
    """One SSE event whose ``data`` is ``obj`` as compact JSON (never spans lines)."""
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"
