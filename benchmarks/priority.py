"""Experiment 2: priority tiers: a high tier's TTFT while a low tier saturates the worker.

Tenant ``bulk`` sends short requests at ``--overload`` times the worker's capacity (Poisson);
tenant ``vip`` sends a few (Poisson, ``--vip-rate``). Through the REST API, Redis and one worker
(the reference backend with a step delay: the question is the scheduler's), FCFS within a tier so
that only the tiers differ. Runs:

* ``same-tier``: both tenants ``standard``: vip waits behind bulk's backlog;
* ``tiers``: vip ``premium``, bulk ``batch``, the default worker prefetch (the worker takes from
  the shared queue only its free rows and one more; the queue hands out the highest tier first,
  so vip's requests go ahead of bulk's backlog there);
* ``tiers-deep-prefetch``: the same with ``WORKER_PREFETCH=MAX_QUEUE_SIZE``, so every accepted
  request waits in the worker's own priority-ordered queue rather than in the shared one.

Usage::

    python -m benchmarks.priority                # ~3 min: 3 runs of 30 s plus start-ups
    python -m benchmarks.priority --duration 120
    python -m benchmarks.priority --duration 4 --runs same-tier,tiers-deep-prefetch \
        --out-dir /tmp/priority                  # a quick check
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
from typing import Any

from benchmarks.cli import HelpFormatter, add_out_dir_flag, name_list
from benchmarks.common import (
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
from benchmarks.metrics import records, summarize_by
from benchmarks.servers import Platform, TenantSpec
from benchmarks.targets import RestTarget, run_load
from benchmarks.workload import PromptMaker, merge, poisson_arrivals, random_requests

RUNS = {
    "same-tier": ({"bulk": "standard", "vip": "standard"}, False),
    "tiers": ({"bulk": "batch", "vip": "premium"}, False),
    "tiers-deep-prefetch": ({"bulk": "batch", "vip": "premium"}, True),
}
INPUT_LEN, OUTPUT_LEN = (32, 64), (16, 32)


def capacity_req_s(args: argparse.Namespace) -> float:
    """Requests/s the worker finishes when saturated, from its pace: each tick decodes
    ``batch`` rows at about two forward passes (prefill chunk and decode) of ``step_delay``."""
    mean_out = sum(OUTPUT_LEN) / 2
    return args.batch / (mean_out * 2 * args.step_delay)


async def run_one(name: str, args: argparse.Namespace, rate_bulk: float) -> dict[str, Any]:
    tiers, deep_prefetch = RUNS[name]
    rng = random.Random(args.seed)
    maker = PromptMaker(reference_tokenizer(), seed=args.seed)
    specs = merge(
        random_requests(maker, poisson_arrivals(rate_bulk, args.duration, rng),
                        INPUT_LEN, OUTPUT_LEN, rng, tenant="bulk"),
        random_requests(maker,
                        poisson_arrivals(args.vip_rate, args.duration, rng),
                        INPUT_LEN, OUTPUT_LEN, rng, tenant="vip"))
    env = {"BACKEND": "reference", "REFERENCE_STEP_DELAY_S": args.step_delay,
           "MAX_BATCH_SIZE": args.batch, "MAX_QUEUE_SIZE": args.queue,
           "SCHEDULING_POLICY": "fcfs"}
    if deep_prefetch:
        env["WORKER_PREFETCH"] = args.queue
    with Platform([TenantSpec(t, tier) for t, tier in tiers.items()], **env) as platform:
        async with RestTarget(platform.url, platform.keys) as target:
            results, duration = await run_load(target, specs, desc=name)
    return {"name": name, "tiers": tiers, "env": env,
            "per_tenant": summarize_by(results, lambda r: r.tenant, duration),
            "vip_ttft": [{"sent_s": r.sent_s, "ttft_s": r.ttft_s} for r in results
                         if r.tenant == "vip" and r.ttft_s is not None],
            "results": records(results),
            "all_failed": warn_if_all_failed(results, name)}


# The bars of the right-hand panel: (tenant, statistic of its TTFT), as in the printed table.
BARS = (("vip", "median"), ("vip", "p99"), ("bulk", "median"), ("bulk", "p99"))


def plot(runs: list[dict[str, Any]], out_dir: str | None = None) -> None:
    """vip's TTFT over time per run, and TTFT percentiles per run as bars labelled with their
    values (log scale from a decade below the smallest, so that a 100 ms bar next to 10 s ones
    shows and reads)."""
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5), layout="constrained")
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
    ax2.set_xticks(list(x), [r["name"] for r in runs])
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
        rows.append(row)
    print_table(rows, list(rows[0]))
    path = write_json("priority", {"args": vars(args), "bulk_rate": rate_bulk,
                                   "machine_before": before, "runs": runs}, args.out_dir)
    print(f"wrote {path}")
    return exit_status([r["name"] for r in runs if r["all_failed"]])


if __name__ == "__main__":
    raise SystemExit(main())
