"""Structured outputs under load: the platform against plain transformers, the mask's cost, what
constrained neighbours cost unconstrained streams, jump-forward and mask overlap on and off.

On the real default model (SmolLM2-135M-Instruct) in the worker's dtype (``DTYPE=auto``: bf16
on a CPU with ``avx512_bf16``, else fp32), with ``--requests`` chat requests each asking for one
of five JSON schemas of 3 to 12 fields (``schemas``), ``--concurrency`` in flight (closed loop),
greedy (or ``--temperature`` with a seed per request), ``--max-tokens`` each:

1. the same workload through the platform's REST API (``openai`` client, ``response_format``
   ``json_schema``, one worker; ``rest``), through plain transformers ``model.generate`` with a
   llguidance logits processor in static left-padded batches of ``--concurrency``
   (``hf_generate``) and through the engine in-process: output tokens/s (completion tokens,
   the stop token counted, over the run's wall time), the platform/transformers ratio (target
   at least 3x), answers by finish reason and the share of ``stop`` answers valid per
   ``jsonschema`` (target 100 %);
2. the mask's cost: ms per constrained row per step (engine stats: ``mask_seconds / masks``;
   beside it the transformers processor's own ``fill_next_token_bitmask`` time per row);
3. the ITL p50 of ``--streams`` unconstrained streams (EOS ignored) alone, beside
   ``--neighbours`` unconstrained neighbours and beside as many constrained ones (closed loop:
   one ends, the next starts), in-process, stamped in the engine's event sink (aim: constrained
   within 10 % of unconstrained neighbours). Each unconstrained neighbour runs as many tokens
   (EOS ignored) as its prompt's constrained answer did in part 1, so both kinds end and are
   replaced after the same number of tokens; and beside constrained neighbours with
   jump-forward flipped (how much of their cost is the forced tokens riding in the same passes);
4. jump-forward on and off (``structured_jump_forward``): tokens/s, the share of tokens forced;
5. mask overlap on and off (``structured_mask_overlap``): tokens/s, the compute thread's seconds
   on masks (waiting for those computed ahead, or computing them itself).

Parts 4 and 5 flip each switch from the engine's default (read from EngineConfig): the
``engine`` run has the defaults, ``jump-forward off`` (or ``on``) and ``mask overlap on`` (or
``off``) one switch flipped; on/off ratios are medians of each round's own ratio.

Every system runs alone, one after another (2 cores: never two at once); ``busy`` is the cores
other processes kept busy meanwhile (noise when high). The in-process runs (the engine's
settings, the ITL runs) take turns for ``--repeats`` rounds and report the median run. Prints
the tables and targets (never asserted), writes ``structured_workload.json`` (``--out-dir``) and
a markdown section (``--markdown``).

Usage::

    python -m benchmarks.structured.workload              # about 8 min on 2 quiet cores
    python -m benchmarks.structured.workload --quick      # about 2 min: 16 requests, short streams
    python -m benchmarks.structured.workload --parts transformers,engine
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from typing import Any

from benchmarks.harness.cli import (
    HelpFormatter,
    add_out_dir_flag,
    name_list,
    non_negative_float,
    positive_int,
)
from benchmarks.harness.common import machine, write_json
from benchmarks.structured import inproc
from benchmarks.structured.machine import CpuMeter, cpu, measured
from benchmarks.structured.report import print_report, write_markdown
from benchmarks.structured.schemas import summarize, tasks

PARTS = ("rest", "transformers", "engine", "itl", "jump", "overlap")
SWITCHES = {"jump": ("structured_jump_forward", "jump-forward"),
            "overlap": ("structured_mask_overlap", "mask overlap")}


def engine_defaults() -> dict[str, bool]:
    """The engine's default of each switch (``structured_jump_forward``, ...), read from
    EngineConfig, so the runs stay right when a default changes."""
    from inference.engine.config import EngineConfig

    return {field: bool(EngineConfig.model_fields[field].default)
            for field, _ in SWITCHES.values()}


def engine_runs(args: argparse.Namespace) -> dict[str, dict[str, bool]]:
    """name -> EngineConfig fields of the in-process runs of parts 1, 4 and 5: ``engine`` (the
    defaults) and, for each switch asked for, the run with it flipped (``jump-forward off``
    while jump-forward is on by default, ``mask overlap on`` while overlap is off, ...)."""
    defaults = engine_defaults()
    runs = {"engine": {}} if {"engine", *SWITCHES} & set(args.parts) else {}
    for part, (field, label) in SWITCHES.items():
        if part in args.parts:
            runs[f"{label} {'off' if defaults[field] else 'on'}"] = {field: not defaults[field]}
    return runs


def run_rest_part(args: argparse.Namespace, work: list[Any]) -> dict[str, Any]:
    """The platform's figures (``error`` and no figures where the REST API failed)."""
    from benchmarks.structured.rest import run_rest

    meter = CpuMeter()
    print(f"[rest] starting the platform, then {len(work)} requests", flush=True)
    try:
        answers, wall, stats = run_rest(work, concurrency=args.concurrency,
                                        max_tokens=args.max_tokens,
                                        temperature=args.temperature, seed=args.seed,
                                        cpu_meter=meter)
    except Exception as exc:  # noqa: BLE001 - reported, the other parts still run
        print(f"[rest] FAILED: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return {"error": f"{type(exc).__name__}: {exc}"[:500]}
    out = {**summarize(answers, wall), "busy": meter.foreign_cores,
           "structured": find_structured(stats)}
    errors = [a.text for a in answers if a.finish_reason == "error"]
    if errors:
        out["error_examples"] = errors[:3]
    return out


def find_structured(stats: Any) -> dict[str, Any] | None:
    """The first ``structured`` counters (with ``masks``) in a ``/scheduler/stats`` reply."""
    if isinstance(stats, dict):
        found = stats.get("structured")
        if isinstance(found, dict) and "masks" in found:
            return found
        values = list(stats.values())
    elif isinstance(stats, list):
        values = stats
    else:
        return None
    for value in values:
        found = find_structured(value)
        if found is not None:
            return found
    return None


def run_transformers_part(args: argparse.Namespace, work: list[Any]) -> dict[str, Any]:
    """Plain transformers' figures, after a warm-up batch (torch.compile of llguidance's mask
    kernel, the model's first passes)."""
    from benchmarks.structured.hf_generate import Baseline

    print(f"[transformers] loading, warming up, then {len(work)} requests", flush=True)
    baseline = Baseline()
    baseline.run(work[:args.concurrency], batch=args.concurrency, max_tokens=4)
    baseline.masks, baseline.mask_seconds, baseline.processor_seconds = 0, 0.0, 0.0
    started = time.perf_counter()
    answers, busy = measured(baseline.run, work, batch=args.concurrency,
                             max_tokens=args.max_tokens, temperature=args.temperature,
                             seed=args.seed)
    wall = time.perf_counter() - started
    out = {**summarize(answers, wall), "busy": busy, "dtype": str(baseline.dtype),
           "masks": baseline.masks, "mask_seconds": baseline.mask_seconds,
           "processor_seconds": baseline.processor_seconds}
    del baseline
    gc.collect()
    return out


def run_engine_part(args: argparse.Namespace, work: list[Any], backend: Any,
                    name: str, overrides: dict[str, bool]) -> dict[str, Any]:
    """One in-process engine run of the workload, ``overrides`` (EngineConfig fields) beside
    the defaults; ``settings`` in the result: every switch as it was in the run."""
    print(f"[{name}] {len(work)} requests in-process", flush=True)
    (answers, wall, counters), busy = measured(
        inproc.run_workload, backend, work, concurrency=args.concurrency,
        max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed, **overrides)
    out = {**summarize(answers, wall), "busy": busy,
           "settings": {**engine_defaults(), **overrides}, **counters,
           "lengths": [a.completion_tokens for a in answers]}
    out["forced_share"] = (counters["forced_tokens"] / out["completion_tokens"]
                           if out["completion_tokens"] else None)
    return out


def itl_runs() -> list[tuple[str, bool, bool, dict[str, bool]]]:
    """(label, with neighbours, constrained, EngineConfig fields) of each ITL run: the streams
    alone, beside unconstrained neighbours, beside constrained ones, and beside constrained ones
    with jump-forward flipped from its default (how much of their cost is the forced tokens
    riding in the same passes)."""
    jump = engine_defaults()["structured_jump_forward"]
    return [("alone", False, False, {}), ("unconstrained neighbours", True, False, {}),
            ("constrained neighbours", True, True, {}),
            (f"constrained, jump-forward {'off' if jump else 'on'}", True, True,
             {"structured_jump_forward": not jump})]


def run_itl_part(args: argparse.Namespace, work: list[Any], backend: Any, label: str,
                 with_neighbours: bool, constrained: bool, settings: dict[str, bool],
                 lengths: list[int]) -> dict[str, Any]:
    """The streams alone, or beside unconstrained or constrained neighbours (one run);
    ``lengths``: each task's constrained answer's completion tokens (unconstrained neighbours
    run that long)."""
    print(f"[itl] {args.streams} streams, {label}", flush=True)
    result, busy = measured(inproc.run_streams, backend, work, streams=args.streams,
                            neighbours=args.neighbours if with_neighbours else 0,
                            constrained=constrained, stream_tokens=args.stream_tokens,
                            max_tokens=args.max_tokens, lengths=lengths, **settings)
    return {"run": label, **result, "busy": busy}


def median_run(runs: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """The run whose ``key`` is the median (the lower middle for an even count), with every
    run's ``key`` beside it as ``<key>_runs``."""
    ordered = sorted(runs, key=lambda r: (r[key] is None, r[key] or 0))
    return {**ordered[(len(ordered) - 1) // 2], f"{key}_runs": [r[key] for r in runs]}


def run_in_process(args: argparse.Namespace, work: list[Any], results: dict[str, Any]) -> None:
    """Parts 1 (the engine row), 3, 4 and 5: ``--repeats`` rounds, each setting once per
    round (so a slow spell of a shared machine does not land on one setting only); medians."""
    names = engine_runs(args)
    itl = itl_runs() if "itl" in args.parts else []
    if not names and not itl:
        return
    backend = inproc.load_backend()
    settings: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    streams: dict[str, list[dict[str, Any]]] = {run[0]: [] for run in itl}
    lengths: list[int] = []
    for round_ in range(args.repeats):
        if args.repeats > 1:
            print(f"-- in-process round {round_ + 1} of {args.repeats}", flush=True)
        for name, overrides in names.items():
            settings[name].append(run_engine_part(args, work, backend, name, overrides))
        if itl and not lengths:  # the constrained answers' lengths, for unconstrained twins
            lengths = (settings["engine"][0]["lengths"] if names else
                       [a.completion_tokens for a in inproc.run_workload(
                           backend, work, concurrency=args.concurrency,
                           max_tokens=args.max_tokens)[0]])
        for label, with_neighbours, constrained, config in itl:
            streams[label].append(run_itl_part(args, work, backend, label, with_neighbours,
                                               constrained, config, lengths))
    results["settings"] = {name: median_run(runs, "tok_s") for name, runs in settings.items()}
    if "engine" in results["settings"]:
        results["workload"]["engine in-process"] = results["settings"]["engine"]
    if itl:
        results["itl"] = [median_run(runs, "itl_p50_ms") for runs in streams.values()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=HelpFormatter)
    parser.add_argument("--requests", type=positive_int, default=64,
                        help="requests of the structured workload (--quick: 16)")
    parser.add_argument("--concurrency", type=positive_int, default=16,
                        help="requests in flight, and transformers' batch size")
    parser.add_argument("--max-tokens", type=positive_int, default=200, help="per request")
    parser.add_argument("--temperature", type=non_negative_float, default=0.0,
                        help="0: greedy; else sampled, seeded per request")
    parser.add_argument("--seed", type=int, default=0, help="workload and sampling seed")
    parser.add_argument("--streams", type=positive_int, default=8,
                        help="unconstrained streams of the ITL comparison")
    parser.add_argument("--neighbours", type=positive_int, default=8,
                        help="neighbours kept in flight beside the streams")
    parser.add_argument("--stream-tokens", type=positive_int, default=128,
                        help="tokens per stream (EOS ignored; --quick: 32)")
    parser.add_argument("--repeats", type=positive_int, default=3,
                        help="rounds of the in-process runs (engine settings, ITL), medians "
                             "reported (--quick: 1)")
    parser.add_argument("--parts", type=name_list(PARTS, "--parts"), default=",".join(PARTS),
                        metavar="LIST", help=f"comma-separated, out of {', '.join(PARTS)}")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: 16 requests, 32-token streams (figures mean little)")
    parser.add_argument("--markdown", default="/tmp/structured_benchmark.md", metavar="FILE",
                        help="where the markdown section goes ('' for none)")
    add_out_dir_flag(parser, "the JSON file")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests = min(args.requests, 16)
        args.stream_tokens = min(args.stream_tokens, 32)
        args.repeats = 1
    before = machine()
    info = cpu()
    print(f"CPU: {info['label']}; each system runs alone, one after another", flush=True)
    work = tasks(args.requests, args.seed)
    from benchmarks.structured.hf_generate import worker_dtype

    results: dict[str, Any] = {"cpu": info, "args": vars(args), "workload": {}, "settings": {},
                               "dtype": str(worker_dtype()).removeprefix("torch."),
                               "defaults": engine_defaults()}
    if "rest" in args.parts:
        results["workload"]["platform (REST)"] = run_rest_part(args, work)
    if "transformers" in args.parts:
        results["workload"]["transformers generate"] = run_transformers_part(args, work)
    run_in_process(args, work, results)
    command = "python -m benchmarks.structured.workload " + " ".join(
        sys.argv[1:] if argv is None else argv)
    results["command"] = command.strip()
    print_report(results)
    path = write_json("structured_workload", {**results, "machine_before": before},
                      args.out_dir)
    print(f"wrote {path}")
    if args.markdown:
        write_markdown(results, args.markdown)
        print(f"wrote {args.markdown}")
    failed = [k for k, v in results["workload"].items() if "error" in v]
    return 1 if failed and len(failed) == len(results["workload"]) else 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
