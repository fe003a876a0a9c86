"""Every new usage record feeds the Prometheus counters and latency histograms."""

from __future__ import annotations

import logging

from django.db.models.signals import post_save
from django.dispatch import receiver

from dashboard.recorder import Tally, record_request
from gateway.clients import sync_redis
from gateway.usage import recorded_many
from tenants.models import Tenant, UsageRecord

log = logging.getLogger(__name__)


@receiver(post_save, sender=UsageRecord, dispatch_uid="dashboard.usage_metrics")
def count_usage(sender, instance: UsageRecord, created: bool, **kwargs) -> None:
    """Count a new usage record in Redis (metrics must never fail the record itself)."""
    if not created:
        return
    try:
        slug = Tenant.objects.filter(pk=instance.tenant_id).values_list("slug", flat=True).first()
        record_request(sync_redis(), tenant=slug or str(instance.tenant_id),
                       status=instance.status, prompt_tokens=instance.prompt_tokens,
                       cached_prompt_tokens=instance.cached_prompt_tokens,
                       completion_tokens=instance.completion_tokens, ttft_s=instance.ttft_s,
                       duration_s=instance.duration_s, billed_tokens=instance.billed_tokens,
                       batch=instance.is_batch, model=instance.model,
                       adapter=instance.adapter)
    except Exception:  # noqa: BLE001 - metrics are best effort
        log.exception("could not count usage of %s in the metrics", instance.request_id)


@receiver(recorded_many, sender=UsageRecord, dispatch_uid="dashboard.usage_metrics_many")
def count_usage_many(sender, records: list[UsageRecord], **kwargs) -> None:
    """Count the usage records written by one insert (one query, one Redis round trip)."""
    try:
        slugs = dict(Tenant.objects.filter(pk__in={r.tenant_id for r in records})
                     .values_list("pk", "slug"))
        tally = Tally()  # one command a counter for all of them
        for row in records:
            tally.add(tenant=slugs.get(row.tenant_id) or str(row.tenant_id),
                      status=row.status, prompt_tokens=row.prompt_tokens,
                      cached_prompt_tokens=row.cached_prompt_tokens,
                      completion_tokens=row.completion_tokens, ttft_s=row.ttft_s,
                      duration_s=row.duration_s, billed_tokens=row.billed_tokens,
                      batch=row.is_batch, model=row.model, adapter=row.adapter)
        tally.send(sync_redis())
    except Exception:  # noqa: BLE001 - metrics are best effort
        log.exception("could not count %d usage records in the metrics", len(records))
