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
    **dict.fromkeys(("model", "policy", "prefill_mode", "kv_block_size", "max_batch_size",
                     "max_pending",
                     "dtype", "preemption", "batch_itl_slack_ms",
                     "batch_itl_slack_fraction"), Rule.SAME),
}
# Fields that only mean something for one worker (its own cost model and last pass, the rows it
# may preempt, the LoRA adapters it holds: the dashboard's per_adapter joins those): shown in
# each worker's snapshot, left out of the deployment's total.
PER_WORKER_ONLY = frozenset({"tick_budget", "preemptible_rows", "adapters"})
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


async def alive_workers(model: str | None = None) -> list[str]:
    """Ids of the workers alive as this event loop judges them: a heartbeat younger than
    ``WORKER_HEARTBEAT_TTL_S``, or one it cannot tell dead
    (:func:`inference.protocol.liveness.declares_dead`): for a TTL after Redis stopped answering
    it (no worker could beat), or when every heartbeat is stale at once, a worker not yet
    reclaimed is not taken for gone, so requests wait for it instead of being refused.

    With ``model`` (a base model's name), only the workers serving it: those whose queue
    (``{prefix}:worker_queue``, which each worker names as it starts) is the model's."""
    keys = redis_keys()
    pipe = aredis().pipeline(transaction=False)
    pipe.zrange(keys.workers, 0, -1, withscores=True)
    if model is not None:
        pipe.hgetall(keys.worker_queue)
    replies = await pipe.execute()
    seen = sight()
    seen.answered()
    alive = judged_alive(replies[0], seen.seconds(), time.time())
    if model is None:
        return alive
    return serving(alive, replies[1], redis_keys(model).queue, keys.prefix)


def serving(worker_ids: list[str], worker_queues: Mapping[bytes, bytes], queue: str,
            default_queue: str) -> list[str]:
    """The members of ``worker_ids`` whose queue (``worker_queues``: the ``worker_queue`` hash;
    a worker missing from it serves ``default_queue``) is ``queue``."""
    return [w for w in worker_ids
            if worker_queues.get(w.encode(), default_queue.encode()).decode() == queue]


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


def gate1_queued_sync(client: redis.Redis | None = None, model: str | None = None) -> int:
    """Requests of ``model`` (None: the default model) accepted by the web tier and not yet
    admitted by any worker (its gate 1: each base model's queue has its own)."""
    return int(GATE1_LUA.run(client or sync_redis(), 0, redis_keys(model).queue))


async def gate1_queued(model: str | None = None) -> int:
    """:func:`gate1_queued_sync` for async callers."""
    return int(await GATE1_LUA.arun(aredis(), 0, redis_keys(model).queue))


async def queue_state(model: str | None = None) -> dict[str, Any]:
    """The shared queue of ``model`` (None: the default model): requests waiting, those each
    worker holds not yet admitted, and per fairness key its shared VTC counter (weighted tokens
    served) and requests in flight (waiting, taken or running anywhere)."""
    keys = redis_keys(model)
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


def model_of(snapshot: Mapping[str, Any]) -> str:
    """The base model a worker's stats snapshot says it serves (an older worker's says none:
    the default model)."""
    return str(snapshot.get("model") or platform_settings()["SERVED_MODEL_NAME"])


def by_model(snapshots: Mapping[str, dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """``snapshots`` (by worker id) grouped by the model each worker serves."""
    groups: dict[str, dict[str, dict[str, Any]]] = {}
    for worker, snap in snapshots.items():
        groups.setdefault(model_of(snap), {})[worker] = snap
    return groups


def _known(snapshots: Mapping[str, dict[str, Any]], queues: set[bytes]) -> list[str]:
    """The default model, each live worker's and each of ``queues`` (queue names), sorted."""
    queued = {q.decode().partition("@")[2] for q in queues} - {""}
    return sorted({platform_settings()["SERVED_MODEL_NAME"], *by_model(snapshots), *queued})


def known_models_sync(snapshots: Mapping[str, dict[str, Any]],
                      client: redis.Redis | None = None) -> list[str]:
    """The models the stats show, sorted: the default model, each live worker's, and each one
    a request was ever queued for (``{prefix}:fq:queues``)."""
    return _known(snapshots, (client or sync_redis()).smembers(redis_keys().queues))


async def known_models(snapshots: Mapping[str, dict[str, Any]]) -> list[str]:
    """:func:`known_models_sync` for async callers."""
    return _known(snapshots, await aredis().smembers(redis_keys().queues))


async def per_model(snapshots: Mapping[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per known model (:func:`known_models`): its ``gate1``, ``queue`` (:func:`queue_state`),
    ``workers`` (ids) and ``total`` (:func:`aggregate` of its workers' ``snapshots``)."""
    groups = by_model(snapshots)
    models = {}
    for name in await known_models(snapshots):
        served = groups.get(name, {})
        models[name] = {"gate1": gate1(await gate1_queued(name)),
                        "queue": await queue_state(name), "workers": sorted(served),
                        "total": aggregate(list(served.values()))}
    return models
