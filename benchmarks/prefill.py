"""Experiment 3: chunked against monolithic prefill while prompts of 2,000-4,000 tokens arrive.

On the real default model, in-process (the engine on its worker thread). A few long-running
streams decode from the start (``stream``); prompts of ``--long-lens`` tokens arrive every
``--long-every`` seconds (``long``); short requests arrive every ``--short-every`` seconds
(``short``). The run ends when every long and short request has ended (the streams are then
cancelled). Measured: the streams' ITL (every gap between two of their tokens: a monolithic
prefill of a long prompt stalls them for its whole duration, a chunked one for one chunk per
tick) and the short requests' TTFT, under ``PREFILL_MODE=monolithic``, ``chunked`` (``--chunk``
tokens per chunk, the platform's default 256) and ``chunked:64`` (``chunked:N``: N per chunk).

Usage::

    python -m benchmarks.prefill                       # ~3 min on 2 cores (3 modes)
    python -m benchmarks.prefill --long-lens 2000,3000,4000,4000,2500 --streams 8
    python -m benchmarks.prefill --long-lens 96,160 --long-every 2 --warmup 1 --streams 2 \
        --stream-tokens 200 --modes monolithic,chunked:32 --out-dir /tmp/prefill  # a quick check
"""

from __future__ import annotations

import argparse
import asyncio
import random
from typing import Any

from benchmarks.cli import HelpFormatter, add_out_dir_flag
from benchmarks.common import (
    exit_status,
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
from benchmarks.metrics import describe_ms, records, summarize_by
from benchmarks.targets import EngineTarget, run_load
from benchmarks.workload import PromptMaker, RequestSpec, merge

MODES = ("monolithic", "chunked", "chunked:64")


def workload(args: argparse.Namespace, maker: PromptMaker) -> list[RequestSpec]:
    rng = random.Random(args.seed)
    specs = [RequestSpec(maker.make(64, rng), args.stream_tokens, "streams", 0.0, 64,
                         "stream") for _ in range(args.streams)]
    lens = [int(x) for x in args.long_lens.split(",")]
    first = args.warmup
    for i, n in enumerate(lens):
        specs.append(RequestSpec(maker.make(n, rng), 8, "long", first + i * args.long_every,
                                 n, "long"))
    end = first + len(lens) * args.long_every
    t = args.short_every / 2
    while t < end:
        specs.append(RequestSpec(maker.make(32, rng), 8, "short", t, 32, "short"))
        t += args.short_every
    return merge(specs)


async def run_mode(mode: str, args: argparse.Namespace, tokenizer: Any) -> dict[str, Any]:
    maker = PromptMaker(tokenizer, seed=args.seed)
    specs = workload(args, maker)
    name, _, chunk = mode.partition(":")
    settings = {"prefill_mode": name, "prefill_chunk_size": int(chunk or args.chunk)}
    engine = make_engine(real_model=True, max_batch_size=args.batch, kv_num_blocks=1024,
                         max_pending=1000, **settings)
    async with EngineTarget(engine) as target:
        results, duration = await run_load(target, specs, desc=mode,
                                           background_tags={"stream"})
    streams = [r for r in results if r.tag == "stream"]
    itl = [g for r in streams for g in r.itls_s]
    summary = summarize_by([r for r in results if r.tag != "stream"], lambda r: r.tag,
                           duration)
    return {
        "mode": mode, "settings": settings, "duration_s": duration,
        "all_failed": warn_if_all_failed(results, mode),
        "stream_tokens": sum(len(r.chunk_times_s) for r in streams),
        "stream_itl_ms": {**describe_ms(itl), "max": max(itl, default=0) * 1000},
        "short_ttft_ms": summary.get("short", {}).get("ttft_ms"),
        "long_ttft_ms": summary.get("long", {}).get("ttft_ms"),
        "long_arrivals_s": [r.sent_s for r in results if r.tag == "long"],
        "stream_gaps": [{"t": b, "itl_s": b - a} for r in streams
                        for a, b in zip(r.chunk_times_s, r.chunk_times_s[1:], strict=False)],
        "short_ttft": [{"sent_s": r.sent_s, "ttft_s": r.ttft_s} for r in results
                       if r.tag == "short" and r.ttft_s is not None],
        "per_tag": summary,
        "results": records(results),
    }


def plot(runs: list[dict[str, Any]], out_dir: str | None = None) -> None:
    """The streams' gaps between tokens and the short requests' TTFT over time, one colour per
    mode; dotted lines where a long prompt arrives; legends to the right of the axes."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    fig, axes = plt.subplots(2, 1, figsize=(11.5, 6.5), sharex=True, layout="constrained")
    palette = ["tab:red", "tab:blue", "tab:green", "tab:purple", "tab:orange"]
    for i, run in enumerate(runs):
        c = palette[i % len(palette)]
        axes[0].scatter([g["t"] for g in run["stream_gaps"]],
                        [g["itl_s"] * 1000 for g in run["stream_gaps"]], s=4, color=c,
                        label=run["mode"])
        axes[1].plot([p["sent_s"] for p in run["short_ttft"]],
                     [p["ttft_s"] * 1000 for p in run["short_ttft"]], "o-", ms=3, color=c,
                     label=run["mode"])
    for t in runs[0]["long_arrivals_s"]:
        for ax in axes:
            ax.axvline(t, color="gray", ls=":", lw=1)
    arrival = Line2D([], [], color="gray", ls=":", lw=1, label="a long prompt arrives")
    for ax in axes:
        ax.set_yscale("log")
        ms_log_axis(ax.yaxis)
    axes[0].set_ylabel("streams' ITL (log scale)")
    axes[0].set_title("Running streams' inter-token latency (every gap between two tokens)")
    handles, _ = axes[0].get_legend_handles_labels()
    legend_outside(axes[0], handles=[*handles, arrival], markerscale=3)
    axes[1].set_ylabel("short requests' TTFT (log scale)")
    axes[1].set_title("Short requests' TTFT, by send time")
    axes[1].set_xlabel("time since the start of the run (s)")
    handles, _ = axes[1].get_legend_handles_labels()
    legend_outside(axes[1], handles=[*handles, arrival])
    save_figure(fig, "prefill", out_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=HelpFormatter)
    parser.add_argument("--long-lens", default="2000,4000,3000",
                        help="prompt tokens of the long requests, in order of arrival")
    parser.add_argument("--long-every", type=float, default=12, help="seconds between them")
    parser.add_argument("--warmup", type=float, default=4,
                        help="seconds of plain decoding before the first long prompt")
    parser.add_argument("--short-every", type=float, default=1.0, help="seconds")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--stream-tokens", type=int, default=2000,
                        help="max_tokens of a stream (cancelled at the end anyway)")
    parser.add_argument("--chunk", type=int, default=256, help="PREFILL_CHUNK_SIZE (tokens)")
    parser.add_argument("--batch", type=int, default=16, help="MAX_BATCH_SIZE")
    parser.add_argument("--modes", default=",".join(MODES),
                        help="monolithic, chunked (--chunk tokens) or chunked:N")
    parser.add_argument("--seed", type=int, default=3)
    add_out_dir_flag(parser)
    args = parser.parse_args(argv)
    before = machine()
    tokenizer = model_tokenizer()
    runs = [asyncio.run(run_mode(mode, args, tokenizer)) for mode in args.modes.split(",")]
    plot(runs, args.out_dir)
    print_table([{"mode": r["mode"], "itl_p50_ms": r["stream_itl_ms"]["median"],
                  "itl_p99_ms": r["stream_itl_ms"]["p99"], "itl_max_ms": r["stream_itl_ms"]["max"],
                  "short_ttft_p50_ms": (r["short_ttft_ms"] or {}).get("median"),
                  "short_ttft_p99_ms": (r["short_ttft_ms"] or {}).get("p99"),
                  "long_ttft_mean_ms": (r["long_ttft_ms"] or {}).get("mean")} for r in runs],
                ["mode", "itl_p50_ms", "itl_p99_ms", "itl_max_ms", "short_ttft_p50_ms",
                 "short_ttft_p99_ms", "long_ttft_mean_ms"])
    path = write_json("prefill", {"args": vars(args), "machine_before": before, "runs": runs},
                      args.out_dir)
    print(f"wrote {path}")
    return exit_status([r["mode"] for r in runs if r["all_failed"]])


if __name__ == "__main__":
    raise SystemExit(main())
