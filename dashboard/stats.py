"""The dashboard's view of the workers: live figures and the token rate between readings.

The workers' snapshots and their aggregate come from :mod:`gateway.workers` (one aggregation for
``/scheduler/stats``, the dashboard and ``/metrics``).
"""

from __future__ import annotations

from typing import Any

import redis

from gateway import batch_metrics, workers
from gateway.clients import sync_redis

# The dashboard's totals: queue lengths, KV figures and token counters of the deployment.
TOTAL_FIELDS = (
    "num_pending", "num_prefilling", "num_active", "num_queued", "active_kv_reserved",
    "active_kv_budget", "kv_admit_blocked", "tokens_generated", "prompt_tokens_computed",
    "kv_blocks_total", "kv_blocks_held", "kv_blocks_free", "kv_blocks_evictable", "kv_pressure",
    "preemptions", "preempted_tokens_recomputed", "structured",
)


def summarize(snapshots: dict[str, dict[str, Any]], queued: int,
              queued_by_model: dict[str, int] | None = None) -> dict[str, Any]:
    """The dashboard's view of the workers' stats: totals, per fairness key, per worker, per
    base model (``queued_by_model``: each model's gate 1 count; ``queued``: their sum).

    Returns:
        ``{"workers", "gate1_queued", "max_queue_size", "totals", "per_key", "per_worker",
        "per_model", "per_adapter"}``;
        ``totals`` holds :data:`TOTAL_FIELDS` of :func:`gateway.workers.aggregate` (0 without
        workers); ``per_key`` maps each fairness key to its aggregate; ``per_worker`` maps each
        worker to its ``tokens_generated``, ``uptime_s`` and ``published_at`` (for rates),
        ``num_active`` and ``kv_pressure``; ``per_model`` maps each model to its ``workers``,
        ``gate1_queued``, ``num_pending``, ``num_active``, ``kv_pressure`` and
        ``tokens_generated``; ``per_adapter`` maps each LoRA adapter loaded or running to the
        ``workers`` holding it and its ``running`` rows.
    """
    total = workers.aggregate(list(snapshots.values()))
    gate1 = workers.gate1(queued)
    return {
        "workers": len(snapshots),
        "gate1_queued": gate1["queued"],
        "max_queue_size": gate1["max_queue_size"],
        "totals": {name: total.get(name) or 0 for name in TOTAL_FIELDS},
        "per_key": total["per_key"],
        "per_model": _per_model(snapshots, queued_by_model or {}),
        "per_adapter": _per_adapter(snapshots),
        "per_worker": {
            w: {"tokens_generated": s.get("tokens_generated", 0),
                "uptime_s": s.get("uptime_s", 0.0), "published_at": s.get("published_at", 0.0),
                "num_active": s.get("num_active", 0), "kv_pressure": s.get("kv_pressure", 0.0)}
            for w, s in snapshots.items()
        },
    }


def _per_adapter(snapshots: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each LoRA adapter some worker holds loaded or runs: ``workers`` holding it loaded and
    ``running`` rows under it, over the live workers."""
    out: dict[str, dict[str, Any]] = {}
    for snap in snapshots.values():
        figures = snap.get("adapters") or {}
        for name in set(figures.get("loaded") or []):  # tenants' adapters may share a name
            out.setdefault(name, {"workers": 0, "running": 0})["workers"] += 1
        for name, rows in (figures.get("running") or {}).items():
            out.setdefault(name, {"workers": 0, "running": 0})["running"] += rows
    return dict(sorted(out.items()))


def _per_model(snapshots: dict[str, dict[str, Any]],
               queued: dict[str, int]) -> dict[str, dict[str, Any]]:
    groups = workers.by_model(snapshots)
    out = {}
    for model in sorted({*groups, *queued}):
        total = workers.aggregate(list(groups.get(model, {}).values()))
        out[model] = {"workers": total["workers"], "gate1_queued": queued.get(model, 0),
                      **{name: total.get(name) or 0 for name in (
                          "num_pending", "num_active", "kv_pressure", "tokens_generated")}}
    return out


def live_summary(client: redis.Redis | None = None) -> dict[str, Any]:
    """:func:`summarize` of the live workers' stats now, and the batches in progress
    (``batches``: :func:`gateway.batch_metrics.read`)."""
    client = client or sync_redis()
    snapshots = workers.worker_snapshots_sync(client)
    queued = {model: workers.gate1_queued_sync(client, model)
              for model in workers.known_models_sync(snapshots, client)}
    return {**summarize(snapshots, sum(queued.values()), queued),
            "batches": batch_metrics.read(client)}


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
