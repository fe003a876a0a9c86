"""The workers' live stats, read from Redis and summed (selectors; no writes).

Each worker publishes its latest stats snapshot (``{prefix}:stats:{worker}``, the engine's
``stats()``: field names of ``shared/design/scheduler.md``) with a heartbeat; see
:mod:`inference.protocol`.
"""

from __future__ import annotations

import functools
import json
import time
from typing import Any

import redis
from django.conf import settings

from api.conf import platform_settings, redis_keys

# Summed over the workers; ``kv_pressure`` is averaged (each worker has its own pool).
SUMMED_FIELDS = (
    "num_pending", "num_prefilling", "num_active", "num_queued", "active_kv_reserved",
    "active_kv_budget", "kv_admit_blocked", "tokens_generated", "prompt_tokens_computed",
    "kv_blocks_total", "kv_blocks_held", "kv_blocks_free", "kv_blocks_evictable",
)
PER_KEY_FIELDS = ("vtc_counter", "in_flight", "pending", "prompt_tokens_served",
                  "completion_tokens_served")


@functools.cache
def _client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url)


def sync_client() -> redis.Redis:
    """A shared blocking Redis client (one connection pool per process)."""
    return _client(settings.REDIS_URL)


def worker_stats(client: redis.Redis | None = None) -> dict[str, dict[str, Any]]:
    """Each live worker's latest stats snapshot, by worker id."""
    client = client or sync_client()
    keys = redis_keys()
    ttl = platform_settings()["WORKER_HEARTBEAT_TTL_S"]
    workers = [w.decode() for w in client.zrangebyscore(keys.workers, time.time() - ttl, "+inf")]
    if not workers:
        return {}
    raw = client.mget([keys.stats(w) for w in workers])
    return {w: json.loads(r) for w, r in zip(workers, raw, strict=True) if r}


def gate1_queued(client: redis.Redis | None = None) -> int:
    """Requests accepted by the web tier and not yet admitted by any worker (gate 1)."""
    return int((client or sync_client()).get(redis_keys().queue) or 0)


def summarize(workers: dict[str, dict[str, Any]], queued: int) -> dict[str, Any]:
    """The dashboard's view of the workers' stats: totals, per fairness key, per worker.

    Returns:
        ``{"workers", "gate1_queued", "max_queue_size", "totals", "per_key", "per_worker"}``;
        ``totals`` holds :data:`SUMMED_FIELDS` and ``kv_pressure`` (the mean over workers);
        ``per_key`` maps each fairness key to :data:`PER_KEY_FIELDS` summed over workers;
        ``per_worker`` maps each worker to its ``tokens_generated``, ``uptime_s`` and
        ``published_at`` (for rates).
    """
    totals: dict[str, float] = {name: 0 for name in SUMMED_FIELDS}
    per_key: dict[str, dict[str, float]] = {}
    pressure = 0.0
    for snap in workers.values():
        for name in SUMMED_FIELDS:
            totals[name] += snap.get(name) or 0
        pressure += snap.get("kv_pressure") or 0.0
        for key, values in (snap.get("per_key") or {}).items():
            row = per_key.setdefault(key, dict.fromkeys(PER_KEY_FIELDS, 0))
            for name in PER_KEY_FIELDS:
                row[name] += values.get(name) or 0
    totals["kv_pressure"] = pressure / len(workers) if workers else 0.0
    return {
        "workers": len(workers),
        "gate1_queued": queued,
        "max_queue_size": platform_settings()["MAX_QUEUE_SIZE"],
        "totals": totals,
        "per_key": per_key,
        "per_worker": {
            w: {"tokens_generated": s.get("tokens_generated", 0),
                "uptime_s": s.get("uptime_s", 0.0), "published_at": s.get("published_at", 0.0),
                "num_active": s.get("num_active", 0), "kv_pressure": s.get("kv_pressure", 0.0)}
            for w, s in workers.items()
        },
    }


def live_summary(client: redis.Redis | None = None) -> dict[str, Any]:
    """:func:`summarize` of the live workers' stats now."""
    client = client or sync_client()
    return summarize(worker_stats(client), gate1_queued(client))


def tokens_rate(previous: dict[str, dict[str, Any]], current: dict[str, dict[str, Any]],
                interval_s: float) -> float:
    """Generated tokens per second between two ``per_worker`` readings ``interval_s`` apart.

    A worker whose count went down restarted: everything it counts is new. A worker not seen
    before counts only if it started within the interval (else its history is unknown).
    """
    if interval_s <= 0:
        return 0.0
    new_tokens = 0
    for worker, now in current.items():
        count = now.get("tokens_generated", 0)
        before = previous.get(worker)
        if before is None:
            new_tokens += count if now.get("uptime_s", 0.0) <= interval_s else 0
        elif count < before.get("tokens_generated", 0):
            new_tokens += count
        else:
            new_tokens += count - before.get("tokens_generated", 0)
    return new_tokens / interval_s


def context_tokens(workers: dict[str, dict[str, Any]], default: int) -> int:
    """The smallest context length (tokens) the live workers report, or ``default``."""
    lengths = [s["max_model_len"] for s in workers.values() if s.get("max_model_len")]
    return min(lengths) if lengths else default
