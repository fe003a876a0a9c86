"""Experiment 6: platform overhead: REST + Redis + worker against the engine in-process.

The same workload on the real default model, with the worker's default engine settings (VTC,
``MAX_BATCH_SIZE`` 32, chunked prefill): ``--requests`` requests of ``--input-len`` prompt tokens
and exactly ``--output-len`` generated tokens (EOS ignored), ``--concurrency`` in flight (closed
loop), sent

* ``engine``: to :class:`inference.engine.LLMEngine` in this process (token times taken when
  each tick ends; no HTTP, no Redis);
* ``rest``: to ``POST /v1/completions`` (streamed) of daphne, through Redis to one inference
  worker process, with Celery recording usage (token times taken when the client reads each
  SSE chunk).

Both are warmed up first with ``--warmup`` requests. Reported: the throughput ratio (REST output
tokens/s over the engine's; target at least 0.9), and the latency the platform adds: TTFT, TPOT
and ITL differences (ms). Repeats alternate the two systems.

Usage::

    python -m benchmarks.overhead                  # ~3.5 min on 2 cores (2 repeats)
    python -m benchmarks.overhead --repeats 3 --requests 96
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
from typing import Any

from benchmarks import loadgen
from benchmarks.common import (
    machine,
    make_engine,
    model_tokenizer,
    print_table,
    save_figure,
    write_json,
)
from benchmarks.servers import Platform, TenantSpec


def workload(args: argparse.Namespace, maker: loadgen.PromptMaker,
             count: int, seed: int) -> list[loadgen.RequestSpec]:
    rng = random.Random(seed)
    return loadgen.random_requests(maker, [0.0] * count, tuple(args.input_len),
                                   (args.output_len, args.output_len), rng, tenant="bench")


async def drive(target: Any, args: argparse.Namespace, maker: loadgen.PromptMaker,
                name: str) -> dict[str, Any]:
    await loadgen.run_load(target, workload(args, maker, args.warmup, args.seed + 1),
                           max_concurrency=args.concurrency, desc=f"{name} warm-up")
    results, duration = await loadgen.run_load(target, workload(args, maker, args.requests,
                                                                args.seed),
                                               max_concurrency=args.concurrency, desc=name)
    return loadgen.summarize(results, duration)


async def run_engine(args: argparse.Namespace, maker: loadgen.PromptMaker) -> dict[str, Any]:
    engine = make_engine(real_model=True, scheduling_policy="vtc")
    async with loadgen.EngineTarget(engine) as target:
        return await drive(target, args, maker, "engine")


async def run_rest(args: argparse.Namespace, maker: loadgen.PromptMaker) -> dict[str, Any]:
    with Platform([TenantSpec("bench")], BACKEND="transformers") as platform:
        async with loadgen.RestTarget(platform.url, platform.keys) as target:
            return await drive(target, args, maker, "rest")


def compare(engine: dict[str, Any], rest: dict[str, Any]) -> dict[str, float]:
    return {
        "throughput_ratio": rest["output_throughput"] / engine["output_throughput"],
        "added_ttft_ms": rest["ttft_ms"]["mean"] - engine["ttft_ms"]["mean"],
        "added_tpot_ms": rest["tpot_ms"]["mean"] - engine["tpot_ms"]["mean"],
        "added_itl_ms": rest["itl_ms"]["mean"] - engine["itl_ms"]["mean"],
        "added_e2el_ms": rest["e2el_ms"]["mean"] - engine["e2el_ms"]["mean"],
    }


def plot(runs: list[dict[str, Any]], overall: dict[str, float]) -> None:
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    systems = ("engine", "rest")
    for j, system in enumerate(systems):
        vals = [r[system]["output_throughput"] for r in runs]
        ax1.bar([i + 0.4 * j - 0.2 for i in range(len(runs))], vals, width=0.4, label=system)
    ax1.set_xticks(range(len(runs)), [f"repeat {i + 1}" for i in range(len(runs))])
    ax1.set_ylabel("output tokens/s")
    ax1.set_title(f"Throughput (REST / engine = {overall['throughput_ratio']:.2f})")
    ax1.legend()
    metrics = [("ttft_ms", "median"), ("ttft_ms", "p99"), ("tpot_ms", "median"),
               ("itl_ms", "median"), ("itl_ms", "p99")]
    for j, system in enumerate(systems):
        vals = [statistics.median(r[system][m][s] for r in runs) for m, s in metrics]
        ax2.bar([i + 0.4 * j - 0.2 for i in range(len(metrics))], vals, width=0.4,
                label=system)
    ax2.set_xticks(range(len(metrics)), [f"{m[:-3]} {s}" for m, s in metrics])
    ax2.set_yscale("log")
    ax2.set_ylabel("ms (log)")
    ax2.set_title("Latency (median over repeats)")
    ax2.legend()
    fig.tight_layout()
    save_figure(fig, "overhead")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--input-len", type=int, nargs=2, default=(64, 192),
                        metavar=("MIN", "MAX"), help="prompt tokens")
    parser.add_argument("--output-len", type=int, default=64, help="generated tokens")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=6)
    args = parser.parse_args(argv)
    before = machine()
    maker = loadgen.PromptMaker(model_tokenizer(), seed=args.seed)
    runs = []
    for i in range(args.repeats):
        order = ("engine", "rest") if i % 2 == 0 else ("rest", "engine")
        run: dict[str, Any] = {"order": order}
        for system in order:
            fn = run_engine if system == "engine" else run_rest
            run[system] = asyncio.run(fn(args, maker))
            run[f"{system}_loadavg"] = machine()["loadavg"]
        run.update(compare(run["engine"], run["rest"]))
        runs.append(run)
    overall = {k: statistics.median(r[k] for r in runs) for k in compare(runs[0]["engine"],
                                                                         runs[0]["rest"])}
    plot(runs, overall)
    rows = []
    for i, run in enumerate(runs):
        for system in ("engine", "rest"):
            s = run[system]
            rows.append({"repeat": i + 1, "system": system, "req/s": s["request_throughput"],
                         "out_tok/s": s["output_throughput"],
                         "ttft_p50_ms": s["ttft_ms"]["median"], "ttft_p99_ms": s["ttft_ms"]["p99"],
                         "tpot_mean_ms": s["tpot_ms"]["mean"], "itl_p50_ms": s["itl_ms"]["median"],
                         "itl_p99_ms": s["itl_ms"]["p99"], "errors": s["errors"]})
    print_table(rows, list(rows[0]))
    print(", ".join(f"{k} {v:.3g}" for k, v in overall.items()))
    path = write_json("overhead", {"args": vars(args), "machine_before": before, "runs": runs,
                                   "overall": overall})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
