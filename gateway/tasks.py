"""Celery tasks of the web tier's side of the protocol: recording what each request used."""

from __future__ import annotations

from typing import Any

from celery import shared_task

from gateway import admission
from gateway.errors import final_status
from inference.protocol import USAGE_TASK_NAME, UsageReport
from tenants.models import UsageRecord


@shared_task(name=USAGE_TASK_NAME, ignore_result=True)
def record_usage(payload: dict[str, Any]) -> None:
    """Write the usage record of one finished request and settle its token reservations.

    ``payload``: a :class:`~inference.protocol.UsageReport` (validated here). Idempotent per
    request id: a redelivered task changes nothing.

    Raises:
        pydantic.ValidationError: the payload is not a usage report.
    """
    report = UsageReport.model_validate(payload)
    meta, usage = report.meta, report.usage
    _, created = UsageRecord.objects.get_or_create(
        request_id=report.request_id,
        defaults={
            "tenant_id": meta["tenant_id"],
            "api_key_id": meta.get("api_key_id"),
            "model": meta.get("model", ""),
            "prompt_tokens": usage.prompt_tokens,
            "cached_prompt_tokens": usage.cached_prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "ttft_s": report.ttft_s,
            "duration_s": report.duration_s,
            "finish_reason": report.finish_reason.value,
            "status": final_status(report.finish_reason, report.error),
            "error_code": report.error.code.value if report.error else "",
        },
    )
    if created:
        admission.settle(meta, usage.prompt_tokens + usage.completion_tokens)
