"""The rounds of :mod:`benchmarks.serving.batch_impact`'s runs pooled into one figure each."""

from __future__ import annotations

from typing import Any

from benchmarks.harness.metrics import summarize


def pooled(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One interactive run's rounds as one: its figures over every round's requests together
    (TTFT and ITL percentiles of the pooled samples), each round's own p99s beside them, and
    the rounds' CPU seconds, ticks and batch lines summed (ticks' means recomputed)."""
    first = rounds[0]
    out: dict[str, Any] = {"name": first["name"], "rounds": []}
    results = [r for run in rounds for r in run.pop("_results")]
    duration = sum(run.pop("_duration") for run in rounds)
    out["interactive"] = summarize(results, duration)
    for run in rounds:
        out["rounds"].append({
            "ttft_p99_ms": run["interactive"]["ttft_ms"].get("p99"),
            "itl_p99_ms": run["interactive"]["itl_ms"].get("p99"),
            "itl_p50_ms": run["interactive"]["itl_ms"].get("median"),
            "slowest_ttft": run.get("slowest_ttft"),
            "batch_lines_done_meanwhile": run.get("batch_lines_done_meanwhile"),
            "cpu_s": run.get("cpu_s"), "passes": run.get("passes"), "steal": run.get("steal")})
    if "batch_lines_done_meanwhile" in first:
        out["batch_lines_done_meanwhile"] = sum(run.get("batch_lines_done_meanwhile") or 0
                                                for run in rounds)
    out["wall_s"] = round(sum(run["wall_s"] for run in rounds), 1)
    out["cpu_s"] = {k: round(sum(run["cpu_s"].get(k, 0.0) for run in rounds), 2)
                    for k in first["cpu_s"]}
    ticks = sum(run["passes"]["ticks"] for run in rounds)
    busy = sum((run["passes"]["ms_per_tick"] or 0) * run["passes"]["ticks"] for run in rounds)
    tokens = sum((run["passes"]["tokens_per_tick"] or 0) * run["passes"]["ticks"]
                 for run in rounds)
    out["passes"] = {"ticks": ticks,
                     "tokens_per_tick": round(tokens / ticks, 2) if ticks else None,
                     "ms_per_tick": round(busy / ticks, 1) if ticks else None,
                     "busy_share": round(busy / 1000 / out["wall_s"], 3) if out["wall_s"] else None}
    out["steal"] = max((run.get("steal") or 0.0) for run in rounds)
    return out


def pooled_throughput(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One throughput run's rounds as one: its output tokens over its seconds, every round's
    summed; each round's tokens/s kept beside; the rest as the last round had it."""
    out = dict(rounds[-1])
    tokens = sum(run["batch"]["output_tokens"] for run in rounds)
    seconds = sum(run["batch"]["seconds"] for run in rounds)
    out["batch"] = {**rounds[-1]["batch"], "output_tokens": tokens, "seconds": seconds,
                    "tokens_per_s": tokens / seconds if seconds > 0 else None}
    out["rounds_tokens_per_s"] = [run["batch"].get("tokens_per_s") for run in rounds]
    return out
