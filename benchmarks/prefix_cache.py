"""Experiment 4: prefix caching on against off, on a shared-prefix workload.

On the real default model, in-process. One tenant sends ``--requests`` prompts made of one of
``--prefixes`` shared prefixes (``--prefix-len`` tokens: a long system prompt or document) and a
unique suffix (``--suffix-len`` tokens), ``--output-len`` tokens each, at a fixed concurrency
(closed loop). Measured with ``ENABLE_PREFIX_CACHING`` true and false: the prefix hit rate (the
engine's ``prefix_hit_rate``, and the prompt tokens each request got from the cache), TTFT, and
request and token throughput.

Usage::

    python -m benchmarks.prefix_cache                     # ~1 min on 2 cores
    python -m benchmarks.prefix_cache --requests 96 --prefix-len 1024
"""

from __future__ import annotations

import argparse
import asyncio
import random
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


async def run_one(enabled: bool, args: argparse.Namespace, tokenizer: Any) -> dict[str, Any]:
    rng = random.Random(args.seed)
    maker = loadgen.PromptMaker(tokenizer, seed=args.seed)
    specs = loadgen.shared_prefix_requests(maker, [0.0] * args.requests, args.prefixes,
                                           args.prefix_len, args.suffix_len, args.output_len, rng,
                                           tenant="docs")
    engine = make_engine(real_model=True, enable_prefix_caching=enabled,
                         max_batch_size=args.concurrency, kv_num_blocks=1024, max_queue_size=1000)
    async with loadgen.EngineTarget(engine) as target:
        results, duration = await loadgen.run_load(target, specs,
                                                   max_concurrency=args.concurrency,
                                                   desc=f"prefix cache {int(enabled)}")
        stats = engine.stats()
    summary = loadgen.summarize(results, duration)
    return {
        "prefix_caching": enabled, "summary": summary,
        "prefix_hit_rate": stats["prefix_hit_rate"],
        "prefix_hit_tokens": stats["prefix_hit_tokens"],
        "prefix_queried_tokens": stats["prefix_queried_tokens"],
        "prompt_tokens_computed": stats["prompt_tokens_computed"],
        "ttft": [{"i": i, "ttft_s": r.ttft_s, "cached": r.cached_prompt_tokens}
                 for i, r in enumerate(results) if r.ttft_s is not None],
    }


def plot(runs: list[dict[str, Any]]) -> None:
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    labels = ["on" if r["prefix_caching"] else "off" for r in runs]
    for run, label in zip(runs, labels, strict=True):
        ttft = sorted(p["ttft_s"] * 1000 for p in run["ttft"])
        ax1.plot(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))],
                 label=f"prefix cache {label}")
    ax1.set_xscale("log")
    ax1.set_xlabel("TTFT (ms, log)")
    ax1.set_ylabel("fraction of requests")
    ax1.set_title("TTFT distribution")
    ax1.legend()
    metrics = [("request_throughput", "requests/s"), ("output_throughput", "output tok/s / 10"),
               ("total_token_throughput", "total tok/s / 100")]
    scale = {"request_throughput": 1, "output_throughput": 10, "total_token_throughput": 100}
    for j, (run, label) in enumerate(zip(runs, labels, strict=True)):
        vals = [run["summary"][m] / scale[m] for m, _ in metrics]
        ax2.bar([i + 0.4 * j - 0.2 for i in range(len(metrics))], vals, width=0.4,
                label=f"prefix cache {label} (hit rate {run['prefix_hit_rate']:.0%})")
    ax2.set_xticks(range(len(metrics)), [name for _, name in metrics])
    ax2.set_title("Throughput")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, "prefix_cache")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    pos = loadgen.positive_int
    parser.add_argument("--requests", type=pos, default=32)
    parser.add_argument("--prefixes", type=pos, default=4, help="distinct shared prefixes")
    parser.add_argument("--prefix-len", type=pos, default=512, help="tokens")
    parser.add_argument("--suffix-len", type=pos, default=32, help="tokens")
    parser.add_argument("--output-len", type=pos, default=32, help="tokens")
    parser.add_argument("--concurrency", type=pos, default=8)
    parser.add_argument("--seed", type=int, default=4)
    args = parser.parse_args(argv)
    before = machine()
    tokenizer = model_tokenizer()
    runs = [asyncio.run(run_one(enabled, args, tokenizer)) for enabled in (False, True)]
    plot(runs)
    print_table([{"prefix_cache": "on" if r["prefix_caching"] else "off",
                  "hit_rate": r["prefix_hit_rate"],
                  "prompt_computed": r["prompt_tokens_computed"],
                  "ttft_p50_ms": r["summary"]["ttft_ms"]["median"],
                  "ttft_p99_ms": r["summary"]["ttft_ms"]["p99"],
                  "req/s": r["summary"]["request_throughput"],
                  "out_tok/s": r["summary"]["output_throughput"],
                  "total_tok/s": r["summary"]["total_token_throughput"]} for r in runs],
                ["prefix_cache", "hit_rate", "prompt_computed", "ttft_p50_ms", "ttft_p99_ms",
                 "req/s", "out_tok/s", "total_tok/s"])
    path = write_json("prefix_cache", {"args": vars(args), "machine_before": before,
                                       "runs": runs})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
