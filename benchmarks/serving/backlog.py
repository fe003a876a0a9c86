"""Experiment 8: a light tenant's wait behind a heavy tenant's backlog, through the platform.

Tenant ``A`` sends ``--backlogs`` requests at once (streamed, ``--a-tokens`` each, a random length
in the range, so that its rows end at different times as real answers do); ``--delay`` seconds
later tenant ``B``, of the same tier, sends ``--b-requests`` (``--b-tokens`` each). B's TTFT is
measured through the REST API, Redis and ``--workers`` inference workers (the reference backend
with a step delay near the real model's decode step at 32 rows on 2 cores: the question is the
queue's and the scheduler's). When B's requests
have ended, A's are cancelled (their clients go away) and the platform is left to go idle before
the next run. With the deployment's fair order, B is next for the first free row whatever the
depth of A's backlog; the figure to read is B's TTFT p99 at the deepest backlog against the
shallowest (target: within 1.5x), beside B's TTFT on an idle platform. B still waits for rows to
free up (requests of one tier are not preempted): behind a backlog that fills every row, its
requests start as A's rows end, so the comparison holds between backlogs that both fill the rows
when B arrives.

Usage::

    python -m benchmarks.serving.backlog          # 40/120/240 x 3 repeats, with 1 and 2 workers
    python -m benchmarks.serving.backlog --backlogs 40,240 --repeats 1 --workers 1 --out-dir /tmp/b
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
from typing import Any

from benchmarks.harness.cli import HelpFormatter, add_out_dir_flag, positive_float, positive_int
from benchmarks.harness.common import (
    exit_status,
    machine,
    print_table,
    reference_tokenizer,
    warn_if_all_failed,
    write_json,
)
from benchmarks.harness.metrics import percentile, records
from benchmarks.harness.servers import Platform, TenantSpec
from benchmarks.harness.targets import RestTarget, run_load
from benchmarks.harness.workload import PromptMaker, RequestSpec

INPUT_LEN = (32, 64)


def int_list(text: str) -> list[int]:
    """A comma-separated list of positive integers (an argparse type)."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"need positive integers, got {text!r}")
    return values


def token_range(text: str) -> tuple[int, int]:
    """``MIN,MAX`` positive integers, MIN <= MAX (an argparse type)."""
    values = int_list(text)
    if len(values) != 2 or values[0] > values[1]:
        raise argparse.ArgumentTypeError(f"need MIN,MAX with MIN <= MAX, got {text!r}")
    return values[0], values[1]


def workload(args: argparse.Namespace, backlog: int, seed: int) -> list[RequestSpec]:
    """A's backlog at time 0 (tagged ``backlog``: background load) and B's requests later."""
    rng = random.Random(seed)
    maker = PromptMaker(reference_tokenizer(), seed=seed)

    def spec(tenant: str, at: float, tokens: int, tag: str) -> RequestSpec:
        length = rng.randint(*INPUT_LEN)
        return RequestSpec(tenant=tenant, arrival_s=at, prompt=maker.make(length, rng),
                           max_tokens=tokens, prompt_len=length, ignore_eos=True, tag=tag)

    specs = [spec("A", 0.0, rng.randint(*args.a_tokens), "backlog") for _ in range(backlog)]
    specs += [spec("B", args.delay, args.b_tokens, "light") for _ in range(args.b_requests)]
    return specs


async def run_one(platform: Platform, args: argparse.Namespace, backlog: int,
                  seed: int) -> dict[str, Any]:
    """One run: B's TTFTs (seconds) behind A's backlog of ``backlog`` (0: an idle platform)."""
    specs = workload(args, backlog, seed)
    if backlog == 0:  # an idle platform: B's requests at once
        specs = [dataclasses.replace(s, arrival_s=0.0) for s in specs]
    async with RestTarget(platform.url, platform.keys) as target:
        results, _ = await run_load(target, specs, desc=f"backlog {backlog}",
                                    background_tags=["backlog"] if backlog else ())
    assert platform.stack is not None
    platform.stack.wait_idle(timeout_s=120)
    light = [r for r in results if r.tenant == "B"]
    ttfts = [r.ttft_s for r in light if r.ttft_s is not None]
    a_done = sum(r.tenant == "A" and r.status == "ok" for r in results)
    return {"backlog": backlog, "seed": seed, "b_ttft_s": ttfts,
            "b_completed": sum(r.status == "ok" for r in light),
            "a_completed_before_b_ended": a_done, "results": records(results),
            "all_failed": warn_if_all_failed(light, f"backlog {backlog}")}


def summarize(runs: list[dict[str, Any]], backlog: int) -> dict[str, float | None]:
    """B's TTFT p50 and p99 (ms) over every repeat at one backlog depth."""
    ttfts = [t for r in runs if r["backlog"] == backlog for t in r["b_ttft_s"]]
    if not ttfts:
        return {"p50": None, "p99": None}
    return {"p50": percentile(ttfts, 50) * 1000, "p99": percentile(ttfts, 99) * 1000}


async def run_workers(workers: int, args: argparse.Namespace) -> dict[str, Any]:
    env = {"BACKEND": "reference", "REFERENCE_STEP_DELAY_S": args.step_delay,
           "MAX_BATCH_SIZE": args.batch, "MAX_QUEUE_SIZE": max(args.backlogs) + 64,
           "SCHEDULING_POLICY": args.policy}
    with Platform([TenantSpec("A"), TenantSpec("B")], workers=workers, **env) as platform:
        runs = [await run_one(platform, args, 0, args.seed)]
        for backlog in args.backlogs:
            for repeat in range(args.repeats):
                runs.append(await run_one(platform, args, backlog, args.seed + repeat))
    table = {str(b): summarize(runs, b) for b in [0, *args.backlogs]}
    shallow, deep = table[str(min(args.backlogs))]["p99"], table[str(max(args.backlogs))]["p99"]
    return {"workers": workers, "env": env, "runs": runs, "b_ttft_ms": table,
            "deep_over_shallow_p99": deep / shallow if deep and shallow else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=HelpFormatter)
    parser.add_argument("--backlogs", type=int_list, default=[40, 120, 240],
                        help="A's backlog depths (requests sent at once)")
    parser.add_argument("--repeats", type=positive_int, default=3, help="runs per depth")
    parser.add_argument("--workers", type=int_list, default=[1, 2],
                        help="inference worker counts to run with")
    parser.add_argument("--delay", type=positive_float, default=8.0,
                        help="seconds between A's backlog and B's requests")
    parser.add_argument("--b-requests", type=positive_int, default=10, help="B's requests")
    parser.add_argument("--a-tokens", type=token_range, default=(32, 96),
                        help="MIN,MAX: max_tokens of A's requests, uniform in the range")
    parser.add_argument("--b-tokens", type=positive_int, default=16, help="max_tokens of B's")
    parser.add_argument("--step-delay", type=positive_float, default=0.15,
                        help="seconds per forward pass of the reference backend")
    parser.add_argument("--batch", type=positive_int, default=32, help="MAX_BATCH_SIZE")
    parser.add_argument("--policy", choices=("vtc", "fcfs"), default="vtc",
                        help="SCHEDULING_POLICY")
    parser.add_argument("--seed", type=int, default=3, help="workload seed")
    add_out_dir_flag(parser)
    args = parser.parse_args(argv)
    before = machine()
    results = [asyncio.run(run_workers(n, args)) for n in args.workers]
    rows = []
    for res in results:
        for backlog, stats in res["b_ttft_ms"].items():
            rows.append({"workers": res["workers"], "A backlog": backlog or "idle",
                         "B TTFT p50 ms": stats["p50"], "B TTFT p99 ms": stats["p99"]})
    print_table(rows, list(rows[0]))
    for res in results:
        ratio = res["deep_over_shallow_p99"]
        print(f"{res['workers']} worker(s): B's TTFT p99 at backlog {max(args.backlogs)} / at "
              f"{min(args.backlogs)} = {ratio:.2f}" if ratio else "no ratio (no TTFT)")
    path = write_json("backlog", {"args": vars(args), "machine_before": before,
                                  "results": results}, args.out_dir)
    print(f"wrote {path}")
    return exit_status([f"{r['workers']} workers" for r in results
                        if all(run["all_failed"] for run in r["runs"])])


if __name__ == "__main__":
    raise SystemExit(main())
