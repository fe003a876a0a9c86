"""Experiment 5: overload: offered load from a quarter to twice the capacity.

Through the REST API, Redis and one worker (the reference backend with a step delay: the question
is admission and backpressure, not the model). First a closed-loop run at ``3 x MAX_BATCH_SIZE``
concurrency measures the capacity (completed requests/s); then Poisson arrivals at each multiple
of it in ``--loads`` for ``--duration`` seconds each, from two tenants with their own keys. What
should hold: completed throughput levels off at the capacity, the latency of completed requests
stays bounded (gate 1 bounds the queue at ``MAX_QUEUE_SIZE``), and the excess is refused with
fast 429s instead of queueing without end.

Usage::

    python -m benchmarks.serving.overload                 # ~3.5 min: 5 loads x 30 s
    python -m benchmarks.serving.overload --duration 120 --loads 0.25,0.5,1,1.5,2,3
    python -m benchmarks.serving.overload --duration 4 --loads 1,3 --probe-requests 12 --batch 2 \
        --queue 4 --out-dir /tmp/overload        # a quick check (with some 429s)
"""

from __future__ import annotations

import argparse
import asyncio
import random
from typing import Any

from benchmarks.harness.cli import (
    HelpFormatter,
    add_out_dir_flag,
    non_negative_float,
    positive_float,
    positive_int,
)
from benchmarks.harness.common import (
    exit_status,
    legend_outside,
    machine,
    print_table,
    reference_tokenizer,
    save_figure,
    warn_if_all_failed,
    write_json,
)
from benchmarks.harness.metrics import failure_counts, records, summarize
from benchmarks.harness.servers import Platform, TenantSpec
from benchmarks.harness.targets import RestTarget, run_load
from benchmarks.harness.workload import (
    PromptMaker,
    RequestSpec,
    merge,
    poisson_arrivals,
    random_requests,
)

INPUT_LEN, OUTPUT_LEN = (32, 128), (32, 64)
TENANTS = ("t1", "t2")
SLOS_MS = {"ttft": 2000, "tpot": 200}


def workload(rate: float, duration: float, seed: int,
             maker: PromptMaker) -> list[RequestSpec]:
    rng = random.Random(seed)
    return merge(*(
        random_requests(maker, poisson_arrivals(rate / 2, duration, rng),
                        INPUT_LEN, OUTPUT_LEN, rng, tenant=t) for t in TENANTS))


async def run(args: argparse.Namespace) -> dict[str, Any]:
    maker = PromptMaker(reference_tokenizer(), seed=args.seed)
    env = {"BACKEND": "reference", "REFERENCE_STEP_DELAY_S": args.step_delay,
           "MAX_BATCH_SIZE": args.batch, "MAX_QUEUE_SIZE": args.queue}
    points = []
    with Platform([TenantSpec(t) for t in TENANTS], **env) as platform:
        async with RestTarget(platform.url, platform.keys) as target:
            rng = random.Random(args.seed)
            probe = [RequestSpec(maker.make(rng.randint(*INPUT_LEN), rng),
                                 rng.randint(*OUTPUT_LEN), TENANTS[i % 2])
                     for i in range(args.probe_requests)]
            results, duration = await run_load(target, probe,
                                               max_concurrency=3 * args.batch,
                                               desc="capacity")
            probe_results = records(results)
            capacity = summarize(results, duration)["request_throughput"]
            if not capacity > 0:
                warn_if_all_failed(results, "capacity probe")
                raise SystemExit("overload: the capacity probe completed no request "
                                 f"({failure_counts(results) or 'no results'})")
            for i, load in enumerate(args.loads):
                specs = workload(load * capacity, args.duration, args.seed + i, maker)
                if not specs:
                    print(f"note: {load:g} x capacity: the Poisson draw over "
                          f"{args.duration:g} s is empty; load point skipped")
                    continue
                results, duration = await run_load(target, specs,
                                                   desc=f"{load:g} x capacity")
                summary = summarize(results, duration, SLOS_MS)
                points.append({"load": load, "offered_rate": load * capacity,
                               "offered_requests": len(specs),
                               "rejected_rate": summary["rejected_429"] / args.duration,
                               **summary, "results": records(results),
                               "all_failed": warn_if_all_failed(results,
                                                                f"{load:g} x capacity")})
                await asyncio.sleep(args.queue / capacity)  # let the backlog drain
    return {"capacity_req_s": capacity, "env": env, "points": points,
            "probe_results": probe_results}


def plot(data: dict[str, Any], out_dir: str | None = None) -> None:
    """Throughput and rejections, the latency of completed requests (s) and that of the 429s
    (ms, on its own axes: it is thousands of times shorter) against the offered load."""
    import matplotlib.pyplot as plt

    pts = data["points"]
    x = [p["offered_rate"] for p in pts]
    capacity = data["capacity_req_s"]

    def ms(p: dict[str, Any], name: str, stat: str) -> float:
        value = (p[name] or {}).get(stat)
        return float("nan") if value is None else value

    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(8.5, 10), sharex=True,
                                        layout="constrained")
    ax1.plot(x, x, ":", color="gray", label="offered")
    ax1.plot(x, [p["request_throughput"] for p in pts], "o-", label="completed")
    ax1.plot(x, [p["rejected_rate"] for p in pts], "s-", label="429 (rejected)")
    ax1.plot(x, [p.get("goodput", 0) for p in pts], "^-",
             label="goodput (TTFT <= {ttft:g} ms,\nTPOT <= {tpot:g} ms)".format(**SLOS_MS))
    ax1.set_ylabel("requests/s")
    ax1.set_title("Throughput and rejections")
    for name, color in (("ttft_ms", "tab:blue"), ("e2el_ms", "tab:green")):
        label = name[:-3].upper()
        ax2.plot(x, [ms(p, name, "p99") / 1000 for p in pts], "o-", color=color,
                 label=f"{label} p99")
        ax2.plot(x, [ms(p, name, "median") / 1000 for p in pts], "o--", color=color,
                 mfc="none", alpha=0.7, label=f"{label} p50")
    ax2.set_ylabel("seconds")
    ax2.set_ylim(bottom=0)
    ax2.set_title("Latency of completed requests")
    for stat, style in (("p99", "x-"), ("median", "x--")):
        ax3.plot(x, [ms(p, "rejection_latency_ms", stat) for p in pts], style,
                 color="tab:purple", label=f"429 latency {'p50' if stat == 'median' else stat}")
    none = [p["offered_rate"] for p in pts if not p["rejected_429"]]
    if none:
        ax3.plot(none, [0] * len(none), "o", color="gray", mfc="none", clip_on=False,
                 label="no 429 at this load")
    ax3.set_ylabel("milliseconds")
    if any(p["rejected_429"] for p in pts):
        ax3.set_ylim(bottom=0)
    else:
        ax3.set_ylim(0, 1)
        ax3.text(0.5, 0.5, "no request was refused", transform=ax3.transAxes, ha="center",
                 va="center", color="gray")
    ax3.set_title("Latency of the 429 responses (send to refusal)")
    ax3.set_xlabel("offered load (requests/s)")
    for ax in (ax1, ax2, ax3):
        ax.axvline(capacity, color="red", ls="--", lw=1,
                   label=f"capacity ({capacity:.2f} requests/s)")
        legend_outside(ax)
    save_figure(fig, "overload", out_dir)


def load_list(text: str) -> list[float]:
    """argparse ``type``: a comma-separated list of positive numbers (multiples of capacity)."""
    loads = []
    for item in text.split(","):
        try:
            loads.append(positive_float(item.strip()))
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a comma-separated list of positive numbers ({exc})") from None
    return loads


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=HelpFormatter)
    parser.add_argument("--duration", type=positive_float, default=30,
                        help="seconds per load")
    parser.add_argument("--loads", type=load_list, default="0.25,0.5,1,1.5,2",
                        help="multiples of capacity, comma-separated")
    parser.add_argument("--step-delay", type=non_negative_float, default=0.02,
                        help="seconds per forward pass of the reference backend")
    parser.add_argument("--batch", type=positive_int, default=8, help="MAX_BATCH_SIZE")
    parser.add_argument("--queue", type=positive_int, default=16,
                        help="MAX_QUEUE_SIZE (gate 1)")
    parser.add_argument("--probe-requests", type=positive_int, default=64,
                        help="requests of the closed-loop capacity probe")
    parser.add_argument("--seed", type=int, default=5, help="workload seed")
    add_out_dir_flag(parser)
    args = parser.parse_args(argv)
    before = machine()
    data = asyncio.run(run(args))
    plot(data, args.out_dir)
    print(f"capacity {data['capacity_req_s']:.2f} req/s")
    print_table([{"load": p["load"], "offered/s": p["offered_rate"],
                  "done/s": p["request_throughput"], "429/s": p["rejected_rate"],
                  "errors": p["errors"], "ttft_p50_ms": p["ttft_ms"]["median"],
                  "ttft_p99_ms": p["ttft_ms"]["p99"], "e2el_p99_ms": p["e2el_ms"]["p99"],
                  "429_p50_ms": p["rejection_latency_ms"]["median"],
                  "429_p99_ms": p["rejection_latency_ms"]["p99"]} for p in data["points"]],
                ["load", "offered/s", "done/s", "429/s", "errors", "ttft_p50_ms", "ttft_p99_ms",
                 "e2el_p99_ms", "429_p50_ms", "429_p99_ms"])
    path = write_json("overload", {"args": vars(args), "machine_before": before, "slos_ms":
                                   SLOS_MS, **data}, args.out_dir)
    print(f"wrote {path}")
    return exit_status([f"{p['load']:g} x capacity" for p in data["points"] if p["all_failed"]])


if __name__ == "__main__":
    raise SystemExit(main())
