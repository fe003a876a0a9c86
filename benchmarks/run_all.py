"""Every serving experiment and micro-benchmark again, in one command.

Runs each of :data:`STEPS` in turn, in the order of ``docs/benchmarks.md`` (then the kernel
benchmarks of ``docs/engine.md``) and with the settings its figures were measured with, each as
its own ``python -m`` process from the repository root. Every step writes under one folder
(``--out-dir``, by default ``benchmarks/results/rerun-<full|quick>-<time>/``): its results in
``<folder>/<step>/`` (the step's ``--out-dir``, or its ``--out`` file there) and what it printed
in ``<folder>/<step>/output.txt``; ``<folder>/summary.json`` holds every command, its exit status
and its duration. After each step it prints where the results went, and at the end a summary. A
step that fails does not stop the others; the exit status is then 1 (130 when interrupted).

``--quick`` runs every step at its smallest size (a smoke run of minutes, to check a new
machine; its figures mean nothing); ``--list`` prints the commands without running them;
``--only`` runs some steps by name.

Usage::

    python -m benchmarks.run_all                  # everything, the docs' settings: several hours
    python -m benchmarks.run_all --quick          # every step at its smallest size
    python -m benchmarks.run_all --list           # the commands, not run
    python -m benchmarks.run_all --only prefill,engine --out-dir /tmp/rerun

``scripts/benchmarks.sh`` runs it with the project's environment, after preparing the model
folder and making sure a Redis answers.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.harness.cli import HelpFormatter, name_list

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO / "benchmarks" / "results"

# How a step is told where to write (``folder``: the step's own folder).
OUT_DIR = "out-dir"  # --out-dir FOLDER (JSON and plots)
OUT_FILE = "out-file"  # --out FOLDER/<step>.json
CHAOS = "chaos"  # --out FOLDER/report.json --log-dir FOLDER/logs
PRINTED = "printed"  # nothing but what it prints (output.txt)


@dataclass(frozen=True)
class Step:
    """One command of the rerun.

    Attributes:
        name: the step's name (``--only``) and the name of its folder.
        module: what ``python -m`` runs.
        args: its flags with the docs' settings.
        quick: its flags at its smallest size (``--quick``).
        output: how it is told where to write: :data:`OUT_DIR`, :data:`OUT_FILE`,
            :data:`CHAOS` or :data:`PRINTED`.
        about: what it measures, and where the docs show it.
    """

    name: str
    module: str
    args: tuple[str, ...]
    quick: tuple[str, ...]
    output: str
    about: str


# The prefill experiment's small workload, the chaos run's short schedule (the CI's, for half as
# long) and the overhead experiment's small workload.
_SMALL_PREFILL = ("--long-lens", "96,160", "--long-every", "2", "--warmup", "1", "--streams", "2",
                  "--stream-tokens", "100")
_SHORT_CHAOS = ("--duration-s", "20", "--concurrency", "6", "--warmup-s", "3",
                "--kill-interval-s", "2,4", "--settle-s", "25", "--batch-jobs", "1",
                "--batch-lines", "30")
_SMALL_OVERHEAD = ("--requests", "3", "--warmup", "1", "--input-len", "16", "32",
                   "--output-len", "4", "--concurrency", "2")

STEPS = (
    Step("fairness", "benchmarks.serving.fairness", ("--targets", "engine,rest"),
         ("--targets", "engine,rest", "--duration", "4"), OUT_DIR,
         "experiment 1, VTC against FCFS: the engine in-process and the platform with 2 "
         "workers"),
    Step("fairness-real-model", "benchmarks.serving.fairness",
         ("--targets", "rest", "--backend", "transformers", "--threads-per-worker", "1",
          "--step-delay", "0", "--scenarios", "two"),
         ("--targets", "rest", "--backend", "transformers", "--threads-per-worker", "1",
          "--step-delay", "0", "--scenarios", "two", "--duration", "4"), OUT_DIR,
         "experiment 1 on the real model, 2 workers"),
    Step("priority", "benchmarks.serving.priority", (),
         ("--duration", "4", "--runs", "idle,tiers-preemption"), OUT_DIR,
         "experiment 2, priority tiers: a premium tenant's TTFT beside a batch tenant's overload"),
    Step("prefill", "benchmarks.serving.prefill",
         ("--modes", "default,control,chunked:256,itl:60"),
         ("--modes", "default,control,chunked:256,itl:60", *_SMALL_PREFILL), OUT_DIR,
         "experiment 3, prefill modes beside running streams: the engine's default, "
         "control, chunked:256, a 60 ms ITL target"),
    Step("prefill-monolithic", "benchmarks.serving.prefill",
         ("--modes", "monolithic,chunked:256,chunked:64"),
         ("--modes", "monolithic,chunked:256,chunked:64", *_SMALL_PREFILL), OUT_DIR,
         "experiment 3, monolithic against chunked prefill"),
    Step("prefix_cache", "benchmarks.serving.prefix_cache", (),
         ("--requests", "4", "--prefixes", "2", "--prefix-len", "64", "--suffix-len", "8",
          "--output-len", "4", "--concurrency", "2"), OUT_DIR,
         "experiment 4, prefix caching on against off"),
    Step("overload", "benchmarks.serving.overload", (),
         ("--duration", "4", "--loads", "1,3", "--probe-requests", "12", "--batch", "2",
          "--queue", "4"), OUT_DIR,
         "experiment 5, overload: a quarter to twice the capacity, bounded latency and fast 429s"),
    Step("overhead", "benchmarks.serving.overhead", ("--repeats", "3", "--requests", "96"),
         (*_SMALL_OVERHEAD, "--repeats", "1"), OUT_DIR,
         "experiment 6, platform overhead: REST, Redis and a worker against the engine in-process"),
    Step("cpu_contention", "benchmarks.serving.cpu_contention", (),
         (*_SMALL_OVERHEAD, "--pairs", "1"), OUT_DIR,
         "experiment 6, what another process's CPU time costs the engine"),
    Step("web_floor", "benchmarks.serving.web_floor", (),
         ("--writes", "16", "--gap-ms", "20"), OUT_DIR,
         "experiment 6, daphne's own CPU per SSE write (bare ASGI, Django; asyncio, uvloop)"),
    Step("large_prompts", "benchmarks.serving.large_prompts", (),
         ("--duration", "3", "--prompt-bytes", "100000"), OUT_DIR,
         "experiment 7, 2.4 MB and 400 KB prompts beside running streams"),
    Step("body_limit", "benchmarks.serving.body_limit", (),
         ("--body-mib", "8", "--concurrency", "2", "--rounds", "1", "--settle-s", "0.5"),
         OUT_DIR, "300 MiB bodies without a key: the web process's time to answer and memory, "
         "with its body limit and without it"),
    Step("backlog", "benchmarks.serving.backlog", (),
         ("--backlogs", "40,240", "--repeats", "1", "--workers", "1"), OUT_DIR,
         "experiment 8, a light tenant's TTFT behind a heavy tenant's backlog, 1 and 2 "
         "workers of 32 rows"),
    Step("backlog-16-rows", "benchmarks.serving.backlog", ("--workers", "2", "--batch", "16"),
         ("--workers", "2", "--batch", "16", "--backlogs", "40,240", "--repeats", "1"), OUT_DIR,
         "experiment 8 with 2 workers of 16 rows"),
    Step("chaos", "benchmarks.serving.chaos", (), _SHORT_CHAOS, CHAOS,
         "experiment 9, chaos: workers, daphne, Celery, beat and Redis killed under load"),
    Step("chaos-without-persistence", "benchmarks.serving.chaos",
         ("--redis-persistence", "none", "--duration-s", "90", "--seed", "3"),
         ("--redis-persistence", "none", "--seed", "3", *_SHORT_CHAOS), CHAOS,
         "experiment 9 on a Redis that restarts empty"),
    Step("batch_impact", "benchmarks.serving.batch_impact", (),
         ("--lines", "40", "--duration", "5"), OUT_DIR,
         "experiment 11, batch work: interactive TTFT and ITL with and without a 2,000-line "
         "batch, and the batch against the offline engine"),
    Step("batch_arrivals", "benchmarks.serving.batch_arrivals", (),
         ("--lines", "40", "--arrivals", "3", "--settle-s", "0.2"), OUT_DIR,
         "experiment 11b, what an interactive arrival waits for beside batch work in one "
         "engine: TTFT alone, beside a batch, and beside a batch whose passes never give way"),
    Step("structured", "benchmarks.structured.workload", (), ("--quick",), OUT_DIR,
         "structured outputs: JSON-schema requests against transformers generate with "
         "llguidance, mask cost, ITL beside constrained rows, jump-forward and mask overlap"),
    Step("grammar_libraries", "benchmarks.structured.grammar_libraries", (),
         ("--runs", "1", "--walks", "1"), PRINTED,
         "grammar libraries: compile and mask time of llguidance, outlines-core (and xgrammar "
         "where installed)"),
    Step("engine", "benchmarks.serving.engine", (), ("--quick", "--workloads", "c"), OUT_FILE,
         "the engine against plain transformers generate and generate_batch, fp32 and bf16, "
         "and llama.cpp's llama-server on the bf16 and Q4_1 GGUFs where built"),
    Step("llama_cpp", "benchmarks.serving.llama_cpp", (),
         ("--requests", "8", "--single-requests", "2", "--warmup", "1"), OUT_DIR,
         "the platform against llama.cpp's llama-server through each one's OpenAI endpoint "
         "(mixed and single-stream workloads; skipped where scripts/llama_cpp.sh has not built "
         "the server)"),
    Step("lora", "benchmarks.serving.lora", (),
         ("--requests", "4", "--input-len", "16-64", "--output-len", "4-8", "--concurrency", "4",
          "--max-loras", "2"), OUT_DIR,
         "experiment 13, LoRA adapters: the engine with 1, 4 and 16 adapters (a pool of 8) "
         "against the bare model, and against peft with generate, one adapter at a time"),
    Step("decode_step", "benchmarks.kernels.decode_step", (),
         ("--dtype", "float32", "--rows", "2", "--max-context", "64", "--steps", "1",
          "--repeats", "1"), OUT_FILE,
         "one decode step under each speed setting, fp32 and bf16, then the pass cost fit"),
    Step("pass_cost_fit", "benchmarks.kernels.pass_cost_fit", (),
         ("--dtype", "float32", "--repeats", "1"), PRINTED,
         "the mixed tick's pass cost model against real passes"),
    Step("prefill_flops", "benchmarks.kernels.prefill_flops", (),
         ("--dtypes", "float32", "--tokens", "256", "--repeats", "1", "--gemm-size", "512"),
         OUT_DIR, "a 1,024-token prefill's GFLOPS against the matmul peak, fp32 and bf16"),
    Step("bf16_gemm", "benchmarks.kernels.bf16_gemm", (), ("--rows", "1,16", "--repeats", "1"),
         PRINTED, "bf16 projections: the packed kernel against oneDNN"),
    Step("prefill_attention", "benchmarks.kernels.prefill_attention", (),
         ("--cases", "0:256", "--repeats", "1"), PRINTED,
         "bf16 prefill attention: the kernel against gathers"),
    Step("lm_head", "benchmarks.kernels.lm_head", (), ("--rows", "1,8", "--repeats", "1"),
         PRINTED, "a bf16 model's LM head: the native kernel against an fp32 copy"),
    Step("bf16_quality", "benchmarks.kernels.bf16_quality", (),
         ("--prompts", "2", "--max-new-tokens", "8"), OUT_DIR,
         "bf16 against fp32: identical greedy outputs and perplexity"),
    Step("quant_quality", "benchmarks.kernels.quant_quality", (),
         ("--prompts", "2", "--max-new-tokens", "8"), OUT_DIR,
         "QUANTIZATION=q4_1 against fp32: identical greedy outputs, perplexity"),
    Step("logprobs_cost", "benchmarks.kernels.logprobs_cost", (),
         ("--tokens", "32", "--rows", "2", "--repeats", "1"), PRINTED,
         "what prompt and token logprobs cost per pass"),
)
STEP_NAMES = tuple(step.name for step in STEPS)


def flags(step: Step, quick: bool, folder: Path) -> list[str]:
    """The flags of ``step``: its settings (the docs' or, with ``quick``, its smallest), then
    where it writes, under ``folder`` (the step's own folder)."""
    where = {OUT_DIR: ["--out-dir", str(folder)],
             OUT_FILE: ["--out", str(folder / f"{step.name}.json")],
             CHAOS: ["--out", str(folder / "report.json"), "--log-dir", str(folder / "logs")],
             PRINTED: []}[step.output]
    return [*(step.quick if quick else step.args), *where]


def shown(path: Path) -> str:
    """``path`` relative to the repository when it is inside it (commands read shorter)."""
    try:
        return str(path.relative_to(REPO))
    except ValueError:
        return str(path)


def listing(steps: list[Step], quick: bool, out_dir: Path) -> str:
    """The commands of ``steps``, one ``python -m`` line each after a comment naming the step
    and where its results go."""
    lines = []
    for n, step in enumerate(steps, 1):
        folder = out_dir / step.name
        lines.append(f"# [{n}/{len(steps)}] {step.name}: {step.about}; {where(step, folder)}")
        args = [shown(Path(a)) if a.startswith(str(REPO)) else a
                for a in flags(step, quick, folder)]
        lines.append(shlex.join(["python", "-m", step.module, *args]))
    return "\n".join(lines)


def where(step: Step, folder: Path) -> str:
    """Where ``step``'s results go, in words."""
    if step.output == PRINTED:
        return f"printed, kept in {shown(folder)}/output.txt"
    return f"results in {shown(folder)}/, what it printed in output.txt there"


def tee(cmd: list[str], log_path: Path) -> int:
    """Run ``cmd`` from the repository root, its output (stdout and stderr) both shown and
    written to ``log_path`` byte for byte (progress bars included); returns its exit status."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log_path, "wb") as log, subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as proc:
        assert proc.stdout is not None
        while chunk := os.read(proc.stdout.fileno(), 65536):
            sys.stdout.buffer.write(chunk)
            sys.stdout.buffer.flush()
            log.write(chunk)
        return proc.wait()


def written(folder: Path) -> list[str]:
    """The files a step left in its folder (relative to it, sorted), its printed output last."""
    names = sorted(str(p.relative_to(folder)) for p in folder.rglob("*")
                   if p.is_file() and p.name != "output.txt")
    return [*names, "output.txt"]


def run_steps(steps: list[Step], quick: bool, out_dir: Path) -> list[dict[str, Any]]:
    """Run ``steps`` in order, each into ``out_dir/<name>/``; ``summary.json`` is rewritten after
    each. Returns one record per step that ran: name, command, exit status, seconds, folder and
    files. Stops (after writing the summary) on Ctrl-C, which it raises again."""
    done: list[dict[str, Any]] = []
    for n, step in enumerate(steps, 1):
        folder = out_dir / step.name
        folder.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", step.module, *flags(step, quick, folder)]
        print(f"\n=== [{n}/{len(steps)}] {step.name}: {step.about}\n"
              f"{shlex.join(['python', *cmd[1:]])}", flush=True)
        started = time.monotonic()
        record = {"name": step.name, "command": cmd, "folder": str(folder)}
        try:
            status = tee(cmd, folder / "output.txt")
        except KeyboardInterrupt:
            record.update(returncode=130, seconds=round(time.monotonic() - started, 1),
                          files=written(folder))
            done.append(record)
            save_summary(out_dir, quick, done)
            raise
        record.update(returncode=status, seconds=round(time.monotonic() - started, 1),
                      files=written(folder))
        done.append(record)
        save_summary(out_dir, quick, done)
        print(f"=== {step.name}: exit status {status} after {record['seconds']:.0f} s; results "
              f"in {folder}/: {', '.join(record['files'])}", flush=True)
    return done


def save_summary(out_dir: Path, quick: bool, done: list[dict[str, Any]]) -> Path:
    """Write ``out_dir/summary.json``: the mode and every step run so far."""
    path = out_dir / "summary.json"
    path.write_text(json.dumps({"mode": "quick" if quick else "full", "steps": done}, indent=1))
    return path


def format_summary(done: list[dict[str, Any]]) -> str:
    """One line per step: its name, exit status, minutes and folder."""
    width = max((len(r["name"]) for r in done), default=4)
    lines = [f"{'step':<{width}}  status  minutes  results"]
    for r in done:
        lines.append(f"{r['name']:<{width}}  {r['returncode']:>6}  {r['seconds'] / 60:>7.1f}  "
                     f"{r['folder']}")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    """The command line: ``--quick``, ``--list``, ``--only`` and ``--out-dir``."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.run_all", formatter_class=HelpFormatter,
                                description="Rerun every serving experiment and micro-benchmark "
                                            "in the order and with the settings of the docs' "
                                            "figures, printing where each result went.")
    p.add_argument("--quick", action="store_true",
                   help="every step at its smallest size: a smoke run of minutes, figures that "
                        "mean nothing")
    p.add_argument("--list", action="store_true",
                   help="print the commands and where each writes, without running them")
    p.add_argument("--only", type=name_list(STEP_NAMES, "step list"), default=None,
                   metavar="LIST",
                   help=f"comma-separated steps to run, in the usual order: {', '.join(STEP_NAMES)}"
                        " (default: all)")
    p.add_argument("--out-dir", type=Path, default=None, metavar="DIR",
                   help="folder for every step's results (default: benchmarks/results/"
                        "rerun-<full|quick>-<time>/)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run (or with ``--list`` print) the steps; 0 when every step exited 0, 1 when one did not,
    130 when interrupted, 2 for bad flags."""
    args = parser().parse_args(argv)
    steps = [s for s in STEPS if args.only is None or s.name in args.only]
    mode = "quick" if args.quick else "full"
    out_dir = (args.out_dir or RESULTS_DIR / f"rerun-{mode}-{time.strftime('%Y%m%d-%H%M%S')}")
    out_dir = out_dir.absolute()
    if args.list:
        print(listing(steps, args.quick, out_dir))
        return 0
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"{len(steps)} steps ({mode}); results in {out_dir}/", flush=True)
    try:
        done = run_steps(steps, args.quick, out_dir)
    except KeyboardInterrupt:
        print(f"\ninterrupted; the finished steps' results are in {out_dir}/ "
              f"(summary.json)", file=sys.stderr)
        return 130
    print(f"\n{format_summary(done)}\nsummary: {out_dir / 'summary.json'}")
    failed = [r["name"] for r in done if r["returncode"] != 0]
    if failed:
        print(f"ERROR: failed steps: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
