"""Experiment 2: priority tiers: a high tier's TTFT while a low tier saturates the worker.

Tenant ``bulk`` sends short requests at ``--overload`` times the worker's capacity (Poisson);
tenant ``vip`` sends a few (Poisson, ``--vip-rate``). Through the REST API, Redis and one worker
(the reference backend with a step delay: the question is the scheduler's), FCFS within a tier so
that only the tiers differ. Runs:

* ``same-tier``: both tenants ``standard``: vip waits behind bulk's backlog;
* ``tiers``: vip ``premium``, bulk ``batch``, the default worker prefetch (``MAX_BATCH_SIZE``
  requests taken from the Redis stream ahead of admission);
* ``tiers-deep-prefetch``: the same with ``WORKER_PREFETCH=MAX_QUEUE_SIZE``, so every accepted
  request waits in the worker's priority-ordered queue rather than in the Redis stream (FIFO).

Usage::

    python -m benchmarks.priority                # ~3 min: 3 runs of 30 s plus start-ups
    python -m benchmarks.priority --duration 120
"""

from __future__ import annotations

import argparse
import asyncio
import random
from typing import Any

from benchmarks import loadgen
from benchmarks.common import machine, reference_tokenizer, save_figure, write_json
from benchmarks.servers import Platform, TenantSpec

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
    maker = loadgen.PromptMaker(reference_tokenizer(), seed=args.seed)
    specs = loadgen.merge(
        loadgen.random_requests(maker, loadgen.poisson_arrivals(rate_bulk, args.duration, rng),
                                INPUT_LEN, OUTPUT_LEN, rng, tenant="bulk"),
        loadgen.random_requests(maker,
                                loadgen.poisson_arrivals(args.vip_rate, args.duration, rng),
                                INPUT_LEN, OUTPUT_LEN, rng, tenant="vip"))
    env = {"BACKEND": "reference", "REFERENCE_STEP_DELAY_S": args.step_delay,
           "MAX_BATCH_SIZE": args.batch, "MAX_QUEUE_SIZE": args.queue,
           "SCHEDULING_POLICY": "fcfs"}
    if deep_prefetch:
        env["WORKER_PREFETCH"] = args.queue
    with Platform([TenantSpec(t, tier) for t, tier in tiers.items()], **env) as platform:
        async with loadgen.RestTarget(platform.url, platform.keys) as target:
            results, duration = await loadgen.run_load(target, specs, desc=name)
    return {"name": name, "tiers": tiers, "env": env,
            "per_tenant": loadgen.summarize_by(results, lambda r: r.tenant, duration),
            "vip_ttft": [{"sent_s": r.sent_s, "ttft_s": r.ttft_s} for r in results
                         if r.tenant == "vip" and r.ttft_s is not None]}


def plot(runs: list[dict[str, Any]]) -> None:
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for run in runs:
        pts = run["vip_ttft"]
        ax1.plot([p["sent_s"] for p in pts], [p["ttft_s"] for p in pts], "o-", ms=3,
                 label=run["name"])
    ax1.set_yscale("log")
    ax1.set_xlabel("time (s)")
    ax1.set_ylabel("vip TTFT (s, log)")
    ax1.set_title("vip's TTFT while bulk saturates the worker")
    ax1.legend()
    names = [r["name"] for r in runs]
    x = range(len(runs))
    for offset, (tenant, stat) in enumerate([("vip", "median"), ("vip", "p99"),
                                              ("bulk", "median")]):
        vals = [r["per_tenant"].get(tenant, {}).get("ttft_ms", {}).get(stat, 0) / 1000
                for r in runs]
        ax2.bar([i + 0.27 * (offset - 1) for i in x], vals, width=0.27,
                label=f"{tenant} {stat}")
    ax2.set_xticks(list(x), names)
    ax2.set_yscale("log")
    ax2.set_ylabel("TTFT (s, log)")
    ax2.set_title("TTFT by run")
    ax2.legend()
    fig.tight_layout()
    save_figure(fig, "priority")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=30, help="seconds of arrivals per run")
    parser.add_argument("--overload", type=float, default=2.0,
                        help="bulk's rate as a multiple of the worker's capacity")
    parser.add_argument("--vip-rate", type=float, default=1.0, help="vip's requests/s")
    parser.add_argument("--step-delay", type=float, default=0.02,
                        help="seconds per forward pass of the reference backend")
    parser.add_argument("--batch", type=int, default=4, help="MAX_BATCH_SIZE")
    parser.add_argument("--queue", type=int, default=128, help="MAX_QUEUE_SIZE (gate 1)")
    parser.add_argument("--runs", default=",".join(RUNS))
    parser.add_argument("--seed", type=int, default=2)
    args = parser.parse_args(argv)
    before = machine()
    rate_bulk = args.overload * capacity_req_s(args)
    runs = [asyncio.run(run_one(name, args, rate_bulk)) for name in args.runs.split(",")]
    plot(runs)
    for run in runs:
        vip, bulk = run["per_tenant"].get("vip", {}), run["per_tenant"].get("bulk", {})
        print(f"{run['name']:>22}: vip TTFT p50 {vip['ttft_ms']['median']:.0f} ms, "
              f"p99 {vip['ttft_ms']['p99']:.0f} ms; bulk TTFT p50 "
              f"{bulk['ttft_ms']['median']:.0f} ms, 429s {bulk['rejected_429']}")
    path = write_json("priority", {"args": vars(args), "bulk_rate": rate_bulk,
                                   "machine_before": before, "runs": runs})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
