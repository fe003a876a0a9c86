"""The platform's settings (``settings.LLM_PLATFORM``), read at call time, never at import."""

from __future__ import annotations

from typing import Any

from django.conf import settings

from inference.protocol.keys import Keys


def platform_settings() -> dict[str, Any]:
    """The ``LLM_PLATFORM`` settings dict (built in ``llm_platform.settings``)."""
    return settings.LLM_PLATFORM


def redis_keys(model: str | None = None) -> Keys:
    """Redis key names under the configured ``REDIS_PREFIX``, with the shared queue of ``model``
    (a base model's name; None: the default model, ``SERVED_MODEL_NAME``)."""
    conf = platform_settings()
    keys = Keys(conf["REDIS_PREFIX"])
    return keys if model is None else keys.of_model(model, conf["SERVED_MODEL_NAME"])


def message_model(meta: dict[str, Any]) -> str:
    """The base model a request message is for (its ``meta["model"]``; none: the default)."""
    return str(meta.get("model") or platform_settings()["SERVED_MODEL_NAME"])
