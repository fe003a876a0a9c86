"""Experiment 3: prefill modes while prompts of 2,000-4,000 tokens arrive beside running streams.

On the real default model, in-process (the engine on its worker thread). A few long-running
streams decode from the start (``stream``); prompts of ``--long-lens`` tokens arrive every
``--long-every`` seconds (``long``); short requests arrive every ``--short-every`` seconds
(``short``). The run ends when every long and short request has ended (the streams are then
cancelled). Measured: the streams' ITL (every gap between two of their tokens: a monolithic
prefill of a long prompt stalls them for its whole duration, a chunked one for one chunk per
tick), the short requests' TTFT and the long prompts' mean TTFT, in each mode.

Modes (``--modes``, comma-separated; the default runs the first three):

* ``default``: the engine's defaults (no prefill mode or chunk size set);
* ``control``: the same defaults on the workload without the long prompts (streams and short
  requests only): the streams' ITL when nothing long is prefilled;
* ``chunked:N``: ``PREFILL_MODE=chunked`` with ``N``-token chunks (``chunked`` alone: ``--chunk``);
* ``monolithic``: each prompt in one pass;
* ``mixed_batch`` or ``mixed_batch:N``: ``PREFILL_MODE=mixed_batch`` (decode rows ride in the
  prefill chunk's forward pass), ``N`` the chunk cap in tokens (alone: the engine's default);
* ``itl:MS``: ``TARGET_ITL_MS`` (milliseconds per tick while streams run; 0: none) on top
  of the engine's defaults.

Terms combine with ``+``: ``mixed_batch:512+itl:80``, ``control+chunked:64``. Every mode's
settings are checked before the first run (an unknown or unimplemented one fails at once); the
grammar and each mode's engine settings are in :mod:`benchmarks.serving.prefill_modes`.

After the table, a verdict (printed, not asserted): the streams' ITL p99 under ``default``
against 3 times their ITL p50 under ``control``, and the long prompts' mean TTFT under
``default`` against ``chunked:256``'s; each PASS, MISS or n/a (a mode not run).

Usage::

    python -m benchmarks.serving.prefill                       # ~3 min on 2 cores (3 modes)
    python -m benchmarks.serving.prefill --modes default,control,chunked:256,monolithic,chunked:64
    python -m benchmarks.serving.prefill --long-lens 2000,3000,4000,4000,2500 --streams 8
    python -m benchmarks.serving.prefill --long-lens 96,160 --long-every 2 --warmup 1 --streams 2 \\
        --stream-tokens 100 --modes control,chunked:32 --out-dir /tmp/prefill  # a quick check
"""

from __future__ import annotations

import argparse
import asyncio
import random
from typing import Any

from benchmarks.harness.cli import HelpFormatter, add_out_dir_flag, positive_float, positive_int
from benchmarks.harness.common import (
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
from benchmarks.harness.metrics import describe_ms, records, summarize_by
from benchmarks.harness.targets import EngineTarget, run_load
from benchmarks.harness.workload import PromptMaker, RequestSpec, merge
from benchmarks.serving.prefill_modes import Mode, check_modes, engine_settings, mode_list

MODES = ("default", "control", "chunked:256")
# The verdict: the streams' ITL p99 under ``default`` within this many times their ITL p50 under
# ``control``; the long prompts' mean TTFT under ``default`` no higher than under this mode's.
ITL_P99_OVER_CONTROL_P50 = 3.0
TTFT_REFERENCE_MODE = "chunked:256"


def workload(args: argparse.Namespace, maker: PromptMaker,
             with_long: bool = True) -> list[RequestSpec]:
    """The streams, the long prompts (unless ``with_long`` is false: the control workload) and
    the short requests, which arrive until the last long prompt's slot either way."""
    rng = random.Random(args.seed)
    specs = [RequestSpec(maker.make(64, rng), args.stream_tokens, "streams", 0.0, 64,
                         "stream") for _ in range(args.streams)]
    lens = [int(x) for x in args.long_lens.split(",")]
    first = args.warmup
    for i, n in enumerate(lens):
        # Drawn either way, so that the short requests get the same prompts in both workloads.
        prompt = maker.make(n, rng)
        if with_long:
            specs.append(RequestSpec(prompt, 8, "long", first + i * args.long_every, n, "long"))
    end = first + len(lens) * args.long_every
    t = args.short_every / 2
    while t < end:
        specs.append(RequestSpec(maker.make(32, rng), 8, "short", t, 32, "short"))
        t += args.short_every
    return merge(specs)


async def run_mode(mode: Mode, args: argparse.Namespace, tokenizer: Any) -> dict[str, Any]:
    """One mode's run: its workload against a fresh engine; the figures its table, verdict,
    plot and JSON need (latencies in ms, times in s from the start of the run)."""
    maker = PromptMaker(tokenizer, seed=args.seed)
    specs = workload(args, maker, with_long=not mode.control)
    engine = make_engine(real_model=True, **engine_settings(mode, args))
    config = engine.config
    effective = {"prefill_mode": config.effective_prefill_mode.value,
                 "prefill_chunk_size": config.prefill_chunk_size,
                 "target_itl_ms": getattr(config, "target_itl_ms", None),
                 "dtype": str(getattr(engine.backend, "dtype", config.dtype)).removeprefix(
                     "torch.")}
    async with EngineTarget(engine) as target:
        results, duration = await run_load(target, specs, desc=mode.name,
                                           background_tags={"stream"})
    streams = [r for r in results if r.tag == "stream"]
    itl = [g for r in streams for g in r.itls_s]
    summary = summarize_by([r for r in results if r.tag != "stream"], lambda r: r.tag,
                           duration)
    long_ttft = summary.get("long", {}).get("ttft_ms")
    return {
        "mode": mode.name, "settings": mode.settings, "control": mode.control,
        "effective": effective, "duration_s": duration,
        "all_failed": warn_if_all_failed(results, mode.name),
        "stream_tokens": sum(len(r.chunk_times_s) for r in streams),
        "stream_itl_ms": {**describe_ms(itl), "max": max(itl, default=0) * 1000},
        "short_ttft_ms": summary.get("short", {}).get("ttft_ms"),
        "long_ttft_ms": long_ttft,
        "long_ttft_mean_ms": (long_ttft or {}).get("mean"),
        "long_arrivals_s": [r.sent_s for r in results if r.tag == "long"],
        "stream_gaps": [{"t": b, "itl_s": b - a} for r in streams
                        for a, b in zip(r.chunk_times_s, r.chunk_times_s[1:], strict=False)],
        "short_ttft": [{"sent_s": r.sent_s, "ttft_s": r.ttft_s} for r in results
                       if r.tag == "short" and r.ttft_s is not None],
        "per_tag": summary,
        "results": records(results),
    }


def _figure(run: dict[str, Any] | None, *path: str) -> float | None:
    """A number inside a run's dict (None where a key is missing or the value is NaN)."""
    value: Any = run
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return value if isinstance(value, int | float) and value == value else None


def verdicts(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The two checks of the experiment, from the runs' figures (printed, never asserted).

    * ``itl``: the streams' ITL p99 under ``default`` at most
      :data:`ITL_P99_OVER_CONTROL_P50` times their ITL p50 under ``control``;
    * ``long_ttft``: the long prompts' mean TTFT under ``default`` at most
      :data:`TTFT_REFERENCE_MODE`'s.

    Returns:
        One dict per check: ``check``, ``what``, ``measured_ms``, ``limit_ms`` and ``verdict``
        (``PASS``, ``MISS``, or ``n/a`` where a mode was not run or has no figure).
    """
    by_mode = {r["mode"]: r for r in runs}
    default = by_mode.get("default")
    control_p50 = _figure(by_mode.get("control"), "stream_itl_ms", "median")
    reference = _figure(by_mode.get(TTFT_REFERENCE_MODE), "long_ttft_ms", "mean")
    checks = [
        ("itl", f"streams' ITL p99 under default <= {ITL_P99_OVER_CONTROL_P50:g} x their ITL "
                "p50 under control",
         _figure(default, "stream_itl_ms", "p99"),
         None if control_p50 is None else ITL_P99_OVER_CONTROL_P50 * control_p50),
        ("long_ttft", f"long prompts' mean TTFT under default <= under {TTFT_REFERENCE_MODE}",
         _figure(default, "long_ttft_ms", "mean"), reference),
    ]
    out = []
    for check, what, measured, limit in checks:
        verdict = "n/a" if measured is None or limit is None else (
            "PASS" if measured <= limit else "MISS")
        out.append({"check": check, "what": what, "measured_ms": measured, "limit_ms": limit,
                    "verdict": verdict})
    return out


def format_verdicts(checks: list[dict[str, Any]]) -> str:
    """The verdict block, one line per check."""
    from benchmarks.harness.common import fmt_ms

    lines = ["verdict (printed, not asserted):"]
    for c in checks:
        lines.append(f"  {c['what']}: {fmt_ms(c['measured_ms'])} against "
                     f"{fmt_ms(c['limit_ms'])}  {c['verdict']}")
    return "\n".join(lines)


def plot(runs: list[dict[str, Any]], out_dir: str | None = None) -> None:
    """The streams' gaps between tokens and the short requests' TTFT over time, one colour per
    mode; dotted lines where a long prompt arrives; legends to the right of the axes."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    fig, axes = plt.subplots(2, 1, figsize=(11.5, 6.5), sharex=True, layout="constrained")
    palette = plt.get_cmap("tab10").colors
    for i, run in enumerate(runs):
        c = palette[i % len(palette)]
        axes[0].scatter([g["t"] for g in run["stream_gaps"]],
                        [g["itl_s"] * 1000 for g in run["stream_gaps"]], s=4, color=c,
                        label=run["mode"])
        axes[1].plot([p["sent_s"] for p in run["short_ttft"]],
                     [p["ttft_s"] * 1000 for p in run["short_ttft"]], "o-", ms=3, color=c,
                     label=run["mode"])
    arrivals = next((r["long_arrivals_s"] for r in runs if r.get("long_arrivals_s")), [])
    for t in arrivals:
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
    parser.add_argument("--long-every", type=positive_float, default=12,
                        help="seconds between them")
    parser.add_argument("--warmup", type=float, default=4,
                        help="seconds of plain decoding before the first long prompt")
    parser.add_argument("--short-every", type=positive_float, default=1.0, help="seconds")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--stream-tokens", type=int, default=2000,
                        help="max_tokens of a stream (cancelled at the end anyway)")
    parser.add_argument("--chunk", type=positive_int, default=256,
                        help="tokens per chunk of the mode chunked without :N")
    parser.add_argument("--batch", type=int, default=16, help="MAX_BATCH_SIZE")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                        help="the engine's DTYPE (auto: the engine's default for the device)")
    parser.add_argument("--modes", default=",".join(MODES), metavar="LIST",
                        help="comma-separated modes: default, control, monolithic, chunked[:N], "
                             "mixed_batch[:N], itl:MS, terms joined with + (see the module's "
                             "help text)")
    parser.add_argument("--seed", type=int, default=3)
    add_out_dir_flag(parser)
    args = parser.parse_args(argv)
    try:
        modes = mode_list(args.chunk)(args.modes)
    except argparse.ArgumentTypeError as exc:
        parser.error(f"argument --modes: {exc}")
    refused = check_modes(modes, args)
    if refused:
        parser.error("the engine refuses these modes: " + " | ".join(refused))
    before = machine()
    tokenizer = model_tokenizer()
    runs = [asyncio.run(run_mode(mode, args, tokenizer)) for mode in modes]
    plot(runs, args.out_dir)
    for r in runs:
        e = r["effective"]
        itl = (f", target ITL {e['target_itl_ms']:g} ms"
               if e.get("target_itl_ms") and e["prefill_mode"] == "mixed_batch" else "")
        workload_text = "streams and short requests only" if r["control"] else "full workload"
        print(f"{r['mode']}: prefill {e['prefill_mode']}, chunk {e['prefill_chunk_size']}{itl}, "
              f"dtype {e['dtype']}; {workload_text}; {r['duration_s']:.0f} s")
    print_table([{"mode": r["mode"], "itl_p50_ms": r["stream_itl_ms"]["median"],
                  "itl_p99_ms": r["stream_itl_ms"]["p99"], "itl_max_ms": r["stream_itl_ms"]["max"],
                  "stream_tokens": r["stream_tokens"],
                  "short_ttft_p50_ms": (r["short_ttft_ms"] or {}).get("median"),
                  "short_ttft_p99_ms": (r["short_ttft_ms"] or {}).get("p99"),
                  "long_ttft_mean_ms": "-" if r["long_ttft_mean_ms"] is None
                  else r["long_ttft_mean_ms"]} for r in runs],
                ["mode", "itl_p50_ms", "itl_p99_ms", "itl_max_ms", "stream_tokens",
                 "short_ttft_p50_ms", "short_ttft_p99_ms", "long_ttft_mean_ms"])
    checks = verdicts(runs)
    print()
    print(format_verdicts(checks))
    path = write_json("prefill", {"args": vars(args), "machine_before": before, "runs": runs,
                                  "verdicts": checks}, args.out_dir)
    print(f"wrote {path}")
    return exit_status([r["mode"] for r in runs if r["all_failed"]])


if __name__ == "__main__":
    raise SystemExit(main())
