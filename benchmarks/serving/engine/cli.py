"""The command line of ``python -m benchmarks.serving.engine``: every system on every workload,
each run in a process of its own (this command again, with ``--worker``), the table, the
targets and the JSON file, rewritten after every run."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness import llama_server
from benchmarks.harness.cli import HelpFormatter, name_list, positive_int
from benchmarks.harness.common import cpu_info
from benchmarks.serving.engine.report import (
    bandwidth_rows,
    check_targets,
    engine_dtypes,
    format_bandwidth,
    format_table,
    format_targets,
    save,
)
from benchmarks.serving.engine.systems import (
    DEFAULT_SYSTEMS,
    DTYPES,
    KINDS,
    LLAMA_SYSTEMS,
    System,
    parse_system,
    system_list,
)
from benchmarks.serving.engine.worker import ENGINE_SETTINGS, WORKER_TIMEOUT_S, worker
from benchmarks.serving.engine.workloads import WORKLOADS

REPO = Path(__file__).resolve().parents[3]
RESULTS_DIR = REPO / "benchmarks" / "results"
DESCRIPTION = "Throughput and latency of this engine against plain transformers and llama.cpp's " \
              "llama-server, on the same model and prompts."
LLAMA_WEIGHTS = {"bfloat16": "bf16", "q4_1": "q4_1"}


def planned_runs(system: System, workload: str, repeats: int, peer_repeats: int) -> int:
    """Runs of ``system`` on ``workload``: ``repeats`` for the engine, ``peer_repeats`` for a
    peer, and one for a peer on workload b (several minutes a run)."""
    if system.kind == "engine":
        return repeats
    return 1 if workload == "b" else peer_repeats


def median_run(runs: list[dict[str, float]]) -> dict[str, float]:
    """Each figure's median over ``runs`` (every run has the same keys)."""
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def run_one(system: System, workload: str, quick: bool, repeats: int) -> dict:
    """``repeats`` runs of ``system`` on ``workload`` in a process of their own (this command with
    ``--worker``, at most :data:`WORKER_TIMEOUT_S` seconds).

    Returns:
        The worker's JSON (``runs``, ``peak_rss_bytes``, ``description``, ``dtype``) with
        ``process_s`` (the process's wall time) added, or ``{"error": ...}`` with its exit status
        and the end of its output when it failed.
    """
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "benchmarks.serving.engine", "--worker", system.label,
               "--workload", workload, "--repeats", str(repeats), "--result", str(out)]
        if quick:
            cmd.append("--quick")
        for key, value in ENGINE_SETTINGS.items():
            cmd += [f"--{key.replace('_', '-')}", str(value)]
        started = time.monotonic()
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True,
                              timeout=WORKER_TIMEOUT_S)
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stderr or proc.stdout)[-2000:]
            return {"error": f"exit {proc.returncode}: {tail}"}
        result = json.loads(out.read_text())
    result["process_s"] = time.monotonic() - started
    return result


def main(argv: list[str] | None = None) -> int:
    """The benchmark from the command line (``argv``, else the process's): every run, the table,
    the targets and the JSON file; returns 0, 1 when a run failed, 130 when interrupted (a bad
    flag exits with argparse's status 2). With ``--worker`` it is one system's process instead:
    :func:`~benchmarks.serving.engine.worker.worker` writes its runs to ``--result``."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.serving.engine",
                                     description=DESCRIPTION, formatter_class=HelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller workloads, one repeat")
    parser.add_argument("--systems", type=system_list, default=None, metavar="LIST",
                        help="comma-separated systems to run: KIND or KIND:DTYPE, KIND one of "
                             f"{', '.join(KINDS)}, DTYPE one of {', '.join(DTYPES)} (fp32, "
                             "bf16); engine alone is its default dtype (auto), engine:q4_1 the "
                             "engine with QUANTIZATION=q4_1, a transformers peer alone float32; "
                             "llama_server alone is llama_server:bf16; llama_server:bf16 and "
                             "llama_server:q4_1 are "
                             "llama.cpp on the bf16 and the wheel's Q4_1 GGUF (built by "
                             "scripts/llama_cpp.sh). Default: "
                             f"{','.join(DEFAULT_SYSTEMS)}, and both llama_server systems where "
                             "built")
    parser.add_argument("--workloads", type=name_list(WORKLOADS), default=",".join(WORKLOADS),
                        metavar="LIST",
                        help=f"comma-separated workloads to run, out of {', '.join(WORKLOADS)}")
    parser.add_argument("--repeats", type=positive_int, default=None, metavar="N",
                        help="runs of each engine system per workload, at least 1 (default: 1 "
                             "with --quick, else 3)")
    parser.add_argument("--peer-repeats", type=positive_int, default=None, metavar="N",
                        help="runs of each peer (generate, generate_batch) on workloads a and c, "
                             "at least 1 (default: 1 with --quick, else 2); on workload b the "
                             "peers run once")
    parser.add_argument("--out", type=out_file, default=None, metavar="FILE",
                        help="JSON file to write, rewritten after every run so that an "
                             "interrupted benchmark keeps the figures of the runs that finished; "
                             "missing folders are created (default: benchmarks/results/"
                             "bench-<quick|full>-<time>.json)")
    parser.add_argument("--prefill-mode", default="", choices=["", "monolithic", "chunked",
                                                               "mixed_batch"],
                        help="the engine's PREFILL_MODE (default: the engine's default)")
    parser.add_argument("--target-itl-ms", type=float, default=None, metavar="MS",
                        help="the engine's TARGET_ITL_MS (default: the engine's default)")
    parser.add_argument("--worker", type=parse_system, help=argparse.SUPPRESS)
    parser.add_argument("--workload", choices=WORKLOADS, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    ENGINE_SETTINGS.clear()
    if args.prefill_mode:
        ENGINE_SETTINGS["prefill_mode"] = args.prefill_mode
    if args.target_itl_ms is not None:
        ENGINE_SETTINGS["target_itl_ms"] = args.target_itl_ms
    if args.worker:
        worker(args.worker, args.workload, args.quick, args.repeats or 1, args.result)
        return 0

    repeats = args.repeats or (1 if args.quick else 3)
    peer_repeats = args.peer_repeats or (1 if args.quick else 2)
    systems, workloads = pick_systems(args.systems), args.workloads
    if systems is None:
        return 2
    cpu = cpu_info()
    print(f"CPU: {cpu['label']}")
    read_gbs = None
    if "c" in workloads:
        read_gbs = llama_server.read_bandwidth_gbs()
        print(f"read bandwidth: {read_gbs:.1f} GB/s")
    results: dict[str, dict[str, dict]] = {}
    descriptions: dict[str, str] = {}
    started = time.monotonic()
    out = args.out or RESULTS_DIR / f"bench-{'quick' if args.quick else 'full'}-" \
                                    f"{time.strftime('%Y%m%d-%H%M%S')}.json"
    try:
        run_all(systems, workloads, (repeats, peer_repeats), args.quick, out, results,
                descriptions, started)
    except KeyboardInterrupt:
        kept = f"the finished runs' figures are in {out}" if out.exists() else "no run finished"
        print(f"\ninterrupted: {kept}", file=sys.stderr)
        return 130
    table = format_table(results)
    print()
    for wl, text in descriptions.items():
        print(f"workload {wl}: {text}")
    for label, dtype in engine_dtypes(results).items():
        how = "dtype auto resolved to" if label == "engine" else "ran in"
        print(f"{label}: {how} {dtype}")
    print(table)
    print(f"\ntotal {time.monotonic() - started:.0f} s; medians over runs; x gen / x gb: "
          "throughput ratio to generate / generate_batch in the row's own dtype; x gen32: to "
          "generate:float32; busy: cores other processes kept busy meanwhile (noise)")
    if "c" in results:
        weights = {s.label: llama_server.decode_weight_bytes(
            results["c"].get(s.label, {}).get("dtype", "")) for s in systems}
        band = bandwidth_rows(results["c"], {k: v for k, v in weights.items() if v}, read_gbs)
        print("\nsingle stream (workload c): weight bytes read per decode step over its ITL p50")
        print(format_bandwidth(band, read_gbs))
        extra = {"cpu": cpu, "read_bandwidth_gbs": read_gbs, "single_stream_bandwidth": band}
    else:
        extra = {"cpu": cpu}
    checks = check_targets(results, cpu["avx512_bf16"])
    if checks:
        print("\ntargets (throughput ratios; printed, not asserted):")
        print(format_targets(checks))
    save(out, args.quick, descriptions, results, extra)
    print(f"saved {out}")
    failed = [f"{system} on {wl}" for wl, by_system in results.items()
              for system, r in by_system.items() if "error" in r]
    if failed:
        print(f"ERROR: failed runs: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def pick_systems(asked: list[System] | None) -> list[System] | None:
    """The systems to run: ``asked`` (from ``--systems``), else the default set with both
    llama.cpp systems where they are built (a line says why one is left out). None, with the
    reason on stderr, when an asked-for llama.cpp system cannot run here."""
    if asked is not None:
        for system in asked:
            why = (llama_server.missing(LLAMA_WEIGHTS[system.dtype])
                   if system.kind == "llama_server" else None)
            if why:
                print(f"error: {system.label}: {why}", file=sys.stderr)
                return None
        return asked
    systems = [parse_system(label) for label in DEFAULT_SYSTEMS]
    for label in LLAMA_SYSTEMS:
        system = parse_system(label)
        why = llama_server.missing(LLAMA_WEIGHTS[system.dtype])
        if why:
            print(f"{label}: skipped: {why}")
        else:
            systems.append(system)
    return systems


def out_file(text: str) -> Path:
    """argparse type of ``--out``: a file path that can be written (checked before any run)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path")
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory, not a file")
    for parent in path.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise argparse.ArgumentTypeError(f"{parent} is not a directory")
            break
    return path


def run_all(systems: list[System], workloads: list[str], repeats: tuple[int, int], quick: bool,
            out: Path, results: dict[str, dict[str, dict]], descriptions: dict[str, str],
            started: float) -> None:
    """Run every system on every workload (``repeats``: the engine's and the peers' runs, see
    :func:`planned_runs`), saving ``out`` after each run."""
    # Systems take turns, one run per process, so a slow spell of a shared machine hits them
    # alike rather than all the runs of one system.
    for wl in workloads:
        results[wl] = {}
        plan = {s.label: planned_runs(s, wl, *repeats) for s in systems}
        for rep in range(max(plan.values())):
            for system in systems:
                label = system.label
                if rep >= plan[label] or "error" in results[wl].get(label, {}):
                    continue
                print(f"[{time.monotonic() - started:6.0f}s] {label} on workload {wl}, "
                      f"run {rep + 1} of {plan[label]} ...", flush=True)
                one = run_one(system, wl, quick, 1)
                descriptions[wl] = one.pop("description", descriptions.get(wl, ""))
                merged = results[wl].setdefault(label, {"runs": [], "peak_rss_bytes": 0})
                if "error" in one:
                    merged["error"] = one["error"]
                    continue
                merged["dtype"] = one.get("dtype", "")
                merged["runs"] += one["runs"]
                merged["peak_rss_bytes"] = max(merged["peak_rss_bytes"], one["peak_rss_bytes"])
                merged["median"] = median_run(merged["runs"])
                save(out, quick, descriptions, results)  # an interrupted run keeps its figures
