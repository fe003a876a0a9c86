"""vLLM's serving metrics over what each request saw, and failures grouped by reason.

Each request gives a :class:`RequestResult`; :func:`summarize` turns them into the metrics of
vLLM's ``benchmarks/benchmark_serving.py``:

* TTFT: from sending a request to its first streamed token;
* TPOT: per request, ``(e2e - ttft) / (output_tokens - 1)``, over requests of more than one token;
* ITL: every gap between two consecutive streamed chunks, over all requests;
* E2EL: from sending a request to its last chunk;
* request, output-token and total-token throughput over the run's duration (first send to last
  completion), and goodput: requests per second that meet every stated SLO.

Latencies are reported in milliseconds (mean, median, std, p90, p99); rejected requests (HTTP
429) and errors are counted apart, with their reasons (:func:`failure_counts`), and excluded from
the latency figures. :func:`records` keeps every request's result for an experiment's JSON, and
:func:`report` prints a warning when requests failed.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)
METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass
class RequestResult:
    """What one request saw, times in seconds from the start of the run.

    ``status`` is ``ok``, ``rejected`` (HTTP 429 or the engine's queue-full refusal),
    ``error`` or ``cancelled``; ``chunk_times_s`` are the arrival times of the streamed chunks
    that carried text; ``arrival_s`` is when the workload scheduled the request (``sent_s`` is
    later when a bound on requests in flight held it back) and ``max_tokens`` what it asked for.
    """

    tenant: str
    tag: str
    status: str
    http_status: int
    sent_s: float
    chunk_times_s: list[float] = field(default_factory=list)
    ended_s: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_prompt_tokens: int = 0
    error: str = ""
    arrival_s: float = 0.0
    max_tokens: int = 0

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_times_s[0] - self.sent_s if self.chunk_times_s else None

    @property
    def e2el_s(self) -> float:
        return self.ended_s - self.sent_s

    @property
    def tpot_s(self) -> float | None:
        """``(e2e - ttft) / (output_tokens - 1)``; None for a request of one token or less."""
        if self.output_tokens <= 1 or self.ttft_s is None:
            return None
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def itls_s(self) -> list[float]:
        ts = self.chunk_times_s
        return [b - a for a, b in zip(ts, ts[1:], strict=False)]

    def to_dict(self) -> dict[str, Any]:
        """Every field, and the derived TTFT, TPOT, E2EL, the gaps between chunks (``itls_s``)
        and, for a request that did not complete, its :func:`failure_reason` (else ``""``)."""
        d = asdict(self)
        d.update(ttft_s=self.ttft_s, tpot_s=self.tpot_s, e2el_s=self.e2el_s,
                 itls_s=self.itls_s,
                 failure_reason="" if self.status == "ok" else failure_reason(self))
        return d


def records(results: Iterable[RequestResult], digits: int = 6) -> list[dict[str, Any]]:
    """Each request's result as a JSON-ready dict (:meth:`RequestResult.to_dict`), times rounded
    to ``digits`` decimals of a second (microseconds): what an experiment's JSON keeps so that
    every figure can be computed again from it."""

    def rounded(value: Any) -> Any:
        if isinstance(value, float):
            return round(value, digits)
        if isinstance(value, list):
            return [rounded(v) for v in value]
        return value

    return [{k: rounded(v) for k, v in r.to_dict().items()} for r in results]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile with linear interpolation (numpy's default); nan when empty."""
    return float(np.percentile(values, q)) if len(values) else math.nan


def describe_ms(values_s: Sequence[float]) -> dict[str, float]:
    """mean, median, std, p90 and p99 of durations given in seconds, in milliseconds."""
    ms = [v * 1000 for v in values_s]
    if not ms:
        return {"mean": math.nan, "median": math.nan, "std": math.nan, "p90": math.nan,
                "p99": math.nan}
    return {"mean": float(np.mean(ms)), "median": float(np.median(ms)), "std": float(np.std(ms)),
            "p90": percentile(ms, 90), "p99": percentile(ms, 99)}


def meets_slos(result: RequestResult, slos_ms: dict[str, float]) -> bool:
    """Whether a completed request meets every SLO given (keys ``ttft``, ``tpot``, ``e2el``,
    in ms); a request without a TPOT (one token) passes the TPOT SLO, as in vLLM."""
    values = {"ttft": result.ttft_s, "tpot": result.tpot_s, "e2el": result.e2el_s}
    for name, limit in slos_ms.items():
        value = values[name]
        if value is not None and value * 1000 > limit:
            return False
    return True


def failure_reason(result: RequestResult) -> str:
    """A short reason for a request that did not complete: ``HTTP <status> <code>: <message>``
    (from the OpenAI-style error body when there is one), or the exception's text (e.g.
    ``ConnectError: All connection attempts failed``)."""
    if result.status == "cancelled":
        return "cancelled (still in flight when the run stopped)"
    text = result.error.strip()
    message = text
    try:
        body = json.loads(text) if text else None
    except ValueError:
        body = None
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            code = err.get("code") or err.get("type") or ""
            message = f"{code}: {err.get('message', '')}".strip(": ") if code else str(
                err.get("message", text))
        elif isinstance(err, str):
            message = err
    message = " ".join(message.split())[:200] or "no detail"
    return f"HTTP {result.http_status} {message}" if result.http_status else message


def failure_group(result: RequestResult) -> str:
    """What identical failures share, without per-request numbers: ``HTTP <status> <code>``
    (e.g. ``HTTP 429 kv_budget_exceeded``), ``HTTP <status>`` when the body has no code, the
    exception's type for a client error (e.g. ``ConnectError``), or ``cancelled``."""
    if result.status == "cancelled":
        return "cancelled"
    text = result.error.strip()
    try:
        body = json.loads(text) if text else None
    except ValueError:
        body = None
    code = ""
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            code = str(err.get("code") or err.get("type") or "")
    if result.http_status:
        return f"HTTP {result.http_status} {code}".strip()
    head, sep, _ = text.partition(":")
    return head.strip() if sep and head.strip() and " " not in head.strip() else (
        text[:80] or "no detail")


def failure_counts(results: Iterable[RequestResult]) -> dict[str, int]:
    """How many requests failed (rejected, error or cancelled) in each :func:`failure_group`,
    most frequent first."""
    counts: dict[str, int] = {}
    for r in results:
        if r.status != "ok":
            group = failure_group(r)
            counts[group] = counts.get(group, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def failure_examples(results: Iterable[RequestResult]) -> dict[str, str]:
    """One :func:`failure_reason` (the first) per :func:`failure_group`."""
    examples: dict[str, str] = {}
    for r in results:
        if r.status != "ok":
            examples.setdefault(failure_group(r), failure_reason(r))
    return examples


def summarize(results: Sequence[RequestResult], duration_s: float | None = None,
              slos_ms: dict[str, float] | None = None) -> dict[str, Any]:
    """vLLM's serving metrics of a run (latencies in ms; throughputs per second).

    Args:
        results: every request sent.
        duration_s: the run's duration; by default from the first send to the last end.
        slos_ms: goodput's SLOs, e.g. ``{"ttft": 500, "tpot": 100}``; none: goodput is absent.
    """
    ok = [r for r in results if r.status == "ok"]
    if duration_s is None:
        duration_s = (max((r.ended_s for r in results), default=0.0)
                      - min((r.sent_s for r in results), default=0.0))
    duration_s = max(duration_s, 1e-9)
    rejected = [r for r in results if r.status == "rejected"]
    out: dict[str, Any] = {
        "requests": len(results),
        "completed": len(ok),
        "rejected_429": len(rejected),
        "errors": sum(r.status == "error" for r in results),
        "cancelled": sum(r.status == "cancelled" for r in results),
        "failures_by_reason": failure_counts(results),
        "failure_examples": failure_examples(results),
        "duration_s": duration_s,
        "total_input_tokens": sum(r.prompt_tokens for r in ok),
        "total_output_tokens": sum(r.output_tokens for r in ok),
        "cached_prompt_tokens": sum(r.cached_prompt_tokens for r in ok),
        "request_throughput": len(ok) / duration_s,
        "output_throughput": sum(r.output_tokens for r in ok) / duration_s,
        "total_token_throughput": sum(r.prompt_tokens + r.output_tokens for r in ok) / duration_s,
        "ttft_ms": describe_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_ms": describe_ms([r.tpot_s for r in ok if r.tpot_s is not None]),
        "itl_ms": describe_ms([g for r in ok for g in r.itls_s]),
        "e2el_ms": describe_ms([r.e2el_s for r in ok]),
        "rejection_latency_ms": describe_ms([r.e2el_s for r in rejected]),
    }
    if slos_ms:
        good = sum(meets_slos(r, slos_ms) for r in ok)
        out["slos_ms"] = dict(slos_ms)
        out["good_requests"] = good
        out["goodput"] = good / duration_s
    return out


def summarize_by(results: Sequence[RequestResult], key: Callable[[RequestResult], str],
                 duration_s: float | None = None,
                 slos_ms: dict[str, float] | None = None) -> dict[str, dict[str, Any]]:
    """:func:`summarize` per group (e.g. ``key=lambda r: r.tenant``), over the whole run's
    duration so that the groups' throughputs add up."""
    if duration_s is None and results:
        duration_s = max(r.ended_s for r in results) - min(r.sent_s for r in results)
    groups: dict[str, list[RequestResult]] = {}
    for r in results:
        groups.setdefault(key(r), []).append(r)
    return {k: summarize(v, duration_s, slos_ms) for k, v in sorted(groups.items())}


def report(summary: dict[str, Any], label: str = "") -> str | None:
    """Print a one-line warning when requests failed (``label``: which run); return the most
    frequent failure group when every request failed."""
    import sys

    failed = summary["requests"] - summary["completed"]
    if not failed:
        return None
    reasons = summary.get("failures_by_reason", {})
    first = next(iter(reasons), "unknown")
    example = summary.get("failure_examples", {}).get(first, "")
    detail = f", e.g. {example}" if example and example != first else ""
    print(f"WARNING: {label + ': ' if label else ''}{failed} of {summary['requests']} requests "
          f"did not complete ({summary['rejected_429']} rejected with 429, {summary['errors']} "
          f"errors, {summary.get('cancelled', 0)} cancelled); most frequent: {first} "
          f"(x{reasons.get(first, failed)}{detail})", file=sys.stderr)
    return first if summary["completed"] == 0 else None

