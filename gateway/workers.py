"""The inference workers as the web tier sees them: liveness, stats snapshots, their aggregate.

Each worker publishes its latest stats snapshot (``{prefix}:stats:{worker}``: the engine's
``stats()`` plus ``worker_id``, ``held_in_gate1`` and ``published_at``) with a heartbeat (see
:mod:`inference.protocol`). :func:`aggregate` is the one way several snapshots become the
deployment's figures, with a rule per field; ``/scheduler/stats``, the dashboard and ``/metrics``
all use it. A worker counts as alive by :func:`alive_workers`, which judges heartbeats against the
event loop's own sight of Redis (:mod:`inference.protocol.liveness`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from enum import Enum
from typing import Any

import redis

from gateway.clients import aredis, sight, sync_redis
from gateway.conf import platform_settings, redis_keys
from gateway.scripts import LuaScript
from inference.protocol.keys import queue_script
from inference.protocol.liveness import declares_dead


class Rule(Enum):
    """How one stats field of several workers becomes the deployment's value."""

    SUM = "sum"  # counts and capacities that add up (queues, blocks, tokens)
    MAX = "max"  # times: the latest publication, the longest uptime or tick
    MIN = "min"  # the context every worker serves (a request may land on any)
    SAME = "same"  # per-worker settings: their common value, or None when the workers differ


FIELD_RULES: dict[str, Rule] = {
    **dict.fromkeys((
        "num_pending", "num_pending_batch", "num_prefilling", "num_active", "num_queued",
        "held_in_gate1",
        "events_unsent",
        "active_kv_reserved", "active_kv_budget", "kv_admit_blocked", "tick_count",
        "tick_seconds_total",
        "tokens_generated", "prompt_tokens_computed", "kv_blocks_total", "kv_blocks_held",
        "kv_blocks_free", "kv_blocks_evictable", "kv_blocks_reserved", "prefix_hit_tokens",
        "prefix_queried_tokens", "kv_block_evictions", "admissions_soft_held",
        "admissions_hard_rejected", "requests_finished", "preemptions",
        "preempted_tokens_recomputed", "batch_preemptions", "batch_tokens_recomputed",
        "batch_itl_held", "batch_decode_waits", "batch_passes_yielded",
        # structured outputs: a dict of counts (constrained requests, compile-cache hits,
        # refusals by reason, masks, forced tokens), summed per entry
        "structured"), Rule.SUM),
    **dict.fromkeys(("published_at", "uptime_s", "last_tick_s"), Rule.MAX),
    "max_model_len": Rule.MIN,
    **dict.fromkeys(("policy", "prefill_mode", "kv_block_size", "max_batch_size", "max_pending",
                     "dtype", "preemption", "batch_itl_slack_ms",
                     "batch_itl_slack_fraction"), Rule.SAME),
}
# Fields that only mean something for one worker (its own cost model and last pass, the rows it
# may preempt): shown in each worker's snapshot, left out of the deployment's total.
PER_WORKER_ONLY = frozenset({"tick_budget", "preemptible_rows"})
# Per fairness key: served tokens add up; each worker keeps its own VTC counter (the largest is
# shown: the most any worker has charged the key).
PER_KEY_RULES: dict[str, Rule] = {
    **dict.fromkeys(("in_flight", "pending", "tokens_served", "prompt_tokens_served",
                     "completion_tokens_served", "weighted_service"), Rule.SUM),
    "vtc_counter": Rule.MAX,
}
# Ratios are recomputed from the summed parts, never averaged: (numerator, denominator).
RATIOS = {"kv_pressure": ("kv_blocks_held", "kv_blocks_total"),
          "prefix_hit_rate": ("prefix_hit_tokens", "prefix_queried_tokens")}


def _combine(rule: Rule, values: list[Any]) -> Any:
    if not values:
        return None
    if rule is Rule.SAME:
        return values[0] if all(v == values[0] for v in values) else None
    if isinstance(values[0], Mapping):  # per-gate or per-reason counters: combine per entry
        names = {name for value in values for name in value}
        return {name: _combine(rule, [v[name] for v in values if name in v])
                for name in sorted(names)}
    return {Rule.SUM: sum, Rule.MAX: max, Rule.MIN: min}[rule](values)


def aggregate(snapshots: list[dict[str, Any]]) -> dict[str, Any]:
    """The deployment's stats from several workers' snapshots, by :data:`FIELD_RULES`.

    Fields without a rule (``worker_id``) are left out; ``per_key`` is combined by
    :data:`PER_KEY_RULES`; the ratios of :data:`RATIOS` are recomputed from the sums.

    Returns:
        ``{field: value}`` plus ``workers`` (how many snapshots) and ``per_key``.
    """
    total: dict[str, Any] = {"workers": len(snapshots)}
    for name, rule in FIELD_RULES.items():
        values = [snap[name] for snap in snapshots if snap.get(name) is not None]
        if values:
            total[name] = _combine(rule, values)
    for name, (part, whole) in RATIOS.items():
        total[name] = total[part] / total[whole] if total.get(whole) else 0.0
    rows_by_key: dict[str, list[dict[str, Any]]] = {}
    for snap in snapshots:
        for key, row in (snap.get("per_key") or {}).items():
            rows_by_key.setdefault(key, []).append(row)
    total["per_key"] = {
        key: {name: _combine(rule, [r[name] for r in rows if name in r])
              for name, rule in PER_KEY_RULES.items()}
        for key, rows in rows_by_key.items()}
    return total


def _live_ids(members: list[bytes]) -> list[str]:
    return [m.decode() for m in members]


def _since() -> float:
    return time.time() - platform_settings()["WORKER_HEARTBEAT_TTL_S"]


async def alive_workers() -> list[str]:
    """Ids of the workers alive as this event loop judges them: a heartbeat younger than
    ``WORKER_HEARTBEAT_TTL_S``, or one it cannot tell dead
    (:func:`inference.protocol.liveness.declares_dead`): for a TTL after Redis stopped answering
    it (no worker could beat), or when every heartbeat is stale at once, a worker not yet
    reclaimed is not taken for gone, so requests wait for it instead of being refused."""
    beats = await aredis().zrange(redis_keys().workers, 0, -1, withscores=True)
    seen = sight()
    seen.answered()
    return judged_alive(beats, seen.seconds(), time.time())


async def beating_workers() -> list[str]:
    """Ids of the workers whose heartbeat is younger than ``WORKER_HEARTBEAT_TTL_S`` (what
    ``/readyz`` counts: a readiness probe says ready only once a worker has beaten within its
    TTL, whereas :func:`alive_workers` also keeps a worker that this process cannot tell dead)."""
    return _live_ids(await aredis().zrangebyscore(redis_keys().workers, _since(), "+inf"))


def judged_alive(beats: list[tuple[bytes, float]], sight_s: float, now: float) -> list[str]:
    """The members of ``beats`` (worker id, heartbeat unix time) not declared dead by a judge
    with ``sight_s`` seconds of sight of Redis at unix time ``now``."""
    ttl = platform_settings()["WORKER_HEARTBEAT_TTL_S"]
    freshest = max((float(beat) for _, beat in beats), default=now)
    return [member.decode() for member, beat in beats
            if not declares_dead(now - float(beat), now - freshest, sight_s, ttl)]


async def worker_snapshots() -> dict[str, dict[str, Any]]:
    """Each live worker's latest stats snapshot, by worker id."""
    workers = await alive_workers()
    if not workers:
        return {}
    keys = redis_keys()
    raw = await aredis().mget([keys.stats(w) for w in workers])
    return {w: json.loads(r) for w, r in zip(workers, raw, strict=True) if r}


def worker_snapshots_sync(client: redis.Redis | None = None) -> dict[str, dict[str, Any]]:
    """:func:`worker_snapshots` for blocking callers (Celery tasks, ``/metrics``)."""
    client = client or sync_redis()
    keys = redis_keys()
    workers = _live_ids(client.zrangebyscore(keys.workers, _since(), "+inf"))
    if not workers:
        return {}
    raw = client.mget([keys.stats(w) for w in workers])
    return {w: json.loads(r) for w, r in zip(workers, raw, strict=True) if r}


GATE1_LUA = LuaScript(queue_script("gate1"))


def gate1_queued_sync(client: redis.Redis | None = None) -> int:
    """Requests accepted by the web tier and not yet admitted by any worker (gate 1)."""
    return int(GATE1_LUA.run(client or sync_redis(), 0, redis_keys().prefix))


async def gate1_queued() -> int:
    """:func:`gate1_queued_sync` for async callers."""
    return int(await GATE1_LUA.arun(aredis(), 0, redis_keys().prefix))


async def queue_state() -> dict[str, Any]:
    """The shared queue: requests waiting, those each worker holds not yet admitted, and per
    fairness key its shared VTC counter (weighted tokens served) and requests in flight
    (waiting, taken or running anywhere)."""
    keys = redis_keys()
    pipe = aredis().pipeline(transaction=False)
    pipe.hlen(keys.fq("wait"))
    pipe.hgetall(keys.fq("held"))
    pipe.hgetall(keys.fq("counter"))
    pipe.hgetall(keys.fq("inflight"))
    waiting, held, counters, inflight = await pipe.execute()
    per_key = {k.decode(): {"vtc_counter": float(v), "in_flight": int(inflight.get(k, 0))}
               for k, v in counters.items()}
    return {"waiting": waiting, "held": {w.decode(): int(n) for w, n in held.items()},
            "per_key": per_key}


def gate1(queued: int) -> dict[str, int]:
    """Gate 1's figures: ``queued`` against ``max_queue_size`` (``MAX_QUEUE_SIZE``)."""
    return {"queued": queued, "max_queue_size": platform_settings()["MAX_QUEUE_SIZE"]}


def context_tokens(snapshots: Mapping[str, dict[str, Any]], default: int) -> int:
    """The context (tokens) every live worker serves, or ``default`` when none reports one."""
    value = aggregate(list(snapshots.values())).get("max_model_len")
    return int(value) if value else default
