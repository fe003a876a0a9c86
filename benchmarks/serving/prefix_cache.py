"""Experiment 4: prefix caching on against off, on a shared-prefix workload.

On the real default model, in-process. One tenant sends ``--requests`` prompts made of one of
``--prefixes`` shared prefixes (``--prefix-len`` tokens: a long system prompt or document) and a
unique suffix (``--suffix-len`` tokens), ``--output-len`` tokens each, at a fixed concurrency
(closed loop). Measured with ``ENABLE_PREFIX_CACHING`` true and false: the prefix hit rate (the
engine's ``prefix_hit_rate``, and the prompt tokens each request got from the cache), TTFT, and
request and token throughput.

Usage::

    python -m benchmarks.serving.prefix_cache                     # ~1 min on 2 cores
    python -m benchmarks.serving.prefix_cache --requests 96 --prefix-len 1024
    python -m benchmarks.serving.prefix_cache --requests 4 --prefixes 2 --prefix-len 64 \
        --suffix-len 8 --output-len 4 --concurrency 2 --out-dir /tmp/prefix_cache   # a quick check
"""

from __future__ import annotations

import argparse
import asyncio
import random
from typing import Any

from benchmarks.harness.cli import HelpFormatter, add_out_dir_flag, positive_int
from benchmarks.harness.common import (
    annotate_bars,
    exit_status,
    headroom,
    legend_outside,
    machine,
    make_engine,
    model_tokenizer,
    ms_log_axis,
    print_table,
    save_figure,
    warn_if_all_failed,
    write_json,
)
from benchmarks.harness.metrics import records, summarize
from benchmarks.harness.targets import EngineTarget, run_load
from benchmarks.harness.workload import PromptMaker, shared_prefix_requests


async def run_one(enabled: bool, args: argparse.Namespace, tokenizer: Any) -> dict[str, Any]:
    rng = random.Random(args.seed)
    maker = PromptMaker(tokenizer, seed=args.seed)
    specs = shared_prefix_requests(maker, [0.0] * args.requests, args.prefixes,
                                   args.prefix_len, args.suffix_len, args.output_len, rng,
                                   tenant="docs")
    engine = make_engine(real_model=True, enable_prefix_caching=enabled,
                         max_batch_size=args.concurrency, kv_num_blocks=1024, max_pending=1000)
    async with EngineTarget(engine) as target:
        results, duration = await run_load(target, specs,
                                           max_concurrency=args.concurrency,
                                           desc=f"cache {'on' if enabled else 'off'}")
        stats = engine.stats()
    summary = summarize(results, duration)
    return {
        "prefix_caching": enabled, "summary": summary,
        "all_failed": warn_if_all_failed(results, f"cache {'on' if enabled else 'off'}"),
        "prefix_hit_rate": stats["prefix_hit_rate"],
        "prefix_hit_tokens": stats["prefix_hit_tokens"],
        "prefix_queried_tokens": stats["prefix_queried_tokens"],
        "prompt_tokens_computed": stats["prompt_tokens_computed"],
        "ttft": [{"i": i, "ttft_s": r.ttft_s, "cached": r.cached_prompt_tokens}
                 for i, r in enumerate(results) if r.ttft_s is not None],
        "results": records(results),
    }


# The bar panels: (key of the run or of its summary, title, format of the value on each bar).
BAR_PANELS = (("prompt_tokens_computed", "Prompt tokens computed", "{:,.0f}"),
              ("request_throughput", "Requests/s", "{:.2f}"),
              ("output_throughput", "Output tokens/s", "{:.1f}"),
              ("total_token_throughput", "Total tokens/s", "{:.0f}"))


def plot(runs: list[dict[str, Any]], out_dir: str | None = None) -> None:
    """TTFT's distribution per setting (top), and one bar panel per figure of the table, each
    on its own scale and labelled with its values (bottom)."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplot_mosaic([["cdf"] * len(BAR_PANELS), [m for m, _, _ in BAR_PANELS]],
                                   figsize=(11, 7), layout="constrained",
                                   height_ratios=[1.1, 1])
    labels = ["on" if r["prefix_caching"] else "off" for r in runs]
    colors = {"off": "tab:blue", "on": "tab:orange"}
    ax1 = axes["cdf"]
    for run, label in zip(runs, labels, strict=True):
        ttft = sorted(p["ttft_s"] * 1000 for p in run["ttft"])
        if not ttft:
            continue
        ax1.step([ttft[0], *ttft], [0.0, *((i + 1) / len(ttft) for i in range(len(ttft)))],
                 where="post",
                 color=colors[label],
                 label=f"prefix cache {label} (hit rate {run['prefix_hit_rate']:.0%})")
    ax1.set_xscale("log")
    ms_log_axis(ax1.xaxis)
    ax1.set_xlabel("TTFT (log scale)")
    ax1.set_ylabel("fraction of requests")
    ax1.set_ylim(0, 1.05)
    ax1.set_title("TTFT distribution (cumulative)")
    legend_outside(ax1)
    ticks = [f"cache {label}" for label in labels]
    for key, title, fmt in BAR_PANELS:
        ax = axes[key]
        vals = [r[key] if key in r else r["summary"][key] for r in runs]
        bars = ax.bar(range(len(runs)), vals, width=0.6, color=[colors[x] for x in labels])
        annotate_bars(ax, bars, [fmt.format(v) for v in vals], fontsize=9)
        ax.set_xticks(range(len(runs)), ticks)
        ax.set_title(title, fontsize=10)
        headroom(ax)
    save_figure(fig, "prefix_cache", out_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=HelpFormatter)
    pos = positive_int
    parser.add_argument("--requests", type=pos, default=32, help="requests per setting")
    parser.add_argument("--prefixes", type=pos, default=4, help="distinct shared prefixes")
    parser.add_argument("--prefix-len", type=pos, default=512, help="tokens")
    parser.add_argument("--suffix-len", type=pos, default=32, help="tokens")
    parser.add_argument("--output-len", type=pos, default=32, help="tokens")
    parser.add_argument("--concurrency", type=pos, default=8,
                        help="requests in flight (and MAX_BATCH_SIZE)")
    parser.add_argument("--seed", type=int, default=4, help="workload seed")
    add_out_dir_flag(parser)
    args = parser.parse_args(argv)
    before = machine()
    tokenizer = model_tokenizer()
    runs = [asyncio.run(run_one(enabled, args, tokenizer)) for enabled in (False, True)]
    plot(runs, args.out_dir)
    print_table([{"prefix_cache": "on" if r["prefix_caching"] else "off",
                  "hit_rate": f"{r['prefix_hit_rate']:.1%}",
                  "prompt_computed": r["prompt_tokens_computed"],
                  "ttft_p50_ms": r["summary"]["ttft_ms"]["median"],
                  "ttft_p99_ms": r["summary"]["ttft_ms"]["p99"],
                  "req/s": r["summary"]["request_throughput"],
                  "out_tok/s": r["summary"]["output_throughput"],
                  "total_tok/s": r["summary"]["total_token_throughput"]} for r in runs],
                ["prefix_cache", "hit_rate", "prompt_computed", "ttft_p50_ms", "ttft_p99_ms",
                 "req/s", "out_tok/s", "total_tok/s"])
    path = write_json("prefix_cache", {"args": vars(args), "machine_before": before,
                                       "runs": runs}, args.out_dir)
    print(f"wrote {path}")
    return exit_status([f"cache {'on' if r['prefix_caching'] else 'off'}"
                        for r in runs if r["all_failed"]])


if __name__ == "__main__":
    raise SystemExit(main())
