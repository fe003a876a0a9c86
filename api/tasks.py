"""Celery tasks: usage records from the worker's final events."""

from __future__ import annotations

from typing import Any

from celery import shared_task

from api import admission
from inference.protocol import USAGE_TASK_NAME
from tenants.models import UsageRecord


@shared_task(name=USAGE_TASK_NAME, ignore_result=True)
def record_usage(payload: dict[str, Any]) -> None:
    """Write the usage record of one finished request and settle its token reservations.

    ``payload``: ``request_id``, ``meta`` (from the request message), ``usage``
    (prompt/cached/completion tokens), ``finish_reason``, ``status``, ``error_code``, ``ttft_s``,
    ``duration_s``. Idempotent per request id: a redelivered task changes nothing.
    """
    meta = payload.get("meta") or {}
    usage = payload.get("usage") or {}
    _, created = UsageRecord.objects.get_or_create(
        request_id=payload["request_id"],
        defaults={
            "tenant_id": meta["tenant_id"],
            "api_key_id": meta.get("api_key_id"),
            "model": meta.get("model", ""),
            "prompt_tokens": usage.get("prompt_tokens", 0),
            "cached_prompt_tokens": usage.get("cached_prompt_tokens", 0),
            "completion_tokens": usage.get("completion_tokens", 0),
            "ttft_s": payload.get("ttft_s"),
            "duration_s": payload.get("duration_s"),
            "finish_reason": payload.get("finish_reason", ""),
            "status": payload.get("status", 200),
            "error_code": payload.get("error_code") or "",
        },
    )
    if created:
        actual = usage.get("prompt_tokens", 0) + usage.get("completion_tokens", 0)
        admission.settle(meta, actual)
