"""Celery beat tasks: stats snapshots for the dashboard's charts, and housekeeping."""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import Any

import redis
from celery import shared_task
from django.utils import timezone

from api.conf import redis_keys
from dashboard.conf import dashboard_settings
from dashboard.models import StatsSnapshot
from dashboard.stats import live_summary, sync_client, tokens_rate
from inference.protocol import CONSUMER_GROUP, EVENTS_TTL_S

log = logging.getLogger(__name__)

SNAPSHOT_TASK = "dashboard.tasks.snapshot_stats"
CLEANUP_TASK = "dashboard.tasks.cleanup"


@shared_task(name=SNAPSHOT_TASK, ignore_result=True)
def snapshot_stats() -> int:
    """Store the live workers' summed stats as a :class:`StatsSnapshot`; return its id."""
    summary = live_summary()
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
    return snapshot.pk


@shared_task(name=CLEANUP_TASK, ignore_result=True)
def cleanup() -> dict[str, int]:
    """Delete old snapshots and trim what Redis would otherwise keep for ever.

    - snapshots older than ``SNAPSHOT_RETENTION_S``;
    - entries of the requests stream that every worker has read and acknowledged, once older
      than ``REQUESTS_STREAM_RETENTION_S`` (the stream is never trimmed past an unread or
      unacknowledged entry);
    - events streams left without an expiry whose last event is older than their TTL;
    - heartbeats of workers silent for ``DEAD_WORKER_AFTER_S``, and idle consumers of the
      group that hold no unacknowledged entry.

    Returns:
        How many of each were removed.
    """
    conf = dashboard_settings()
    cutoff = timezone.now() - timedelta(seconds=conf["SNAPSHOT_RETENTION_S"])
    deleted, _ = StatsSnapshot.objects.filter(taken_at__lt=cutoff).delete()
    client = sync_client()
    result = {"snapshots": deleted}
    result.update(trim_redis(client, conf))
    log.info("cleanup: %s", result)
    return result


def _stream_id_ms(entry_id: bytes | str) -> int:
    value = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(value.split("-", 1)[0])


def trim_redis(client: redis.Redis, conf: dict[str, Any]) -> dict[str, int]:
    """The Redis part of :func:`cleanup`."""
    keys = redis_keys()
    now_ms = int(time.time() * 1000)
    result = {"requests_trimmed": 0, "event_streams": 0, "dead_workers": 0, "consumers": 0}

    try:
        groups = client.xinfo_groups(keys.requests)
    except redis.ResponseError:  # no stream yet
        groups = []
    group = next((g for g in groups if g["name"] in (CONSUMER_GROUP, CONSUMER_GROUP.encode())),
                 None)
    if group is not None:
        # Everything before the first unread or unacknowledged entry is done with.
        safe_ms = _stream_id_ms(group["last-delivered-id"]) + 1
        pending = client.xpending(keys.requests, CONSUMER_GROUP)
        if pending["pending"]:
            safe_ms = min(safe_ms, _stream_id_ms(pending["min"]))
        keep_from = min(safe_ms, now_ms - int(conf["REQUESTS_STREAM_RETENTION_S"] * 1000))
        result["requests_trimmed"] = client.xtrim(keys.requests, minid=f"{keep_from}-0",
                                                  approximate=False)
        for consumer in client.xinfo_consumers(keys.requests, CONSUMER_GROUP):
            if (consumer["pending"] == 0
                    and consumer["idle"] > conf["DEAD_WORKER_AFTER_S"] * 1000):
                client.xgroup_delconsumer(keys.requests, CONSUMER_GROUP, consumer["name"])
                result["consumers"] += 1

    for name in client.scan_iter(match=keys.events("*"), count=500, _type="stream"):
        if client.ttl(name) != -1:
            continue  # expires on its own
        last = client.xrevrange(name, count=1)
        if not last or now_ms - _stream_id_ms(last[0][0]) > EVENTS_TTL_S * 1000:
            client.delete(name)
            result["event_streams"] += 1

    result["dead_workers"] = client.zremrangebyscore(
        keys.workers, "-inf", time.time() - conf["DEAD_WORKER_AFTER_S"])
    return result
