"""``GET /metrics``: the platform's numbers in the Prometheus text format (prometheus-client).

Read at scrape time from Redis: the live workers' stats snapshots (queues, KV cache, admissions
blocked and rejected per gate; labelled by worker, so a restarted worker's counters reset as
Prometheus expects) and the counters and histograms of :mod:`dashboard.recorder` (tokens and
latencies per tenant, tokens and requests per base model and per LoRA adapter, refusals before any
worker; the adapters each worker holds, loads and runs). Workers
and gate 1 are counted per base model; ``llm_worker_info`` names each worker's model.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator

import redis
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from dashboard import recorder
from gateway import batch_metrics
from gateway.clients import sync_redis
from gateway.workers import (
    by_model,
    gate1,
    gate1_queued_sync,
    known_models_sync,
    worker_snapshots_sync,
)

QUEUES = (("pending", "num_pending"), ("prefilling", "num_prefilling"), ("active", "num_active"))
# Web-tier refusal codes that are gate 1 (docs/design.md, backpressure).
GATE1_CODES = ("queue_full",)


class PlatformCollector(Collector):
    """Collects every platform metric from Redis on each scrape."""

    def __init__(self, client: redis.Redis | None = None):
        self._client = client

    def collect(self) -> Iterator[Metric]:
        client = self._client or sync_redis()
        workers = worker_snapshots_sync(client)
        yield from self._queues(client, workers)
        yield from self._kv(workers)
        yield from self._admissions(client, workers)
        yield from self._structured(workers)
        yield from self._adapters(workers)
        yield from self._usage(client)
        yield from self._batches(client)

    def _batches(self, client: redis.Redis) -> Iterator[Metric]:
        figures = batch_metrics.read(client)
        lines = CounterMetricFamily("llm_batch_lines", "Batch lines ended, by outcome "
                                    "(completed: an output line; failed: an error line).",
                                    labels=["outcome"])
        for outcome, n in figures["lines"].items():
            lines.add_metric([outcome], n)
        yield lines
        active = GaugeMetricFamily("llm_batches_active", "Batches not yet ended, by status.",
                                   labels=["status"])
        # Every status a batch goes through is a series, 0 when none is in it.
        by_status = dict.fromkeys(batch_metrics.ACTIVE_STATUSES, 0)
        for entry in figures["active"]:
            by_status[entry["status"]] = by_status.get(entry["status"], 0) + 1
        for status, n in sorted(by_status.items()):
            active.add_metric([status], n)
        yield active

    def _queues(self, client: redis.Redis, workers: dict) -> Iterator[Metric]:
        alive = GaugeMetricFamily("llm_workers_alive",
                                  "Inference workers with a live heartbeat, by base model.",
                                  labels=["model"])
        queued = GaugeMetricFamily(
            "llm_gate1_queued_requests",
            "Requests accepted and not yet admitted by any worker (gate 1), by base model: each "
            "model's queue has its own.", labels=["model"])
        groups = by_model(workers)
        for model in known_models_sync(workers, client):
            alive.add_metric([model], len(groups.get(model, {})))
            queued.add_metric([model], gate1(gate1_queued_sync(client, model))["queued"])
        yield from (alive, queued)
        info = GaugeMetricFamily("llm_worker_info", "1 per live worker, labelled by the base "
                                 "model it serves (join on worker).", labels=["worker", "model"])
        for model, members in sorted(groups.items()):
            for worker in sorted(members):
                info.add_metric([worker, model], 1)
        yield info
        limit = GaugeMetricFamily("llm_gate1_max_queue_size",
                                  "Gate 1's bound (MAX_QUEUE_SIZE), per base model.")
        limit.add_metric([], gate1(0)["max_queue_size"])
        yield limit
        queue = GaugeMetricFamily("llm_scheduler_queue_requests",
                                  "Requests in each scheduler queue of each worker.",
                                  labels=["worker", "queue"])
        for worker, snap in workers.items():
            for name, field in QUEUES:
                queue.add_metric([worker, name], snap.get(field, 0))
        yield queue

    def _kv(self, workers: dict) -> Iterator[Metric]:
        pressure = GaugeMetricFamily(
            "llm_kv_pressure", "KV blocks held by live rows / total blocks.", labels=["worker"])
        reserved = GaugeMetricFamily(
            "llm_active_kv_reserved_tokens",
            "Sum of prompt_len + max_tokens over admitted rows (gate 2).", labels=["worker"])
        budget = GaugeMetricFamily("llm_active_kv_budget_tokens", "Gate 2's budget.",
                                   labels=["worker"])
        blocks = GaugeMetricFamily("llm_kv_blocks", "KV blocks by state.",
                                   labels=["worker", "state"])
        for worker, snap in workers.items():
            pressure.add_metric([worker], snap.get("kv_pressure", 0.0))
            reserved.add_metric([worker], snap.get("active_kv_reserved", 0))
            budget.add_metric([worker], snap.get("active_kv_budget", 0))
            for state in ("held", "free", "evictable"):
                blocks.add_metric([worker, state], snap.get(f"kv_blocks_{state}", 0))
        yield from (pressure, reserved, budget, blocks)

    def _admissions(self, client: redis.Redis, workers: dict) -> Iterator[Metric]:
        blocked_any = CounterMetricFamily(
            "llm_kv_admit_blocked", "Admission attempts blocked by a KV gate.", labels=["worker"])
        blocked = CounterMetricFamily(
            "llm_admissions_blocked", "Admission attempts soft-held, by gate.",
            labels=["worker", "gate"])
        rejected = CounterMetricFamily(
            "llm_admissions_rejected",
            "Requests hard-rejected, by gate (gate 1: refused by the web tier, worker 'web').",
            labels=["worker", "gate"])
        finished = CounterMetricFamily(
            "llm_requests_finished", "Requests ended by each worker, by finish reason.",
            labels=["worker", "reason"])
        generated = CounterMetricFamily(
            "llm_worker_generated_tokens", "Tokens generated by each worker since it started.",
            labels=["worker"])
        preempted = CounterMetricFamily(
            "llm_preemptions", "Rows each worker preempted for a higher priority tier.",
            labels=["worker"])
        recomputed = CounterMetricFamily(
            "llm_preempted_recomputed_tokens",
            "Prompt tokens each worker recomputed for preempted requests it resumed.",
            labels=["worker"])
        for worker, snap in workers.items():
            blocked_any.add_metric([worker], snap.get("kv_admit_blocked", 0))
            for gate, n in (snap.get("admissions_soft_held") or {}).items():
                blocked.add_metric([worker, str(gate)], n)
            for gate, n in (snap.get("admissions_hard_rejected") or {}).items():
                rejected.add_metric([worker, str(gate)], n)
            for reason, n in (snap.get("requests_finished") or {}).items():
                finished.add_metric([worker, reason], n)
            generated.add_metric([worker], snap.get("tokens_generated", 0))
            preempted.add_metric([worker], snap.get("preemptions", 0))
            recomputed.add_metric([worker], snap.get("preempted_tokens_recomputed", 0))
        refused_raw = {k.decode(): int(v)
                       for k, v in client.hgetall(recorder.refused_key()).items()}
        rejected.add_metric(["web", "1"], sum(refused_raw.get(c, 0) for c in GATE1_CODES))
        refused = CounterMetricFamily(
            "llm_requests_refused", "Requests refused before reaching a worker, by reason.",
            labels=["code"])
        for code, n in sorted(refused_raw.items()):
            refused.add_metric([code], n)
        yield from (blocked_any, blocked, rejected, finished, generated, preempted, recomputed,
                    refused)

    def _structured(self, workers: dict) -> Iterator[Metric]:
        """Structured outputs: constrained requests, compile-cache hits, compile refusals (by
        reason), forced tokens."""
        families = {
            field: CounterMetricFamily(f"llm_{name}", doc, labels=["worker"])
            for field, name, doc in (
                ("constrained_requests", "structured_requests",
                 "Requests with a structured-output grammar each worker took."),
                ("compile_cache_hits", "grammar_cache_hits",
                 "Constrained requests whose grammar was compiled already (or compiling)."),
                ("forced_tokens", "forced_tokens",
                 "Tokens a grammar forced, appended without a sampling step (jump-forward)."))}
        refusals = CounterMetricFamily(
            "llm_grammar_compile_refusals", "Grammars refused by each worker, by reason "
            "(invalid, limit, busy).", labels=["worker", "reason"])
        for worker, snap in workers.items():
            figures = snap.get("structured") or {}
            for field, family in families.items():
                family.add_metric([worker], figures.get(field, 0))
            for reason, n in (figures.get("compile_refusals_by_reason") or {}).items():
                refusals.add_metric([worker, reason], n)
        yield from (*families.values(), refusals)

    def _adapters(self, workers: dict) -> Iterator[Metric]:
        """LoRA adapters: loaded (per worker and adapter), loads, evictions, failures, requests
        parked on a load, rows running under each."""
        loaded = GaugeMetricFamily("llm_adapter_loaded", "LoRA adapters of each name a worker "
                                   "holds loaded (1; more when tenants' adapters share a name).",
                                   labels=["worker", "adapter"])
        running = GaugeMetricFamily("llm_adapter_running_rows", "Rows running under each LoRA "
                                    "adapter, per worker.", labels=["worker", "adapter"])
        parked = GaugeMetricFamily("llm_adapter_parked_requests", "Requests waiting for their "
                                   "LoRA adapter to load, per worker.", labels=["worker"])
        counters = {field: CounterMetricFamily(f"llm_adapter_{field}", doc, labels=["worker"])
                    for field, doc in (("loads", "LoRA adapters each worker loaded."),
                                       ("evictions", "LoRA adapters each worker evicted (LRU)."),
                                       ("load_failures", "LoRA adapter loads that failed."))}
        for worker, snap in workers.items():
            figures = snap.get("adapters")
            if not figures:
                continue
            # Adapters are named per tenant: two tenants' adapters of one name, both loaded,
            # are one series (its value 2), never two series of the same labels.
            for name, count in collections.Counter(figures.get("loaded") or []).items():
                loaded.add_metric([worker, name], count)
            for name, rows in (figures.get("running") or {}).items():
                running.add_metric([worker, name], rows)
            parked.add_metric([worker], figures.get("num_parked", 0))
            for field, family in counters.items():
                family.add_metric([worker], figures.get(field, 0))
        yield from (loaded, running, parked, *counters.values())

    def _usage(self, client: redis.Redis) -> Iterator[Metric]:
        raw = {k.decode(): int(v) for k, v in client.hgetall(recorder.usage_key()).items()}
        tokens = {
            name: CounterMetricFamily(f"llm_{name}", f"{doc} per tenant.", labels=["tenant"])
            for name, doc in (("prompt_tokens", "Prompt tokens of finished requests"),
                              ("cached_prompt_tokens", "Prompt tokens served from the "
                                                       "prefix cache"),
                              ("generation_tokens", "Generated tokens"))
        }
        requests = CounterMetricFamily("llm_requests", "Finished requests per tenant and status.",
                                       labels=["tenant", "status"])
        billed = CounterMetricFamily(
            "llm_billed_tokens", "Tokens charged to each tenant (its token budget counts these), "
            "by service class: batch work at BATCH_TOKEN_PRICE per token.",
            labels=["tenant", "service_class"])
        for field, value in sorted(raw.items()):
            tenant, _, rest = field.partition("|")
            if rest.startswith("requests|"):
                requests.add_metric([tenant, rest.split("|", 1)[1]], value)
            elif rest.startswith("billed_tokens|"):
                billed.add_metric([tenant, rest.split("|", 1)[1]], value)
            elif rest == "completion_tokens":
                tokens["generation_tokens"].add_metric([tenant], value)
            elif rest in tokens:
                tokens[rest].add_metric([tenant], value)
        yield from tokens.values()
        yield requests
        yield billed
        yield from self._model_usage(client)
        histograms = recorder.read_histograms(client)
        for spec in recorder.HISTOGRAMS:
            family = HistogramMetricFamily(spec.name, spec.documentation, labels=["tenant"])
            for tenant, (counts, total, _count) in sorted(histograms[spec.name].items()):
                running = recorder.cumulative(counts)
                bounds = [*(str(b) for b in spec.buckets), "+Inf"]
                family.add_metric([tenant], list(zip(bounds, running, strict=True)), total)
            yield family

    def _model_usage(self, client: redis.Redis) -> Iterator[Metric]:
        for kind, what, key in (("model", "base model", recorder.model_usage_key()),
                                ("adapter", "LoRA adapter", recorder.adapter_usage_key())):
            yield from self._usage_of(client, kind, what, key)

    def _usage_of(self, client: redis.Redis, kind: str, what: str,
                  key: str) -> Iterator[Metric]:
        raw = {k.decode(): int(v) for k, v in client.hgetall(key).items()}
        prompt = CounterMetricFamily(f"llm_{kind}_prompt_tokens",
                                     f"Prompt tokens of finished requests per {what}.",
                                     labels=[kind])
        generated = CounterMetricFamily(f"llm_{kind}_generation_tokens",
                                        f"Generated tokens per {what}.", labels=[kind])
        requests = CounterMetricFamily(f"llm_{kind}_requests",
                                       f"Finished requests per {what} and status.",
                                       labels=[kind, "status"])
        for field, value in sorted(raw.items()):
            model, _, rest = field.partition("|")
            if rest == "prompt_tokens":
                prompt.add_metric([model], value)
            elif rest == "completion_tokens":
                generated.add_metric([model], value)
            elif rest.startswith("requests|"):
                requests.add_metric([model, rest.split("|", 1)[1]], value)
        yield from (prompt, generated, requests)


def render(client: redis.Redis | None = None) -> bytes:
    """The metrics page's body (Prometheus text exposition format)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(PlatformCollector(client))
    return generate_latest(registry)
