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
    - entries of each priority tier's requests stream that every worker has read and
      acknowledged, once older than ``REQUESTS_STREAM_RETENTION_S`` (a stream is never trimmed
      past an unread or unacknowledged entry);
    - events streams left without an expiry whose last event is older than their TTL;
    - heartbeats of workers silent for ``DEAD_WORKER_AFTER_S``, and the consumers of every
      tier's group idle that long that hold no unacknowledged entry.

    The tier registry and the (possibly empty) tier streams themselves are kept: a tier's
    stream and group are where its next request goes.

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


def _stream_id(entry_id: bytes | str) -> tuple[int, int]:
    """``(milliseconds, sequence)`` of a stream entry id."""
    value = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = value.partition("-")
    return int(ms), int(seq or 0)


def _stream_id_ms(entry_id: bytes | str) -> int:
    return _stream_id(entry_id)[0]


def _trim_requests_stream(client: redis.Redis, stream: str, now_ms: int,
                          conf: dict[str, Any]) -> tuple[int, int]:
    """Trim one tier's requests stream and drop its group's dead consumers.

    Returns:
        (entries trimmed, consumers deleted).
    """
    try:
        groups = client.xinfo_groups(stream)
    except redis.ResponseError:  # no stream
        return 0, 0
    group = next((g for g in groups if g["name"] in (CONSUMER_GROUP, CONSUMER_GROUP.encode())),
                 None)
    if group is None:
        return 0, 0
    # Everything before the first unread or unacknowledged entry is done with.
    ms, seq = _stream_id(group["last-delivered-id"])
    keep_from = (ms, seq + 1)
    pending = client.xpending(stream, CONSUMER_GROUP)
    if pending["pending"]:
        keep_from = min(keep_from, _stream_id(pending["min"]))
    keep_from = min(keep_from, (now_ms - int(conf["REQUESTS_STREAM_RETENTION_S"] * 1000), 0))
    trimmed = client.xtrim(stream, minid=f"{keep_from[0]}-{keep_from[1]}", approximate=False)
    consumers = 0
    for consumer in client.xinfo_consumers(stream, CONSUMER_GROUP):
        if consumer["pending"] == 0 and consumer["idle"] > conf["DEAD_WORKER_AFTER_S"] * 1000:
            client.xgroup_delconsumer(stream, CONSUMER_GROUP, consumer["name"])
            consumers += 1
    return trimmed, consumers


def trim_redis(client: redis.Redis, conf: dict[str, Any]) -> dict[str, int]:
    """The Redis part of :func:`cleanup`."""
    keys = redis_keys()
    now_ms = int(time.time() * 1000)
    result = {"requests_trimmed": 0, "event_streams": 0, "dead_workers": 0, "consumers": 0}

    for _, score in client.zrange(keys.request_tiers, 0, -1, withscores=True):
        trimmed, consumers = _trim_requests_stream(client, keys.requests(int(score)), now_ms,
                                                   conf)
        result["requests_trimmed"] += trimmed
        result["consumers"] += consumers

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
