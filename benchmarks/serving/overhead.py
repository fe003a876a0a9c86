"""Experiment 6: platform overhead: REST + Redis + worker against the engine in-process.

The same workload on the real default model, with the worker's default engine settings (VTC,
``MAX_BATCH_SIZE`` 32, chunked prefill): ``--requests`` requests of ``--input-len`` prompt tokens
and exactly ``--output-len`` generated tokens (EOS ignored), ``--concurrency`` in flight (closed
loop), sent

* ``engine``: to :class:`inference.engine.llm_engine.LLMEngine` in this process (token times taken
  when each tick ends; no HTTP, no Redis);
* ``rest``: to ``POST /v1/completions`` (streamed) of daphne, through Redis to one inference
  worker process, with Celery recording usage (token times taken when the client reads each
  SSE chunk).

Both are warmed up first with ``--warmup`` requests. Reported: the throughput ratio (REST output
tokens/s over the engine's; target at least 0.9), the latency the platform adds: TTFT, TPOT
and ITL differences (ms), and the CPU time each process spent during the measured run (psutil:
user + system seconds of daphne, Redis, Celery, the worker and this client process), which shows
what the platform costs independently of the machine's run-to-run noise in throughput, and the
same per streamed token (ms; the web tier, daphne + Redis + Celery, aims at 0.1 ms at 16
streams). Between its warm-up and its load, each REST run measures the same processes' CPU
time for ``--idle-s`` seconds with nothing in flight: what each costs a second whatever the
load, and that cost per token at the run's output rate. Repeats alternate the two systems.

Usage::

    python -m benchmarks.serving.overhead                  # 4.5-8 min on 2 cores (3 repeats)
    python -m benchmarks.serving.overhead --repeats 3 --requests 96
    python -m benchmarks.serving.overhead --concurrency 16 --requests 32 --output-len 256 \
        --repeats 2     # the web tier's CPU per streamed token at 16 streams
    python -m benchmarks.serving.overhead --requests 3 --warmup 1 --input-len 16 32 --output-len 4 \
        --concurrency 2 --repeats 1 --out-dir /tmp/overhead   # a quick check
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
from typing import Any

from benchmarks.harness.cli import HelpFormatter, add_out_dir_flag, non_negative_int, positive_int
from benchmarks.harness.common import (
    annotate_bars,
    cpu_seconds,
    exit_status,
    headroom,
    machine,
    make_engine,
    model_tokenizer,
    print_table,
    redis_server_pid,
    save_figure,
    warn_if_all_failed,
    write_json,
)
from benchmarks.harness.metrics import records, summarize
from benchmarks.harness.servers import Platform, TenantSpec
from benchmarks.harness.targets import EngineTarget, RestTarget, run_load
from benchmarks.harness.workload import PromptMaker, RequestSpec, random_requests


def workload(args: argparse.Namespace, maker: PromptMaker,
             count: int, seed: int) -> list[RequestSpec]:
    rng = random.Random(seed)
    return random_requests(maker, [0.0] * count, tuple(args.input_len),
                           (args.output_len, args.output_len), rng, tenant="bench")


async def drive(target: Any, args: argparse.Namespace, maker: PromptMaker,
                name: str, processes: dict[str, int], idle_s: float = 0.0
                ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The measured run's summary (with ``cpu_s``, CPU seconds per process during the measured
    run, and with ``idle_s`` ``idle_cpu_ms_per_s``: :func:`idle_cpu` between the warm-up and the
    run) and its per-request records (the warm-up is left out)."""
    await run_load(target, workload(args, maker, args.warmup, args.seed + 1),
                   max_concurrency=args.concurrency, desc=f"{name} warm-up")
    idle = await idle_cpu(processes, idle_s)
    before = cpu_seconds(processes)
    results, duration = await run_load(target, workload(args, maker, args.requests,
                                                        args.seed),
                                       max_concurrency=args.concurrency, desc=name)
    after = cpu_seconds(processes)
    summary = summarize(results, duration)
    summary["cpu_s"] = {k: round(after[k] - before[k], 2) for k in processes}
    summary["all_failed"] = warn_if_all_failed(results, name)
    if idle:
        summary["idle_cpu_ms_per_s"] = idle
    return summary, records(results)


async def run_engine(args: argparse.Namespace, maker: PromptMaker
                     ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    engine = make_engine(real_model=True, scheduling_policy="vtc")
    async with EngineTarget(engine) as target:
        return await drive(target, args, maker, "engine",
                           {"engine + client": os.getpid()})


async def run_rest(args: argparse.Namespace, maker: PromptMaker
                   ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    with Platform([TenantSpec("bench")], BACKEND="transformers") as platform:
        stack = platform.stack
        assert stack is not None
        processes = {"daphne": stack.others[0].pid, "celery": stack.others[1].pid,
                     "worker": stack.workers[0].pid, "client": os.getpid()}
        redis_pid = redis_server_pid()
        if redis_pid is not None:
            processes["redis"] = redis_pid
        async with RestTarget(platform.url, platform.keys) as target:
            return await drive(target, args, maker, "rest", processes, idle_s=args.idle_s)


async def idle_cpu(processes: dict[str, int], seconds: float) -> dict[str, float]:
    """Each process's CPU time per second (ms) over ``seconds`` with nothing in flight (the
    platform's timers and polls, and Redis's own; empty for 0): what it costs whatever the load."""
    if seconds <= 0:
        return {}
    await asyncio.sleep(1.0)  # the warm-up's last writes and usage records
    before = cpu_seconds(processes)
    await asyncio.sleep(seconds)
    after = cpu_seconds(processes)
    return {k: round(1000 * (after[k] - before[k]) / seconds, 2) for k in processes}


# The latency figures of the table and of the plot, (metric, statistic): the same in both.
LATENCY = (("ttft_ms", "mean"), ("ttft_ms", "p99"), ("tpot_ms", "mean"), ("itl_ms", "median"),
           ("itl_ms", "p99"))
SYSTEMS = ("engine", "rest")


def column(metric: str, stat: str) -> str:
    """The table's name of a latency figure, e.g. ``ttft_mean_ms`` or ``itl_p50_ms``."""
    return f"{metric[:-3]}_{'p50' if stat == 'median' else stat}_ms"


def compare(engine: dict[str, Any], rest: dict[str, Any]) -> dict[str, float]:
    """REST against the engine: the output-throughput ratio and the added mean latencies."""
    return {
        "throughput_ratio": rest["output_throughput"] / engine["output_throughput"],
        "added_ttft_ms": rest["ttft_ms"]["mean"] - engine["ttft_ms"]["mean"],
        "added_tpot_ms": rest["tpot_ms"]["mean"] - engine["tpot_ms"]["mean"],
        "added_itl_ms": rest["itl_ms"]["mean"] - engine["itl_ms"]["mean"],
        "added_e2el_ms": rest["e2el_ms"]["mean"] - engine["e2el_ms"]["mean"],
        # CPU time of the parts the engine alone does not have, over all CPU time of the run.
        "platform_cpu_share": platform_cpu(rest) / (sum(rest.get("cpu_s", {}).values()) or 1),
    }


# The web tier's CPU time per streamed token the platform aims at (daphne + Redis + Celery, ms).
WEB_TIER_MS_PER_TOKEN = 0.1


def cpu_ms_per_token(summary: dict[str, Any]) -> dict[str, float]:
    """Each process's CPU time per output token of a run (ms), and ``web tier`` (daphne +
    Redis + Celery) beside them; empty without ``cpu_s`` or tokens."""
    tokens = summary.get("total_output_tokens") or 0
    cpu = summary.get("cpu_s") or {}
    if not tokens or not cpu:
        return {}
    out = {k: 1000 * v / tokens for k, v in cpu.items()}
    out["web tier"] = 1000 * platform_cpu(summary) / tokens
    return out


def platform_cpu(summary: dict[str, Any]) -> float:
    """CPU seconds of daphne, Celery and Redis in a REST run's summary (0 without ``cpu_s``)."""
    return sum(v for k, v in summary.get("cpu_s", {}).items() if k in ("daphne", "celery", "redis"))


def plot(runs: list[dict[str, Any]], overall: dict[str, float],
         out_dir: str | None = None) -> None:
    """Throughput per repeat, and the table's latency figures (TTFT, then the per-token ones on
    their own scale): bars at the median over repeats, labelled with it, a dot per repeat."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2), layout="constrained",
                             width_ratios=[len(runs) + 0.5, 2, 3])
    colors = {"engine": "tab:blue", "rest": "tab:orange"}
    names = {"engine": "engine in-process", "rest": "REST + Redis + worker"}
    ax1 = axes[0]
    for j, system in enumerate(SYSTEMS):
        vals = [r[system]["output_throughput"] for r in runs]
        bars = ax1.bar([i + 0.4 * j - 0.2 for i in range(len(runs))], vals, width=0.4,
                       color=colors[system], label=names[system])
        annotate_bars(ax1, bars, [f"{v:.1f}" for v in vals])
    ax1.set_xticks(range(len(runs)), [f"repeat {i + 1}" for i in range(len(runs))])
    ax1.set_ylabel("output tokens/s")
    ax1.set_title(f"Throughput\n(REST / engine, median: {overall['throughput_ratio']:.2f})",
                  fontsize=10)
    headroom(ax1)
    panels = ((axes[1], LATENCY[:2], "TTFT"), (axes[2], LATENCY[2:], "Per-token"))
    for ax, metrics, title in panels:
        for j, system in enumerate(SYSTEMS):
            xs = [i + 0.4 * j - 0.2 for i in range(len(metrics))]
            vals = [statistics.median(r[system][m][s] for r in runs) for m, s in metrics]
            each = [[r[system][m][s] for r in runs] for m, s in metrics]
            bars = ax.bar(xs, vals, width=0.4, color=colors[system])
            annotate_bars(ax, bars, [f"{v:,.0f}" if v >= 100 else f"{v:.1f}" for v in vals],
                          tops=[max(v, *e) for v, e in zip(vals, each, strict=True)])
            for x, values in zip(xs, each, strict=True):
                ax.plot([x] * len(values), values, "o", ms=3, color="black",
                        label="each repeat" if x == xs[0] and j == 0 else None)
        ax.set_xticks(range(len(metrics)),
                      [f"{m[:-3].upper()} {'p50' if s == 'median' else s}" for m, s in metrics])
        ax.set_ylabel("ms")
        ax.set_title(f"{title} latency (bars: median over repeats)", fontsize=10)
        headroom(ax)
    handles, labels = ax1.get_legend_handles_labels()
    extra, extra_labels = axes[1].get_legend_handles_labels()
    fig.legend(handles + extra, labels + extra_labels, loc="outside upper center", ncol=3,
               fontsize=9)
    save_figure(fig, "overhead", out_dir)


def add_workload_flags(parser: argparse.ArgumentParser) -> None:
    """The workload's flags (``--requests``, ``--warmup``, ``--input-len``, ``--output-len``,
    ``--concurrency``), shared with ``benchmarks/serving/cpu_contention.py``."""
    parser.add_argument("--requests", type=positive_int, default=48,
                        help="measured requests per run")
    parser.add_argument("--warmup", type=non_negative_int, default=4,
                        help="warm-up requests before each measured run")
    parser.add_argument("--input-len", type=int, nargs=2, default=(64, 192),
                        metavar=("MIN", "MAX"), help="prompt tokens")
    parser.add_argument("--output-len", type=int, default=64, help="generated tokens")
    parser.add_argument("--concurrency", type=positive_int, default=8,
                        help="requests in flight")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=HelpFormatter)
    add_workload_flags(parser)
    parser.add_argument("--repeats", type=positive_int, default=3,
                        help="repeats of each system, alternating which goes first")
    parser.add_argument("--seed", type=int, default=6, help="workload seed")
    parser.add_argument("--idle-s", type=float, default=10.0,
                        help="seconds each REST run measures the processes' CPU time with "
                             "nothing in flight, between its warm-up and its load (0: not "
                             "measured)")
    add_out_dir_flag(parser)
    args = parser.parse_args(argv)
    before = machine()
    maker = PromptMaker(model_tokenizer(), seed=args.seed)
    runs = []
    for i in range(args.repeats):
        order = ("engine", "rest") if i % 2 == 0 else ("rest", "engine")
        run: dict[str, Any] = {"order": order}
        for system in order:
            fn = run_engine if system == "engine" else run_rest
            run[system], run[f"{system}_results"] = asyncio.run(fn(args, maker))
            run[f"{system}_loadavg"] = machine()["loadavg"]
        run.update(compare(run["engine"], run["rest"]))
        runs.append(run)
    overall = {k: statistics.median(r[k] for r in runs) for k in compare(runs[0]["engine"],
                                                                         runs[0]["rest"])}
    plot(runs, overall, args.out_dir)
    rows = []
    for i, run in enumerate(runs):
        for system in SYSTEMS:
            s = run[system]
            rows.append({"repeat": i + 1, "system": system, "req/s": s["request_throughput"],
                         "out_tok/s": s["output_throughput"],
                         **{column(m, st): s[m][st] for m, st in LATENCY},
                         "errors": s["errors"]})
    print_table(rows, list(rows[0]))
    print("CPU seconds during the measured run, per process:")
    for i, run in enumerate(runs):
        for system in SYSTEMS:
            cpu = run[system]["cpu_s"]
            share = (f"; daphne + Celery + Redis {run['platform_cpu_share']:.1%} of all"
                     if system == "rest" else "")
            print(f"  repeat {i + 1} {system:6}: "
                  + ", ".join(f"{k} {v:.1f}" for k, v in cpu.items()) + share)
    print("CPU ms per streamed token (REST), per process:")
    for i, run in enumerate(runs):
        per_token = run["rest_cpu_ms_per_token"] = cpu_ms_per_token(run["rest"])
        print(f"  repeat {i + 1}: " + ", ".join(f"{k} {v:.3f}" for k, v in per_token.items())
              + f" (web tier target {WEB_TIER_MS_PER_TOKEN}; throughput ratio "
              f"{run['throughput_ratio']:.3f})")
    for i, run in enumerate(runs):
        idle = run["rest"].get("idle_cpu_ms_per_s") or {}
        if idle:
            rate = run["rest"]["output_throughput"] or 1
            web = sum(v for k, v in idle.items() if k in ("daphne", "celery", "redis"))
            print(f"  repeat {i + 1} at idle, CPU ms per second: "
                  + ", ".join(f"{k} {v:.2f}" for k, v in idle.items())
                  + f"; the web tier's {web:.2f} ms/s is {web / rate:.3f} ms a token at this "
                  f"run's {rate:.0f} tok/s")
    print("median over repeats: " + ", ".join(f"{k} {v:.3g}" for k, v in overall.items())
          + " (added_*: REST minus engine, of the means)")
    path = write_json("overhead", {"args": vars(args), "machine_before": before, "runs": runs,
                                   "overall": overall}, args.out_dir)
    print(f"wrote {path}")
    return exit_status([f"repeat {i + 1} {system}" for i, run in enumerate(runs)
                        for system in SYSTEMS if run[system]["all_failed"]])


if __name__ == "__main__":
    raise SystemExit(main())
