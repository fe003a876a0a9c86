"""The chat's own settings (``settings.CHAT``), read at call time with these defaults."""

from __future__ import annotations

from typing import Any

from django.conf import settings

DEFAULTS: dict[str, Any] = {
    # Answer length cap (tokens); the worker lowers it to what is left of the context.
    "MAX_TOKENS": 512,
    # Sampling of chat answers.
    "TEMPERATURE": 0.7,
    "TOP_P": 0.9,
    # Context length (tokens) assumed when no live worker reports its own.
    "CONTEXT_TOKENS": 2048,
    # Tokens kept free besides the answer, for the difference between the web tier's count and
    # the worker's (chat template markers).
    "CONTEXT_MARGIN_TOKENS": 16,
    # The fewest answer tokens a turn is sent with; older turns are dropped to make room.
    "MIN_ANSWER_TOKENS": 64,
    # Prepended to every conversation when not empty.
    "SYSTEM_PROMPT": "",
    # After Stop, how long to wait for the worker's final event before ending anyway (seconds).
    "STOP_GRACE_S": 5.0,
    # How often an open chat socket re-checks, between frames, that its session, user and tenant
    # still allow it to chat (seconds; 0: only when a frame comes); every frame is checked.
    "REAUTHORIZE_INTERVAL_S": 10.0,
    # How long an answer goes on after its page went away (a dropped connection, a reload, a
    # web process restarted), waiting for the page to come back and take it up again (seconds;
    # 0: a closed page stops its answer at once). At most MAX_RESUME_GRACE_S.
    "RESUME_GRACE_S": 30.0,
}
# The events of an answer stay in Redis EVENTS_TTL_S (600 s) after its last one: a page coming
# back within its grace period must still find them all.
MAX_RESUME_GRACE_S = 300.0


def chat_settings() -> dict[str, Any]:
    """The chat settings: ``settings.CHAT`` over :data:`DEFAULTS`."""
    return {**DEFAULTS, **getattr(settings, "CHAT", {})}


def resume_grace_s() -> float:
    """``RESUME_GRACE_S``, within 0 and :data:`MAX_RESUME_GRACE_S` (the system check
    ``chat.E001`` reports a value outside)."""
    return min(max(float(chat_settings()["RESUME_GRACE_S"]), 0.0), MAX_RESUME_GRACE_S)
