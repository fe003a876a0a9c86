"""LoRA adapters: the engine serving requests under adapters against the bare model, and against
``peft`` with one adapter at a time.

On the real default model, in-process: ``LLMEngine`` over the transformers backend with the
engine's default settings (``PREFILL_MODE`` mixed_batch; ``DTYPE`` auto unless ``--dtype``),
``MAX_BATCH_SIZE`` the concurrency and a KV pool sized for it (as the engine benchmark sizes
it), sent the load by the harness's :class:`~benchmarks.harness.targets.EngineTarget`. One
workload, the mixed load of the llama.cpp comparison (``--requests`` 64, prompts of 16-384
tokens, ``max_tokens`` 16-192, ``--concurrency`` 16 in flight, closed loop, greedy, EOS ignored
so that every request generates its ``max_tokens``), runs on a fresh engine (its adapter pool
and prefix cache empty) for each run, the same prompts and lengths each time:

* ``base``: every request on the bare model;
* ``1``, ``4``, ``16``: every fourth request (``i % 4 == 3``) on the bare model, as in every run,
  the others round-robin over 1, 4 or 16 adapters; the pool holds ``--max-loras`` (8) adapters,
  so the 16-adapter run loads and evicts them as it goes;
* ``peft``: the 4-adapter run's assignment as a user writes it (:mod:`.lora_peft`): per adapter
  ``PeftModel.from_pretrained`` (unmerged; its load timed apart), ``generate`` in static batches
  of up to ``--concurrency`` (left padding, each batch to its longest ``max_tokens``, each
  request counted for its own), in the dtype the engine resolved.

Adapters: rank 8 and 16 alternating, on every attention and MLP projection, made with
:func:`benchmarks.harness.adapters.make_adapter` into ``--adapter-dir`` (those already there are
reused) or a temporary folder; only those the runs use are made. A warm-up (bare and adapter
rows, through the engine) comes first.

Reported per run (:mod:`benchmarks.harness.metrics`' definitions): output tokens/s, requests/s,
TTFT and ITL p50/p99 of all streams and of the bare-model streams alone (the same requests in
every run), the adapter pool's loads, evictions and mean load time, the output tokens/s over the
bare run's, and the cores other processes kept busy meanwhile (``busy``). Targets (printed, not
asserted): 4 adapters at least 0.8x the bare model's output tokens/s and at least 3x ``peft``'s.

Usage::

    python -m benchmarks.serving.lora                  # 4-8 min on 2 cores in bf16 (estimated)
    python -m benchmarks.serving.lora --runs base,4,peft --adapter-dir /tmp/lora-adapters
    python -m benchmarks.serving.lora --requests 8 --output-len 4-8 --runs base,1,16 \\
        --max-loras 2 --out-dir /tmp/lora                              # a quick check
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import math
import random
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from benchmarks.harness.cli import HelpFormatter, add_out_dir_flag, name_list, positive_int
from benchmarks.harness.common import (
    annotate_bars,
    cpu_info,
    exit_status,
    headroom,
    machine,
    ms_log_axis,
    print_table,
    save_figure,
    warn_if_all_failed,
    write_json,
)
from benchmarks.harness.metrics import RequestResult, records, summarize
from benchmarks.harness.targets import EngineTarget, run_load
from benchmarks.harness.workload import PromptMaker, RequestSpec, random_requests

RUNS = ("base", "1", "4", "16", "peft")
ADAPTERS = {"base": 0, "1": 1, "4": 4, "16": 16, "peft": 4}  # adapters each run spreads over
BARE_EVERY = 4  # request i runs on the bare model in every run where i % 4 == 3
RANKS = (8, 16)  # adapter k has rank RANKS[k % 2]
INPUT_LEN, OUTPUT_LEN = (16, 384), (16, 192)
KV_BLOCK_SIZE = 16
# (run, peer, factor): the run's output tokens/s over the peer's.
TARGETS = (("4", "base", 0.8), ("4", "peft", 3.0))
PEER_NAMES = {"base": "the bare model", "peft": "peft (generate, one adapter at a time)"}


def length_range(text: str) -> tuple[int, int]:
    """argparse ``type``: ``MIN-MAX`` tokens, 1 <= MIN <= MAX (``N`` alone: MIN = MAX = N)."""
    lo, _, hi = text.partition("-")
    try:
        low, high = int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not MIN-MAX (e.g. 16-192)") from None
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"{text!r}: need 1 <= MIN <= MAX")
    return low, high


length_range.__name__ = "length range"


def assignment(count: int, adapters: int) -> list[int | None]:
    """Each request's adapter (an index), or None for the bare model: every ``BARE_EVERY``-th
    request on the bare model, the others round-robin over ``adapters`` (none: all bare)."""
    out: list[int | None] = []
    for i in range(count):
        bare = not adapters or i % BARE_EVERY == BARE_EVERY - 1
        out.append(None if bare else sum(x is not None for x in out) % adapters)
    return out


def adapters_needed(runs: list[str], count: int) -> int:
    """How many adapters the ``runs`` use on ``count`` requests (a run of N uses at most N)."""
    used = [{a for a in assignment(count, ADAPTERS[r]) if a is not None} for r in runs]
    return max((len(u) for u in used), default=0)


def adapter_specs(folder: Path, root: Path, count: int, seed: int) -> list[Any]:
    """Adapters 0 to ``count - 1`` (``AdapterSpec``), made under ``root`` unless there."""
    from benchmarks.harness.adapters import make_adapter
    from inference.engine.request import AdapterSpec

    specs = []
    for k in range(count):
        rank = RANKS[k % len(RANKS)]
        name = f"{folder.name}:lora-{k:02d}"
        out = root / f"{folder.name}-lora-{k:02d}-r{rank}"
        weights = out / "adapter_model.safetensors"
        if weights.is_file():
            digest = hashlib.sha256(weights.read_bytes()).hexdigest()
            specs.append(AdapterSpec(name=name, path=str(out), digest=digest, rank=rank))
        else:
            specs.append(make_adapter(folder, out, rank=rank, seed=seed + k, name=name))
    return specs


def assign(specs: list[RequestSpec], adapters: list[Any], run: str) -> list[RequestSpec]:
    """``specs`` under ``run``'s assignment; each tagged with its adapter's name or ``bare``."""
    picks = assignment(len(specs), ADAPTERS[run])
    return [replace(s, adapter=None if k is None else adapters[k],
                    tag="bare" if k is None else adapters[k].name)
            for s, k in zip(specs, picks, strict=True)]


def _cpu_now() -> tuple[float, float]:
    """(busy CPU seconds of the whole machine, CPU seconds of this process) so far."""
    import psutil

    t = psutil.cpu_times()
    own = psutil.Process().cpu_times()
    busy = t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)
    return busy, own.user + own.system


def busy_cores(before: tuple[float, float], after: tuple[float, float], wall_s: float) -> float:
    """Cores other processes kept busy between two :func:`_cpu_now` readings."""
    other = (after[0] - before[0]) - (after[1] - before[1])
    return round(max(other, 0.0) / wall_s, 2) if wall_s > 0 else 0.0


async def engine_run(backend: Any, specs: list[RequestSpec], prompt_lens: list[int],
                     concurrency: int, max_loras: int, desc: str) -> dict[str, Any]:
    """``specs`` through a fresh engine on ``backend``; its results, duration and stats."""
    from inference.engine.config import EngineConfig
    from inference.engine.llm_engine import LLMEngine

    longest = max(n + s.max_tokens for n, s in zip(prompt_lens, specs, strict=True))
    blocks = concurrency * (-(-longest // KV_BLOCK_SIZE) + 1) + 16
    engine = LLMEngine(EngineConfig(max_batch_size=concurrency, kv_num_blocks=blocks,
                                    kv_block_size=KV_BLOCK_SIZE, max_pending=10_000,
                                    max_loras=max_loras), backend)
    cpu = _cpu_now()
    async with EngineTarget(engine) as target:
        results, duration = await run_load(target, specs, max_concurrency=concurrency, desc=desc)
    busy = busy_cores(cpu, _cpu_now(), duration)
    return {"results": results, "duration_s": duration, "stats": engine.stats(), "busy": busy,
            "prefill_mode": str(engine.config.effective_prefill_mode.value)}


def run_entry(run: str, results: list[RequestResult], duration: float,
              specs: list[RequestSpec], prompt_lens: list[int]) -> dict[str, Any]:
    """One run's figures: over all streams and the bare-model ones, the requests that did not
    end ``ok`` with their ``max_tokens`` (``short``), every request's result."""
    short = [i for i, (r, s) in enumerate(zip(results, specs, strict=True))
             if r.status != "ok" or r.output_tokens != s.max_tokens]
    miscounted = sum(r.status == "ok" and r.prompt_tokens != n
                     for r, n in zip(results, prompt_lens, strict=True))
    if short:
        print(f"WARNING: {run}: {len(short)} requests did not produce their max_tokens "
              f"(first: request {short[0]})", file=sys.stderr)
    if miscounted:
        print(f"WARNING: {run}: {miscounted} prompts counted other tokens than the peft run's",
              file=sys.stderr)
    return {"run": run, "adapters": ADAPTERS[run], "summary": summarize(results, duration),
            "bare": summarize([r for r in results if r.tag == "bare"], duration),
            "short_requests": short, "all_failed": warn_if_all_failed(results, run),
            "results": records(results)}


def ratio(runs: dict[str, dict], run: str, peer: str) -> float | None:
    """``run``'s output tokens/s over ``peer``'s (None when either did not run)."""
    if run not in runs or peer not in runs or not runs[peer]["summary"]["output_throughput"]:
        return None
    return runs[run]["summary"]["output_throughput"] / runs[peer]["summary"]["output_throughput"]


def verdicts(runs: dict[str, dict]) -> list[str]:
    """:data:`TARGETS` against the runs, a line each with PASS or MISS."""
    lines = []
    for run, peer, factor in TARGETS:
        value = ratio(runs, run, peer)
        if value is not None:
            lines.append(f"{ADAPTERS[run]} adapters >= {factor:.2f}x {PEER_NAMES[peer]}: "
                         f"{value:.2f}x  {'PASS' if value >= factor else 'MISS'}")
    return lines


def _ms(value: float, digits: int = 0) -> float:
    """``value`` rounded (NaN, where a run had no such latency, as it is)."""
    return round(value, digits) if math.isfinite(value) else value


def table_rows(runs: dict[str, dict]) -> tuple[list[dict], list[dict]]:
    """The main table (all streams) and the bare-model streams' table, a row per run."""
    main_rows, bare_rows = [], []
    for name, run in runs.items():
        s, pool = run["summary"], run.get("adapter_stats") or {}
        loads = pool.get("loads", len(run.get("peft_load_s", [])))
        load_s = pool.get("load_s_total", sum(run.get("peft_load_s", [])))
        base_x = ratio(runs, name, "base")
        main_rows.append({
            "run": name, "adapters": run["adapters"], "pool": run.get("max_loras") or "",
            "tok/s": round(s["output_throughput"], 1), "req/s": round(s["request_throughput"], 3),
            "TTFT p50 ms": _ms(s["ttft_ms"]["median"]), "TTFT p99 ms": _ms(s["ttft_ms"]["p99"]),
            "ITL p50 ms": _ms(s["itl_ms"]["median"], 1), "ITL p99 ms": _ms(s["itl_ms"]["p99"]),
            "loads": loads, "evictions": pool.get("evictions", ""),
            "load ms": round(1000 * load_s / loads, 1) if loads else "",
            "x base": f"{base_x:.2f}" if base_x is not None and name != "base" else "",
            "busy": run["busy"], "short": len(run["short_requests"])})
        b = run["bare"]
        bare_rows.append({"run": name, "requests": b["completed"],
                          "TTFT p50 ms": _ms(b["ttft_ms"]["median"]),
                          "TTFT p99 ms": _ms(b["ttft_ms"]["p99"]),
                          "ITL p50 ms": _ms(b["itl_ms"]["median"], 1),
                          "ITL p99 ms": _ms(b["itl_ms"]["p99"])})
    return main_rows, bare_rows


def plot(runs: dict[str, dict], out_dir: str | None) -> None:
    """Output tokens/s per run (labelled with the ratio to the bare run), and the ITL p50 and
    p99 of all streams and of the bare-model streams."""
    import matplotlib.pyplot as plt

    names = list(runs)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2), layout="constrained")
    vals = [runs[n]["summary"]["output_throughput"] for n in names]
    bars = ax1.bar(range(len(names)), vals, width=0.6, color="tab:blue")
    labels = []
    for name, value in zip(names, vals, strict=True):
        # The bare run's multiple; peft's bar: the 4-adapter run's multiple of it.
        x = ratio(runs, "4", "peft") if name == "peft" else ratio(runs, name, "base")
        suffix = "" if name == "base" or x is None else (
            f"\n4 adapters: {x:.2f}x" if name == "peft" else f"\n{x:.2f}x")
        labels.append(f"{value:.1f}{suffix}")
    annotate_bars(ax1, bars, labels, fontsize=9)
    ax1.set_xticks(range(len(names)), names)
    ax1.set_xlabel("run (adapters the requests spread over)")
    ax1.set_title("Output tokens/s (x the bare model's)", fontsize=10)
    headroom(ax1, 1.25)
    series = (("all", "summary", "median", "tab:blue"), ("bare", "bare", "median", "tab:green"),
              ("all", "summary", "p99", "tab:cyan"), ("bare", "bare", "p99", "tab:olive"))
    width = 0.8 / len(series)
    for j, (who, key, stat, color) in enumerate(series):
        ys = [runs[n][key]["itl_ms"][stat] for n in names]
        ax2.bar([i + (j - 1.5) * width for i in range(len(names))], ys, width=width,
                color=color, label=f"ITL {'p50' if stat == 'median' else 'p99'}, {who} streams")
    ax2.set_xticks(range(len(names)), names)
    ax2.set_yscale("log")
    ms_log_axis(ax2.yaxis)
    ax2.set_title("Inter-token latency (log scale)", fontsize=10)
    ax2.legend(fontsize=8)
    save_figure(fig, "lora", out_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.serving.lora",
                                     description=__doc__.split("\n\n")[0],
                                     formatter_class=HelpFormatter)
    parser.add_argument("--runs", type=name_list(RUNS, "run list"), default=list(RUNS),
                        help=f"comma-separated, out of {', '.join(RUNS)} (default: all)")
    parser.add_argument("--requests", type=positive_int, default=64, help="requests per run")
    parser.add_argument("--concurrency", type=positive_int, default=16,
                        help="requests in flight (MAX_BATCH_SIZE; peft's batch size)")
    parser.add_argument("--input-len", type=length_range, default=INPUT_LEN, metavar="MIN-MAX",
                        help="prompt tokens (default: 16-384)")
    parser.add_argument("--output-len", type=length_range, default=OUTPUT_LEN, metavar="MIN-MAX",
                        help="max_tokens (default: 16-192)")
    parser.add_argument("--max-loras", type=positive_int, default=8,
                        help="MAX_LORAS: adapters the pool holds (the adapter runs)")
    parser.add_argument("--seed", type=int, default=0, help="the prompts' and adapters' seed")
    parser.add_argument("--adapter-dir", default=None, metavar="DIR",
                        help="where the adapters are made, or reused (default: a temporary "
                             "folder)")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                        help="the model's dtype, the engine's and peft's")
    add_out_dir_flag(parser)
    args = parser.parse_args(argv)
    args.runs = [r for r in RUNS if r in args.runs]
    if args.adapter_dir:
        return measure(args, Path(args.adapter_dir))
    with tempfile.TemporaryDirectory(prefix="lora-bench-") as root:
        return measure(args, Path(root))


def measure(args: argparse.Namespace, adapter_root: Path) -> int:
    """Every run of ``args.runs``, the table, the targets, the JSON and the plot."""
    from inference.engine.backends.hf import TransformersBackend
    from inference.engine.model_store import resolve_model_path
    from inference.protocol.settings import PlatformSettings

    before, cpu = machine(), cpu_info()
    shared = PlatformSettings()
    folder = resolve_model_path(shared.model_path, shared.model_cache_dir)
    started = time.perf_counter()
    adapters = adapter_specs(folder, adapter_root, adapters_needed(args.runs, args.requests),
                             args.seed)
    made_s = time.perf_counter() - started
    backend = TransformersBackend.from_pretrained(str(folder), dtype=args.dtype)
    dtype = str(backend.dtype).removeprefix("torch.")
    maker = PromptMaker(backend.tokenizer, seed=args.seed)
    specs = random_requests(maker, [0.0] * args.requests, args.input_len, args.output_len,
                            random.Random(args.seed + 1000), tenant="bench")
    prompts = [backend.tokenizer.encode(s.prompt) for s in specs]
    lens = [len(p) for p in prompts]
    warm = random_requests(maker, [0.0] * 4, (16, 48), (4, 4), random.Random(args.seed + 2000),
                           tenant="bench")
    # Bare rows beside rows of the first adapters (both ranks where two are used).
    warm = [replace(s, adapter=adapters[i // 2 % len(adapters)] if i % 2 and adapters else None)
            for i, s in enumerate(warm)]
    print(f"CPU: {cpu['label']}\nmodel: {folder.name}, dtype {dtype} (--dtype {args.dtype}); "
          f"{len(adapters)} adapters (ranks {'/'.join(map(str, RANKS))} alternating) in "
          f"{adapter_root}, ready in {made_s:.1f} s")
    print(f"workload: {args.requests} requests, prompts {min(lens)}-{max(lens)} tokens, "
          f"max_tokens {min(s.max_tokens for s in specs)}-{max(s.max_tokens for s in specs)}, "
          f"{args.concurrency} in flight, greedy, EOS ignored; every {BARE_EVERY}th request "
          f"on the bare model in every run, the others round-robin over the run's adapters",
          flush=True)
    asyncio.run(engine_run(backend, warm, [len(backend.tokenizer.encode(s.prompt)) for s in warm],
                           args.concurrency, args.max_loras, "warm-up"))
    runs: dict[str, dict[str, Any]] = {}
    prefill_mode = ""
    for run in args.runs:
        print(f"== {run}", flush=True)
        mine = assign(specs, adapters, run)
        if run == "peft":
            from benchmarks.serving.lora_peft import run_peft

            cpu_before, t0 = _cpu_now(), time.perf_counter()
            out = run_peft(str(folder), dtype, backend.device, mine, prompts, args.concurrency)
            busy = busy_cores(cpu_before, _cpu_now(), time.perf_counter() - t0)
            runs[run] = {**run_entry(run, out["results"], out["duration_s"], mine, lens),
                         "busy": busy, "peft_load_s": out["load_s"], "groups": out["groups"]}
            continue
        out = asyncio.run(engine_run(backend, mine, lens, args.concurrency, args.max_loras, run))
        prefill_mode = out["prefill_mode"]
        runs[run] = {**run_entry(run, out["results"], out["duration_s"], mine, lens),
                     "busy": out["busy"], "max_loras": args.max_loras if run != "base" else None,
                     "adapter_stats": out["stats"].get("adapters")}
    main_rows, bare_rows = table_rows(runs)
    print(f"\nall streams (engine: PREFILL_MODE {prefill_mode or 'n/a'}, default settings; "
          "peft: seconds in generate only)")
    print_table(main_rows, list(main_rows[0]))
    print(f"\nbare-model streams only (requests i % {BARE_EVERY} == {BARE_EVERY - 1}; "
          "every request in the base run)")
    print_table(bare_rows, list(bare_rows[0]))
    if "peft" in runs:
        peft = runs["peft"]
        total = peft["summary"]["duration_s"] + sum(peft["peft_load_s"])
        print(f"\npeft: {len(peft['peft_load_s'])} PeftModel.from_pretrained loads, "
              f"{sum(peft['peft_load_s']):.2f} s in all; output tok/s with them counted "
              f"{peft['summary']['total_output_tokens'] / total:.1f}")
    checks = verdicts(runs)
    if checks:
        print("\ntargets (printed, not asserted):\n" + "\n".join(checks))
    plot(runs, args.out_dir)
    path = write_json("lora", {"machine_before": before, "cpu": cpu, "args": vars(args),
                               "model": folder.name, "dtype": dtype,
                               "prefill_mode": prefill_mode,
                               "adapters": [asdict(a) for a in adapters],
                               "adapters_ready_s": made_s, "bare_every": BARE_EVERY,
                               "runs": runs, "table": main_rows, "bare_table": bare_rows,
                               "targets": checks}, args.out_dir)
    print(f"wrote {path}")
    status = exit_status([r for r, v in runs.items() if v["all_failed"]])
    return status or int(any(v["short_requests"] for v in runs.values()))


if __name__ == "__main__":
    raise SystemExit(main())
