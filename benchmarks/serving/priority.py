"""Experiment 2: priority tiers: a high tier's TTFT while a low tier saturates the worker.

Tenant ``bulk`` sends short requests at ``--overload`` times the worker's capacity (Poisson);
tenant ``vip`` sends a few (Poisson, ``--vip-rate``). Through the REST API, Redis and one worker
(the reference backend with a step delay: the question is the scheduler's), FCFS within a tier so
that only the tiers differ. Runs:

* ``same-tier``: both tenants ``standard``: vip waits behind bulk's backlog;
* ``tiers``: vip ``premium``, bulk ``batch``, the default worker prefetch (the worker takes from
  the shared queue only its free rows and one more; the queue hands out the highest tier first,
  so vip's requests go ahead of bulk's backlog there), preemption off: vip waits for a row;
* ``tiers-deep-prefetch``: the same with ``WORKER_PREFETCH=MAX_QUEUE_SIZE``, so every accepted
  request waits in the worker's own priority-ordered queue rather than in the shared one;
* ``tiers-preemption``: ``tiers`` with priority preemption on (the default): a vip request that
  finds every row taken preempts a bulk row, which goes back to the shared queue;
* ``idle``: vip's requests alone on an idle platform (no bulk): the TTFT to compare with.

The verdict (printed, not asserted): vip's TTFT p99 under ``tiers-preemption`` against the idle
platform's p99 plus 3 forward passes (``--step-delay`` each), both measured in this invocation;
and what preemption costs the batch tier: bulk's output tokens/s against ``tiers``, the rows the
worker kept busy, the preemptions and the prompt tokens recomputed for them.

Usage::

    python -m benchmarks.serving.priority                # ~4 min: 5 runs of 30 s plus start-ups
    python -m benchmarks.serving.priority --duration 120
    python -m benchmarks.serving.priority --duration 4 --runs idle,tiers-preemption \
        --out-dir /tmp/priority                  # a quick check
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
from typing import Any

import httpx

from benchmarks.harness.cli import HelpFormatter, add_out_dir_flag, name_list
from benchmarks.harness.common import (
    annotate_bars,
    exit_status,
    fmt_ms,
    legend_outside,
    machine,
    ms_log_axis,
    print_table,
    reference_tokenizer,
    save_figure,
    warn_if_all_failed,
    write_json,
)
from benchmarks.harness.metrics import records, summarize_by
from benchmarks.harness.servers import Platform, TenantSpec
from benchmarks.harness.targets import RestTarget, run_load
from benchmarks.harness.workload import PromptMaker, merge, poisson_arrivals, random_requests

# name -> (each tenant's tier, worker settings beside the common ones; "WORKER_PREFETCH": None
# means MAX_QUEUE_SIZE)
RUNS: dict[str, tuple[dict[str, str], dict[str, Any]]] = {
    "same-tier": ({"bulk": "standard", "vip": "standard"}, {"PREEMPTION": "false"}),
    "tiers": ({"bulk": "batch", "vip": "premium"}, {"PREEMPTION": "false"}),
    "tiers-deep-prefetch": ({"bulk": "batch", "vip": "premium"},
                            {"PREEMPTION": "false", "WORKER_PREFETCH": None}),
    "tiers-preemption": ({"bulk": "batch", "vip": "premium"}, {"PREEMPTION": "true"}),
    "idle": ({"vip": "premium"}, {"PREEMPTION": "true"}),
}
INPUT_LEN, OUTPUT_LEN = (32, 64), (16, 32)
# The verdict: vip's TTFT p99 with preemption within the idle platform's p99 plus this many
# forward passes.
PASSES_OVER_IDLE = 3


def capacity_req_s(args: argparse.Namespace) -> float:
    """Requests/s the worker finishes when saturated, from its pace: each tick decodes
    ``batch`` rows at about two forward passes (prefill chunk and decode) of ``step_delay``."""
    mean_out = sum(OUTPUT_LEN) / 2
    return args.batch / (mean_out * 2 * args.step_delay)


async def run_one(name: str, args: argparse.Namespace, rate_bulk: float) -> dict[str, Any]:
    tiers, settings = RUNS[name]
    rng = random.Random(args.seed)
    maker = PromptMaker(reference_tokenizer(), seed=args.seed)
    # The same arrivals in every run (the idle run leaves bulk's out).
    bulk = random_requests(maker, poisson_arrivals(rate_bulk, args.duration, rng),
                           INPUT_LEN, OUTPUT_LEN, rng, tenant="bulk")
    vip = random_requests(maker, poisson_arrivals(args.vip_rate, args.duration, rng),
                          INPUT_LEN, OUTPUT_LEN, rng, tenant="vip")
    specs = merge(bulk, vip) if "bulk" in tiers else vip
    env = {"BACKEND": "reference", "REFERENCE_STEP_DELAY_S": args.step_delay,
           "MAX_BATCH_SIZE": args.batch, "MAX_QUEUE_SIZE": args.queue,
           "SCHEDULING_POLICY": "fcfs", "MAX_PREEMPTIONS": args.max_preemptions,
           **{k: args.queue if v is None else v for k, v in settings.items()}}
    samples: list[dict[str, Any]] = []
    with Platform([TenantSpec(t, tier) for t, tier in tiers.items()], **env) as platform:
        headers = {"Authorization": f"Bearer {platform.keys['operator']}"}
        async with httpx.AsyncClient(base_url=platform.url, headers=headers,
                                     timeout=5) as client:

            async def sample(now: float) -> None:
                total = (await client.get("/scheduler/stats")).json()["total"]
                samples.append({"t": now, **{k: total.get(k) or 0 for k in (
                    "num_active", "num_prefilling", "tokens_generated", "preemptions",
                    "preempted_tokens_recomputed")}})

            async with RestTarget(platform.url, platform.keys) as target:
                results, duration = await run_load(target, specs, desc=name, sample=sample,
                                                   sample_every_s=0.5)
            await sample(duration)
    return {"name": name, "tiers": tiers, "env": env,
            "per_tenant": summarize_by(results, lambda r: r.tenant, duration),
            "vip_ttft": [{"sent_s": r.sent_s, "ttft_s": r.ttft_s} for r in results
                         if r.tenant == "vip" and r.ttft_s is not None],
            "worker": worker_figures(samples, args),
            "results": records(results),
            "all_failed": warn_if_all_failed(results, name)}


def worker_figures(samples: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """The worker over the arrivals' window (from the first sample to ``--duration``): the
    share of its rows busy, the tokens it generated per second, and at the end its preemptions
    and the prompt tokens it recomputed for them."""
    window = [s for s in samples if s["t"] <= args.duration] or samples
    if not window:
        return {}
    busy = [(s["num_active"] + s["num_prefilling"]) / args.batch for s in window]
    first, last = window[0], window[-1]
    span = last["t"] - first["t"]
    return {"rows_busy": sum(busy) / len(busy),
            "tokens_per_s": ((last["tokens_generated"] - first["tokens_generated"]) / span
                             if span > 0 else None),
            "preemptions": samples[-1]["preemptions"],
            "preempted_tokens_recomputed": samples[-1]["preempted_tokens_recomputed"]}


def verdict(runs: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any] | None:
    """vip's TTFT p99 with preemption against the idle platform's p99 plus
    :data:`PASSES_OVER_IDLE` forward passes, and bulk's throughput against ``tiers`` (None
    without the runs it needs)."""
    by_name = {r["name"]: r for r in runs}

    def stat(run: str, tenant: str, figure: str, key: str) -> float | None:
        value = (by_name[run]["per_tenant"].get(tenant) or {}).get(figure)
        return value.get(key) if isinstance(value, dict) else value

    if not {"idle", "tiers-preemption"} <= set(by_name):
        return None
    idle_p99 = stat("idle", "vip", "ttft_ms", "p99")
    p99 = stat("tiers-preemption", "vip", "ttft_ms", "p99")
    if idle_p99 is None or p99 is None:
        return None
    bound = idle_p99 + PASSES_OVER_IDLE * args.step_delay * 1000
    out: dict[str, Any] = {"vip_ttft_p99_ms": p99, "idle_vip_ttft_p99_ms": idle_p99,
                           "bound_ms": bound, "pass": p99 <= bound}
    if "tiers" in by_name:
        base = stat("tiers", "bulk", "output_throughput", "")
        with_preemption = stat("tiers-preemption", "bulk", "output_throughput", "")
        if base and with_preemption is not None:
            out["bulk_tokens_per_s"] = {"tiers": base, "tiers-preemption": with_preemption}
            out["bulk_throughput_cost"] = 1 - with_preemption / base
    return out


# The bars of the right-hand panel: (tenant, statistic of its TTFT), as in the printed table.
BARS = (("vip", "median"), ("vip", "p99"), ("bulk", "median"), ("bulk", "p99"))


def plot(runs: list[dict[str, Any]], out_dir: str | None = None) -> None:
    """vip's TTFT over time per run, and TTFT percentiles per run as bars labelled with their
    values (log scale from a decade below the smallest, so that a 100 ms bar next to 10 s ones
    shows and reads)."""
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5), layout="constrained")
    for run in runs:
        pts = run["vip_ttft"]
        ax1.plot([p["sent_s"] for p in pts], [p["ttft_s"] * 1000 for p in pts], "o-", ms=3,
                 label=run["name"])
    ax1.set_yscale("log")
    ms_log_axis(ax1.yaxis)
    ax1.set_xlabel("time the request was sent (s)")
    ax1.set_ylabel("vip TTFT (log scale)")
    ax1.set_title("vip's TTFT while bulk saturates the worker")
    ax1.legend(loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=len(runs), fontsize=9)
    x = range(len(runs))
    width = 0.8 / len(BARS)
    values = []
    for j, (tenant, stat) in enumerate(BARS):
        vals = [(r["per_tenant"].get(tenant, {}).get("ttft_ms") or {}).get(stat) for r in runs]
        vals = [v if v is not None else float("nan") for v in vals]
        values.extend(v for v in vals if v == v and v > 0)
        bars = ax2.bar([i + width * (j - (len(BARS) - 1) / 2) for i in x], vals, width=width,
                       label=f"{tenant} {'p50' if stat == 'median' else stat}")
        annotate_bars(ax2, bars, [fmt_ms(v) for v in vals], fontsize=8, rotation=90)
    ax2.set_xticks(list(x), [r["name"] for r in runs], rotation=20, ha="right")
    ax2.set_yscale("log")
    if values:
        low = 10 ** math.floor(math.log10(min(values)) - 0.5)
        ax2.set_ylim(low, max(values) * 12)
    ms_log_axis(ax2.yaxis)
    ax2.set_ylabel("TTFT (log scale)")
    ax2.set_title("TTFT percentiles by run (value on each bar)")
    legend_outside(ax2)
    save_figure(fig, "priority", out_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=HelpFormatter)
    parser.add_argument("--duration", type=float, default=30, help="seconds of arrivals per run")
    parser.add_argument("--overload", type=float, default=2.0,
                        help="bulk's rate as a multiple of the worker's capacity")
    parser.add_argument("--vip-rate", type=float, default=1.0, help="vip's requests/s")
    parser.add_argument("--step-delay", type=float, default=0.02,
                        help="seconds per forward pass of the reference backend")
    parser.add_argument("--batch", type=int, default=4, help="MAX_BATCH_SIZE")
    parser.add_argument("--queue", type=int, default=128, help="MAX_QUEUE_SIZE (gate 1)")
    parser.add_argument("--max-preemptions", type=int, default=2,
                        help="MAX_PREEMPTIONS (runs with preemption on)")
    parser.add_argument("--runs", type=name_list(tuple(RUNS)), default=",".join(RUNS),
                        metavar="LIST", help=f"comma-separated, out of {', '.join(RUNS)}")
    parser.add_argument("--seed", type=int, default=2, help="workload seed")
    add_out_dir_flag(parser)
    args = parser.parse_args(argv)
    before = machine()
    rate_bulk = args.overload * capacity_req_s(args)
    runs = [asyncio.run(run_one(name, args, rate_bulk)) for name in args.runs]
    plot(runs, args.out_dir)
    rows = []
    for run in runs:
        row: dict[str, Any] = {"run": run["name"]}
        for tenant, stat in BARS:
            ttft = run["per_tenant"].get(tenant, {}).get("ttft_ms") or {}
            row[f"{tenant}_ttft_{'p50' if stat == 'median' else stat}_ms"] = ttft.get(stat)
        row["429s"] = sum(t["rejected_429"] for t in run["per_tenant"].values())
        row["bulk_tok_s"] = (run["per_tenant"].get("bulk") or {}).get("output_throughput")
        worker = run["worker"]
        row["rows_busy"] = worker.get("rows_busy")
        row["preemptions"] = worker.get("preemptions")
        row["recomputed"] = worker.get("preempted_tokens_recomputed")
        rows.append(row)
    print_table(rows, list(rows[0]))
    result = verdict(runs, args)
    if result is not None:
        print(f"vip TTFT p99 with preemption {result['vip_ttft_p99_ms']:.0f} ms <= idle p99 "
              f"{result['idle_vip_ttft_p99_ms']:.0f} ms + {PASSES_OVER_IDLE} passes = "
              f"{result['bound_ms']:.0f} ms: {'PASS' if result['pass'] else 'MISS'}")
        if "bulk_throughput_cost" in result:
            tok = result["bulk_tokens_per_s"]
            print(f"bulk output tokens/s: {tok['tiers']:.1f} without preemption, "
                  f"{tok['tiers-preemption']:.1f} with: a cost of "
                  f"{100 * result['bulk_throughput_cost']:.1f} %")
    path = write_json("priority", {"args": vars(args), "bulk_rate": rate_bulk,
                                   "machine_before": before, "runs": runs,
                                   "verdict": result}, args.out_dir)
    print(f"wrote {path}")
    return exit_status([r["name"] for r in runs if r["all_failed"]])


if __name__ == "__main__":
    raise SystemExit(main())
