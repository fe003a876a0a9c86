"""The platform's settings (``settings.LLM_PLATFORM``), read at call time, never at import."""

from __future__ import annotations

from typing import Any

from django.conf import settings

from inference.protocol.keys import Keys


def platform_settings() -> dict[str, Any]:
    """The ``LLM_PLATFORM`` settings dict (built in ``llm_platform.settings``)."""
    return settings.LLM_PLATFORM


def redis_keys() -> Keys:
    """Redis key names under the configured ``REDIS_PREFIX``."""
    return Keys(platform_settings()["REDIS_PREFIX"])
