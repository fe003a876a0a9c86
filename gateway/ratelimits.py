"""What the rate limiter holds for a request, as OpenAI's ``x-ratelimit-*`` response headers.

The admission script (``inference/protocol/lua/admit.lua``) reports, for every moving window that
applies to a request (requests and tokens per minute, per API key and per tenant), the use it
counted (this request included when admitted) and the milliseconds until the window is empty again.
The headers tell the client, for requests and for tokens:

- ``x-ratelimit-limit-*``: the limit (per minute);
- ``x-ratelimit-remaining-*``: what the window has left (tokens count as reserved at admission,
  ``prompt + max_tokens``, until the request's usage settles them to what it used);
- ``x-ratelimit-reset-*``: the time until the window is back to its full limit, when every use it
  holds has left it, in OpenAI's duration format (``1m0s``, ``1s``, ``250ms``).

When both a key's and its tenant's window of a kind apply, the tighter one (the least remaining)
is told. A kind without a limit gets no headers.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

KINDS = ("requests", "tokens")
# Where an admitted request's windows are kept in its (web-side) message meta.
META_KEY = "rate_limits"


@dataclass(frozen=True)
class WindowUse:
    """One window as the admission script saw it: ``used`` counts this request if admitted."""

    kind: str
    limit: int
    used: int
    reset_ms: int

    @property
    def remaining(self) -> int:
        return max(0, self.limit - self.used)


def window_uses(spec_windows: list[dict[str, Any]], reported: Any) -> list[WindowUse]:
    """The script's report (``[used, reset_ms]`` per window of the spec, in order) as uses.

    A report that does not match the spec tells nothing (the headers are left out, the request
    is served all the same).
    """
    if not isinstance(reported, list) or len(reported) != len(spec_windows):
        return []  # cjson also encodes an empty array as an object
    return [WindowUse(kind=w["kind"], limit=int(w["limit"]), used=int(used),
                      reset_ms=max(0, int(reset_ms)))
            for w, (used, reset_ms) in zip(spec_windows, reported, strict=True)]


def to_meta(uses: list[WindowUse]) -> list[dict[str, Any]]:
    return [asdict(use) for use in uses]


def from_meta(meta: dict[str, Any]) -> list[WindowUse]:
    return [WindowUse(**use) for use in meta.get(META_KEY) or []]


def duration(ms: int) -> str:
    """A duration as OpenAI writes it (Go's): ``250ms``, ``1s``, ``1m30.5s``, ``1h0m0s``, ``0s``."""
    ms = max(0, int(ms))
    if ms < 1000:
        return f"{ms}ms" if ms else "0s"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    seconds = f"{rest / 1000:.3f}".rstrip("0").rstrip(".")
    return (f"{hours}h" if hours else "") + (f"{minutes}m" if hours or minutes else "") + \
        f"{seconds}s"


def headers(uses: list[WindowUse]) -> dict[str, str]:
    """The ``x-ratelimit-*`` headers of ``uses`` (none for a kind without a window)."""
    out: dict[str, str] = {}
    for kind in KINDS:
        of_kind = [use for use in uses if use.kind == kind]
        if not of_kind:
            continue
        tightest = min(of_kind, key=lambda use: (use.remaining, -use.reset_ms, use.limit))
        out[f"x-ratelimit-limit-{kind}"] = str(tightest.limit)
        out[f"x-ratelimit-remaining-{kind}"] = str(tightest.remaining)
        out[f"x-ratelimit-reset-{kind}"] = duration(tightest.reset_ms)
    return out


def response_headers(meta: dict[str, Any]) -> dict[str, str]:
    """The ``x-ratelimit-*`` headers of an admitted request, from its message ``meta``."""
    return headers(from_meta(meta))
