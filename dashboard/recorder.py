"""Counters and latency histograms kept in Redis, so every process's observations add up.

Usage records are written by Celery; refusals happen in any web process; ``GET /metrics`` is
answered by any web process. Keeping the numbers in Redis hashes (rather than in one process's
memory) makes each scrape see all of them. :mod:`dashboard.metrics` turns them into Prometheus
families.

Keys, under the platform's Redis prefix ``{p}``:

- ``{p}:metrics:usage``: ``{tenant}|{counter}`` -> count (tokens, requests by status; tokens
  charged by service class: ``{tenant}|billed_tokens|{interactive or batch}``)
- ``{p}:metrics:model``: ``{model}|{counter}`` -> count (prompt and completion tokens, requests
  by status, of each base model)
- ``{p}:metrics:adapter``: ``{adapter}|{counter}`` -> count (the same, of each LoRA adapter)
- ``{p}:metrics:hist:{name}``: ``{tenant}|{bucket index}`` -> count, ``{tenant}|sum``,
  ``{tenant}|count``
- ``{p}:metrics:refused``: ``{code}`` -> requests refused before reaching a worker
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

import redis

from gateway.admission import refused_counter_key
from gateway.conf import redis_keys


@dataclass(frozen=True)
class HistogramSpec:
    """A latency histogram: its metric name, help text and upper bucket bounds (seconds)."""

    name: str
    documentation: str
    buckets: tuple[float, ...]

    def bucket_index(self, value: float) -> int:
        """Index of the first bucket whose upper bound holds ``value`` (len: +Inf)."""
        return bisect.bisect_left(self.buckets, value)


TTFT = HistogramSpec(
    "llm_time_to_first_token_seconds",
    "Time from acceptance by the web tier to the first generated token.",
    (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
)
ITL = HistogramSpec(
    "llm_inter_token_latency_seconds",
    "Mean time between generated tokens of a request (one observation per request).",
    (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
)
E2E = HistogramSpec(
    "llm_e2e_request_latency_seconds",
    "Time from acceptance by the web tier to the request's end.",
    (0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0),
)
HISTOGRAMS = (TTFT, ITL, E2E)
USAGE_COUNTERS = ("prompt_tokens", "cached_prompt_tokens", "completion_tokens")


def usage_key() -> str:
    return f"{redis_keys().prefix}:metrics:usage"


def model_usage_key() -> str:
    return f"{redis_keys().prefix}:metrics:model"


def adapter_usage_key() -> str:
    return f"{redis_keys().prefix}:metrics:adapter"


def histogram_key(spec: HistogramSpec) -> str:
    return f"{redis_keys().prefix}:metrics:hist:{spec.name}"


def refused_key() -> str:
    """The hash of refusals by code, counted by :func:`gateway.admission.admit`."""
    return refused_counter_key()


def record_request(client: redis.Redis, *, tenant: str, status: int, prompt_tokens: int,
                   cached_prompt_tokens: int, completion_tokens: int, ttft_s: float | None,
                   duration_s: float | None, billed_tokens: int | None = None,
                   batch: bool = False, model: str = "", adapter: str = "") -> None:
    """Count one finished request of ``tenant`` and observe its latencies (seconds).

    ``billed_tokens``: the tokens it was charged (None: prompt + completion); ``batch``: it was
    batch work (a Batch API line), counted apart from interactive requests; ``model``: the base
    model it named (its tokens and status are counted per model too); ``adapter``: the LoRA
    adapter it ran under (counted per adapter too; empty: none).
    """
    tally = Tally()
    tally.add(tenant=tenant, status=status, prompt_tokens=prompt_tokens,
              cached_prompt_tokens=cached_prompt_tokens, completion_tokens=completion_tokens,
              ttft_s=ttft_s, duration_s=duration_s, billed_tokens=billed_tokens, batch=batch,
              model=model, adapter=adapter)
    tally.send(client)


class Tally:
    """The counts of several finished requests added up before they are sent: one ``HINCRBY``
    a field for all of them (a batch step's lines: a few dozen commands, not 14 a line)."""

    def __init__(self) -> None:
        self._ints: dict[tuple[str, str], int] = {}
        self._floats: dict[tuple[str, str], float] = {}

    def _int(self, key: str, field: str, n: int) -> None:
        self._ints[key, field] = self._ints.get((key, field), 0) + n

    def add(self, *, tenant: str, status: int, prompt_tokens: int, cached_prompt_tokens: int,
            completion_tokens: int, ttft_s: float | None, duration_s: float | None,
            billed_tokens: int | None = None, batch: bool = False, model: str = "",
            adapter: str = "") -> None:
        """Count one request (the arguments of :func:`record_request`)."""
        for name, key in ((model, model_usage_key()), (adapter, adapter_usage_key())):
            if name:
                self._int(key, f"{name}|prompt_tokens", prompt_tokens)
                self._int(key, f"{name}|completion_tokens", completion_tokens)
                self._int(key, f"{name}|requests|{status}", 1)
        counters = usage_key()
        self._int(counters, f"{tenant}|prompt_tokens", prompt_tokens)
        self._int(counters, f"{tenant}|cached_prompt_tokens", cached_prompt_tokens)
        self._int(counters, f"{tenant}|completion_tokens", completion_tokens)
        charged = prompt_tokens + completion_tokens if billed_tokens is None else billed_tokens
        service_class = "batch" if batch else "interactive"
        self._int(counters, f"{tenant}|billed_tokens|{service_class}", charged)
        self._int(counters, f"{tenant}|requests|{status}", 1)
        observations: list[tuple[HistogramSpec, float]] = []
        if ttft_s is not None:
            observations.append((TTFT, ttft_s))
            if duration_s is not None and completion_tokens >= 2:
                observations.append((ITL, max(0.0, duration_s - ttft_s)
                                     / (completion_tokens - 1)))
        if duration_s is not None and status == 200:
            observations.append((E2E, duration_s))
        for spec, value in observations:
            if not math.isfinite(value):
                continue
            key = histogram_key(spec)
            self._int(key, f"{tenant}|{spec.bucket_index(value)}", 1)
            total = (key, f"{tenant}|sum")
            self._floats[total] = self._floats.get(total, 0.0) + value
            self._int(key, f"{tenant}|count", 1)

    def send(self, client: redis.Redis) -> None:
        """Send what was added, in one round trip."""
        pipe = client.pipeline(transaction=False)
        for (key, field), n in self._ints.items():
            pipe.hincrby(key, field, n)
        for (key, field), value in self._floats.items():
            pipe.hincrbyfloat(key, field, value)
        pipe.execute()


def read_histograms(client: redis.Redis) -> dict[str, dict[str, tuple[list[int], float, int]]]:
    """Per histogram name and tenant: (non-cumulative bucket counts incl. +Inf, sum, count)."""
    out: dict[str, dict[str, tuple[list[int], float, int]]] = {}
    for spec in HISTOGRAMS:
        raw = client.hgetall(histogram_key(spec))
        per_tenant: dict[str, tuple[list[int], float, int]] = {}
        for field, value in raw.items():
            tenant, _, part = field.decode().rpartition("|")
            buckets, total, count = per_tenant.get(tenant, ([0] * (len(spec.buckets) + 1),
                                                            0.0, 0))
            if part == "sum":
                total = float(value)
            elif part == "count":
                count = int(value)
            else:
                buckets[int(part)] += int(value)
            per_tenant[tenant] = (buckets, total, count)
        out[spec.name] = per_tenant
    return out


def cumulative(counts: Sequence[int]) -> list[int]:
    """Running totals of non-cumulative bucket counts."""
    total, out = 0, []
    for n in counts:
        total += n
        out.append(total)
    return out
