"""Celery beat tasks: stats snapshots for the dashboard's charts, and housekeeping."""

from __future__ import annotations

import logging
from datetime import timedelta

from celery import shared_task
from django.utils import timezone

from dashboard.conf import dashboard_settings
from dashboard.models import StatsSnapshot
from dashboard.stats import live_summary, tokens_rate
from gateway.clients import sync_redis
from gateway.housekeeping import trim_redis
from tenants.best_effort import BestEffortWrite

log = logging.getLogger(__name__)

SNAPSHOT_TASK = "dashboard.tasks.snapshot_stats"
CLEANUP_TASK = "dashboard.tasks.cleanup"


# A snapshot is one point of a chart: a database that refuses it skips it (logged once in a
# while).
SNAPSHOT_WRITE = BestEffortWrite("a stats snapshot")


@shared_task(name=SNAPSHOT_TASK, ignore_result=True)
def snapshot_stats() -> int | None:
    """Store the live workers' summed stats as a :class:`StatsSnapshot`; return its id, or None
    when the database refused it (:data:`SNAPSHOT_WRITE`: the chart has a gap).

    Raises:
        redis.RedisError: the stats could not be read.
    """
    summary = live_summary()
    snapshot = SNAPSHOT_WRITE(_store_snapshot, summary)
    return snapshot.pk if snapshot is not None else None


def _store_snapshot(summary: dict) -> StatsSnapshot:
    now = timezone.now()
    previous = StatsSnapshot.objects.order_by("-taken_at").first()
    rate = 0.0
    if previous is not None:
        interval = (now - previous.taken_at).total_seconds()
        rate = tokens_rate(previous.per_worker, summary["per_worker"], interval)
    totals = summary["totals"]
    snapshot = StatsSnapshot.objects.create(
        taken_at=now,
        workers=summary["workers"],
        gate1_queued=summary["gate1_queued"],
        num_pending=totals["num_pending"],
        num_prefilling=totals["num_prefilling"],
        num_active=totals["num_active"],
        kv_pressure=totals["kv_pressure"],
        active_kv_reserved=totals["active_kv_reserved"],
        active_kv_budget=totals["active_kv_budget"],
        kv_admit_blocked=totals["kv_admit_blocked"],
        tokens_generated=totals["tokens_generated"],
        prompt_tokens_computed=totals["prompt_tokens_computed"],
        tokens_per_s=rate,
        per_worker=summary["per_worker"],
        per_key=summary["per_key"],
    )
    return snapshot


@shared_task(name=CLEANUP_TASK, ignore_result=True)
def cleanup() -> dict[str, int]:
    """Delete snapshots older than ``SNAPSHOT_RETENTION_S`` and trim Redis.

    Redis: :func:`gateway.housekeeping.trim_redis`.

    Returns:
        How many of each were removed.
    """
    conf = dashboard_settings()
    cutoff = timezone.now() - timedelta(seconds=conf["SNAPSHOT_RETENTION_S"])
    deleted, _ = StatsSnapshot.objects.filter(taken_at__lt=cutoff).delete()
    result = {"snapshots": deleted}
    result.update(trim_redis(sync_redis()))
    log.info("cleanup: %s", result)
    return result
