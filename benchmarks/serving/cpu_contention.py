"""Experiment 6b: what another process's CPU time costs the engine on the same cores.

The platform-overhead experiment (``benchmarks/serving/overhead.py``) runs the worker beside daphne,
Redis, Celery and the load generator. This one isolates how their CPU time slows the engine: the
in-process engine runs the overhead experiment's workload (the same sizes and seed) alone, then
beside a competing process that wakes every ``--period-ms`` and keeps a core busy for
``--busy-ms`` (by default 2.5 ms every 20 ms, about the share of one core that daphne, Redis,
Celery and the load generator take in the overhead experiment), in alternating order, each run
on a fresh engine. Printed per run: the run's duration and output tokens/s, the competitor's CPU
seconds (psutil: user + system), and for each pair the engine's added time per CPU second the
competitor used. A figure near 1 means every millisecond another process runs on a core delays
the whole forward pass by a millisecond: the engine's matrix products are split over all cores
and each waits for its slowest part. The overhead ratio a platform can reach on such a machine
is then about ``engine time / (engine time + the other processes' CPU time)``.

Usage::

    python -m benchmarks.serving.cpu_contention                 # ~2.5 min on 2 cores (3 pairs)
    python -m benchmarks.serving.cpu_contention --busy-ms 1 --period-ms 10 --pairs 3
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
from typing import Any

from benchmarks.harness.cli import HelpFormatter, add_out_dir_flag, positive_float, positive_int
from benchmarks.harness.common import machine, make_engine, model_tokenizer, print_table, write_json
from benchmarks.harness.metrics import summarize
from benchmarks.harness.targets import EngineTarget, run_load
from benchmarks.harness.workload import PromptMaker
from benchmarks.serving.overhead import add_workload_flags, workload

# The competitor: sleep for the period's idle part, then spin for the busy part, until killed.
COMPETITOR = """
import sys, time
busy, idle = float(sys.argv[1]), float(sys.argv[2])
while True:
    time.sleep(idle)
    start = time.perf_counter()
    while time.perf_counter() - start < busy:
        pass
"""


def competitor_cpu_s(proc: subprocess.Popen) -> float:
    """User + system CPU seconds of the competitor so far."""
    import psutil

    times = psutil.Process(proc.pid).cpu_times()
    return times.user + times.system


async def one_run(args: argparse.Namespace, maker: PromptMaker,
                  compete: bool) -> dict[str, Any]:
    """A fresh engine (as each run of the overhead experiment has), warmed up, then the
    measured workload alone or beside the competitor (started after the warm-up)."""
    engine = make_engine(real_model=True, scheduling_policy="vtc")
    async with EngineTarget(engine) as target:
        await run_load(target, workload(args, maker, args.warmup, args.seed + 1),
                       max_concurrency=args.concurrency, desc="warm-up")
        proc = None
        if compete:
            busy, idle = args.busy_ms / 1000, (args.period_ms - args.busy_ms) / 1000
            proc = subprocess.Popen([sys.executable, "-c", COMPETITOR, str(busy), str(idle)])
        try:
            before = competitor_cpu_s(proc) if proc else 0.0
            results, duration = await run_load(
                target, workload(args, maker, args.requests, args.seed),
                max_concurrency=args.concurrency,
                desc="beside the competitor" if compete else "alone")
            used = competitor_cpu_s(proc) - before if proc else 0.0
        finally:
            if proc:
                proc.kill()
                proc.wait()
    summary = summarize(results, duration)
    return {"competitor": compete, "duration_s": duration, "competitor_cpu_s": used,
            "output_throughput": summary["output_throughput"], "errors": summary["errors"]}


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    maker = PromptMaker(model_tokenizer(), seed=args.seed)
    runs = []
    for i in range(args.pairs):
        order = (False, True) if i % 2 == 0 else (True, False)
        for compete in order:
            runs.append({"pair": i + 1, **asyncio.run(one_run(args, maker, compete))})
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=HelpFormatter)
    add_workload_flags(parser)
    parser.add_argument("--seed", type=int, default=6, help="workload seed")
    parser.add_argument("--pairs", type=positive_int, default=3,
                        help="pairs of runs (alone, beside), alternating which goes first")
    parser.add_argument("--busy-ms", type=positive_float, default=2.5,
                        help="milliseconds the competitor keeps a core busy per period")
    parser.add_argument("--period-ms", type=positive_float, default=20.0,
                        help="the competitor's period in milliseconds")
    add_out_dir_flag(parser)
    args = parser.parse_args(argv)
    if args.busy_ms >= args.period_ms:
        parser.error("--busy-ms must be below --period-ms")
    before = machine()
    runs = run(args)
    print_table([{"pair": r["pair"], "run": "beside" if r["competitor"] else "alone",
                  "duration_s": r["duration_s"], "out_tok/s": r["output_throughput"],
                  "competitor_cpu_s": r["competitor_cpu_s"], "errors": r["errors"]}
                 for r in runs], ["pair", "run", "duration_s", "out_tok/s", "competitor_cpu_s",
                                  "errors"])
    delays, ratios = [], []
    for i in range(args.pairs):
        alone, beside = (next(r for r in runs if r["pair"] == i + 1 and r["competitor"] is c)
                         for c in (False, True))
        delays.append((beside["duration_s"] - alone["duration_s"])
                      / max(beside["competitor_cpu_s"], 1e-9))
        ratios.append(beside["output_throughput"] / alone["output_throughput"])
    overall = {"added_engine_s_per_competitor_cpu_s": statistics.median(delays),
               "throughput_ratio_beside_over_alone": statistics.median(ratios)}
    print(f"median over pairs: the engine's added time per CPU second of the competitor "
          f"{overall['added_engine_s_per_competitor_cpu_s']:.2f} s; throughput beside / alone "
          f"{overall['throughput_ratio_beside_over_alone']:.3f}")
    path = write_json("cpu_contention", {"args": vars(args), "machine_before": before,
                                         "runs": runs, "overall": overall}, args.out_dir)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
