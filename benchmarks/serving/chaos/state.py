"""The platform's state after the load: waiting for it to settle, what it left behind (leaks),
every request's Redis events stream and the usage records in its database."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import redis

from benchmarks.harness.redis_server import PrivateRedis
from benchmarks.harness.servers import Platform
from benchmarks.serving.chaos.settings import MAX_EXAMPLES, WORKER_BUSY_FIELDS
from inference.protocol.events import decode_event
from inference.protocol.keys import Keys


def _stats(platform: Platform) -> dict[str, Any]:
    return httpx.get(f"{platform.url}/scheduler/stats", timeout=5,
                     headers={"Authorization": f"Bearer {platform.keys['operator']}"}).json()


def _busy_workers(stats: dict[str, Any]) -> dict[str, dict[str, int]]:
    busy = {}
    for worker, snap in (stats.get("workers") or {}).items():
        fields = {f: snap.get(f, 0) for f in WORKER_BUSY_FIELDS if snap.get(f, 0)}
        if fields:
            busy[worker] = fields
    return busy


def settle(platform: Platform, client: redis.Redis, timeout_s: float) -> dict[str, Any]:
    """Wait (at most ``timeout_s``) until gate 1 is 0, no worker runs anything, the Celery queue
    and the usage ledger are empty, for three polls in a row; return how it went."""
    keys = Keys(platform.stack.prefix)
    queue = platform.stack.env["CELERY_TASK_DEFAULT_QUEUE"]
    start = time.monotonic()
    deadline = start + timeout_s
    quiet = 0
    state: dict[str, Any] = {}
    while time.monotonic() < deadline:
        try:
            stats = _stats(platform)
            state = {"gate1": stats["gate1"]["queued"], "busy_workers": _busy_workers(stats),
                     "live_workers": len(stats.get("workers") or {}),
                     "celery_queue": client.llen(queue),
                     "usage_pending": client.hlen(f"{keys.prefix}:usage:pending")}
        except (httpx.HTTPError, redis.RedisError, ValueError, KeyError) as exc:
            state = {"error": repr(exc)}
            quiet = 0
            time.sleep(0.5)
            continue
        calm = (state["gate1"] == 0 and not state["busy_workers"] and not state["celery_queue"]
                and not state["usage_pending"]
                and state["live_workers"] == platform.workers)
        quiet = quiet + 1 if calm else 0
        if quiet >= 3:
            break
        time.sleep(0.5)
    return {"settled": quiet >= 3, "waited_s": round(time.monotonic() - start, 1),
            "last_state": state}


def wait_all_up(platform: Platform, private_redis: PrivateRedis, timeout_s: float = 60) -> bool:
    """Every process running and the platform ready with all its workers."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not private_redis.alive():
            private_redis.start()
        for name, proc in platform.stack.processes.items():
            if proc.poll() is not None:
                platform.stack.restart(name)
        try:
            ready = httpx.get(f"{platform.url}/readyz", timeout=2)
            if (ready.status_code == 200
                    and ready.json()["checks"]["workers"] >= platform.workers):
                return True
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.3)
    return False


def _sum_hash(client: redis.Redis, name: str) -> int:
    return sum(int(float(v)) for v in client.hvals(name))


# The shared queue's order indexes and per-request bookkeeping: all empty when nothing waits or
# runs (inference/protocol/lua/fair_queue.lua); the counters, arrival number and wake list are kept.
QUEUE_INDEXES = ("deadlines", "tiers", "backlogged", "next", "q:*", "ready:*", "heads:*")


def _size(client: redis.Redis, name: bytes | str) -> int:
    kind = client.type(name).decode()
    return {"hash": client.hlen, "zset": client.zcard, "list": client.llen, "set": client.scard,
            "stream": client.xlen}.get(kind, lambda _: 1 if kind == "string" else 0)(name)


def _queues(client: redis.Redis, keys: Keys) -> list[Keys]:
    """The keys of every base model's queue: the default model's, then each other one used."""
    others = sorted(q.decode().partition("@")[2] for q in client.smembers(keys.queues))
    return [keys, *(Keys(keys.prefix, model) for model in others if model)]


def read_leaks(platform: Platform, client: redis.Redis) -> tuple[dict[str, int], dict[str, Any]]:
    """What is left behind once the platform settled, in every base model's queue: (counts,
    their details)."""
    keys = Keys(platform.stack.prefix)
    queues = _queues(client, keys)
    now_ms = time.time() * 1000
    stats = _stats(platform)
    taken = {k.decode(): client.hlen(k)
             for q in queues for k in client.scan_iter(q.fq("taken", "*"))}
    running = {k.decode(): client.hlen(k)
               for q in queues for k in client.scan_iter(q.fq("running", "*"))}
    leases: dict[str, list[str]] = {}
    for name in client.scan_iter(f"{keys.prefix}:conc:*"):
        live = client.zrangebyscore(name, now_ms, "+inf")
        if live:
            leases[name.decode()] = [m.decode() for m in live]
    busy = _busy_workers(stats)
    indexes = {name.decode(): size for q in queues for pattern in QUEUE_INDEXES
               for name in client.scan_iter(q.fq(pattern)) if (size := _size(client, name))}
    counts = {
        "leak_gate1": int(stats["gate1"]["queued"]),
        "leak_fq_wait": sum(client.hlen(q.fq("wait")) for q in queues),
        "leak_fq_inflight": sum(_sum_hash(client, q.fq("inflight")) for q in queues),
        "leak_fq_taken": sum(taken.values()),
        "leak_fq_running": sum(running.values()),
        "leak_fq_held": sum(_sum_hash(client, q.fq("held")) for q in queues),
        "leak_fq_indexes": sum(indexes.values()),
        "leak_concurrency_leases": sum(len(v) for v in leases.values()),
        "leak_worker_state": sum(sum(f.values()) for f in busy.values()),
        "leak_celery_queue": client.llen(platform.stack.env["CELERY_TASK_DEFAULT_QUEUE"]),
        "leak_usage_pending": client.hlen(f"{keys.prefix}:usage:pending"),
    }
    details = {
        "fq_wait": [i.decode() for q in queues for i in client.hkeys(q.fq("wait"))][:MAX_EXAMPLES],
        "fq_inflight": {f"{q.queue} {k.decode()}": v.decode()
                        for q in queues for k, v in client.hgetall(q.fq("inflight")).items()},
        "fq_held": {f"{q.queue} {k.decode()}": v.decode()
                    for q in queues for k, v in client.hgetall(q.fq("held")).items()},
        "fq_taken": {k: [i.decode() for i in client.hkeys(k)][:MAX_EXAMPLES]
                     for k in taken if taken[k]},
        "fq_running": {k: [i.decode() for i in client.hkeys(k)][:MAX_EXAMPLES]
                       for k in running if running[k]},
        "fq_indexes": indexes,
        "concurrency_leases": leases,
        "busy_workers": busy,
        "live_workers": sorted(stats.get("workers") or {}),
        # Celery messages a killed worker had reserved: kombu restores them only after its
        # visibility timeout (an hour by default).
        "celery_unacked": client.hlen("unacked"),
    }
    return counts, details


@dataclass
class StreamSummary:
    """One request's Redis events stream: its token events as (seq, text) in stream order, its
    final events, and the unix times (ms) of its first and last entries."""

    token_events: list[tuple[int, str]] = field(default_factory=list)
    finals: list[dict[str, Any]] = field(default_factory=list)
    after_final: int = 0
    bad: int = 0
    first_ms: int = 0
    last_ms: int = 0

    @property
    def seqs(self) -> list[int]:
        return [seq for seq, _ in self.token_events]

    @property
    def text(self) -> str:
        return "".join(text for _, text in self.token_events)

    @property
    def tokens(self) -> int:
        return len(self.token_events)

    def doubled(self) -> bool:
        """More than one final event, or a token seq written twice."""
        return len(self.finals) > 1 or len(set(self.seqs)) != len(self.seqs)

    def whole(self) -> bool:
        """Token seqs 0..n-1 in order, and a final event (if any) that says n tokens were sent:
        the stream holds the request's whole answer."""
        n = self.tokens
        return self.seqs == list(range(n)) and all(f["seq"] == n for f in self.finals)

    def brief(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "whole": self.whole(), "seqs": _ranges(self.seqs),
                "text": self.text[:60], "finals": self.finals,
                "events_after_final": self.after_final, "bad_entries": self.bad}


def _ranges(seqs: list[int]) -> str:
    """``0-41,43-50``: consecutive runs of a list of numbers, in order."""
    runs: list[list[int]] = []
    for seq in seqs:
        if runs and seq == runs[-1][1] + 1:
            runs[-1][1] = seq
        else:
            runs.append([seq, seq])
    return ",".join(f"{a}-{b}" if a != b else str(a) for a, b in runs)


def read_streams(client: redis.Redis, prefix: str) -> dict[str, StreamSummary]:
    """Every request's events stream still in Redis, by request id."""
    streams: dict[str, StreamSummary] = {}
    head = f"{prefix}:events:"
    for name in client.scan_iter(f"{head}*", count=1000):
        summary = StreamSummary()
        for entry_id, fields in client.xrange(name):
            ms = int(entry_id.split(b"-")[0])
            summary.first_ms, summary.last_ms = summary.first_ms or ms, ms
            try:
                event = decode_event(fields)
            except ValueError:
                summary.bad += 1
                continue
            if summary.finals:
                summary.after_final += 1
            if event.type == "token":
                summary.token_events.append((event.seq, event.text))
            else:
                summary.finals.append({
                    "seq": event.seq, "finish_reason": event.finish_reason.value,
                    "error": event.error.code.value if event.error else None,
                    "completion_tokens": event.usage.completion_tokens, "text": event.text})
        streams[name.decode()[len(head):]] = summary
    return streams


_READ_USAGE = """
import json
from tenants.models import UsageRecord
rows = list(UsageRecord.objects.values("request_id", "completion_tokens", "prompt_tokens",
                                       "finish_reason", "status", "error_code", "tenant__slug",
                                       "duration_s", "created_at", "batch_id",
                                       "billed_tokens"))
for row in rows:
    row["created_at"] = row["created_at"].timestamp()
print("USAGE " + json.dumps(rows))
"""


def read_usage(platform: Platform) -> list[dict[str, Any]]:
    """Every usage record in the platform's database (``created_at``: unix seconds)."""
    out = platform.manage("shell", "-c", _READ_USAGE)
    line = next(x for x in out.splitlines() if x.startswith("USAGE "))
    return json.loads(line[len("USAGE "):])
