"""Throughput and latency of this engine against plain transformers, on the same model and prompts.

Systems (each in its own subprocess, so peak RSS is per system and no two run at once):

* ``engine``: :class:`inference.engine.LLMEngine` over the transformers backend, in-process,
  ticked synchronously on the main thread (no web tier);
* ``generate``: ``model.generate`` with static batching at the same batch size (what a user
  would write instead): each batch is padded to its longest prompt and runs to its longest answer;
* ``generate_batch``: transformers' own continuous batching manager (the engine behind
  ``model.generate_batch``), fed by the same closed-loop client.

Workloads (greedy; every request generates exactly its ``max_tokens``: EOS is ignored):

* ``a``: fixed lengths: 32 requests of 40 prompt tokens, 64 new tokens, 32 at a time;
* ``b``: mixed: 64 requests, prompts of 16 to 384 tokens, ``max_tokens`` 16 to 192, 32 at a time;
* ``c``: batch 1: requests of 40 prompt tokens and 64 new tokens, one at a time.

A closed-loop client keeps ``concurrency`` requests in flight: a new one is submitted as soon as
one finishes. TTFT is from a request's submission to its first token; ITL is the gap between a
request's consecutive tokens (seconds). Output tokens/s counts the tokens requested, not padding.

Usage::

    python benchmarks/bench_engine.py            # full: medians of 3 repeats, ~18 min on 2 cores
    python benchmarks/bench_engine.py --quick    # smaller workloads, 1 repeat, ~4 min

The table is printed and saved as JSON under ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO / "benchmarks" / "results"
SYSTEMS = ("engine", "generate", "generate_batch")
WORKLOADS = ("a", "b", "c")
KV_BLOCK_SIZE = 16
SEED = 1234
WORKER_TIMEOUT_S = 1500
# Tokens per forward pass of generate_batch: the engine's prefill chunk (256) plus its decode rows.
GB_MAX_BATCH_TOKENS = 512

# Prompts are slices of real prose (flat random token ids would make an atypical workload).
CORPUS = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a can of oil "
    "and a cloth to polish the great lens. Photosynthesis converts light energy into chemical "
    "energy: plants absorb carbon dioxide through their leaves and water through their roots. "
    "In 1869 the first transcontinental railroad in the United States was completed at "
    "Promontory Summit in Utah. To bake bread, mix flour, water, yeast and salt, knead the dough, "
    "let it rise, shape it and bake it until the crust is golden. The Python standard library "
    "has modules for files, dates, regular expressions, networking, JSON and CSV. "
)


@dataclass
class Spec:
    """One request of a workload: its prompt and how many tokens it generates."""

    prompt: list[int]
    max_tokens: int


@dataclass
class Workload:
    name: str
    description: str
    requests: list[Spec]
    concurrency: int


def build_workload(name: str, quick: bool, corpus_ids: list[int]) -> Workload:
    """The deterministic requests of workload ``name`` (the same for every system)."""
    rng = random.Random(f"{SEED}-{name}-{quick}")

    def prompt(length: int) -> list[int]:
        start = rng.randrange(0, len(corpus_ids) - length)
        return corpus_ids[start:start + length]

    if name == "a":
        n_new = 32 if quick else 64
        reqs = [Spec(prompt(40), n_new) for _ in range(32)]
        return Workload(name, f"fixed: 32 x (40 prompt + {n_new} new), 32 concurrent", reqs, 32)
    if name == "b":
        count, conc, top = (24, 12, 96) if quick else (64, 32, 192)
        reqs = [Spec(prompt(rng.randint(16, 384)), rng.randint(16, top)) for _ in range(count)]
        return Workload(name, f"mixed: {count} reqs, prompts 16-384, max_tokens 16-{top}, "
                              f"{conc} concurrent", reqs, conc)
    if name == "c":
        count, n_new = (2, 32) if quick else (4, 64)
        reqs = [Spec(prompt(40), n_new) for _ in range(count)]
        return Workload(name, f"batch 1: {count} x (40 prompt + {n_new} new), 1 at a time",
                        reqs, 1)
    raise ValueError(f"unknown workload {name!r}")


# --------------------------------------------------------------------------- measurement


@dataclass
class Trace:
    """Per-request submission time and token times (``time.perf_counter`` seconds)."""

    submitted: float
    token_times: list[float]


def summarize(traces: list[Trace], started: float, ended: float) -> dict[str, float]:
    """Output tokens/s, TTFT and ITL percentiles (seconds) of one run."""
    tokens = sum(len(t.token_times) for t in traces)
    ttft = [t.token_times[0] - t.submitted for t in traces if t.token_times]
    itl = [b - a for t in traces for a, b in zip(t.token_times, t.token_times[1:], strict=False)]
    return {
        "output_tokens": tokens,
        "wall_s": ended - started,
        "output_tok_s": tokens / (ended - started),
        "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
        "itl_p50_s": _pct(itl, 50), "itl_p99_s": _pct(itl, 99),
    }


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def run_engine(model_path: str, wl: Workload) -> list[Trace]:
    """The engine, ticked on this (the only torch) thread, fed by a closed-loop client."""
    from inference.engine import LLMEngine
    from inference.request import FinalEvent, SamplingParams

    backend = _engine_backend(model_path)
    longest = max(len(s.prompt) + s.max_tokens for s in wl.requests)
    blocks = wl.concurrency * (-(-longest // KV_BLOCK_SIZE) + 1) + 16
    from inference.config import EngineConfig

    traces: dict[str, Trace] = {}

    def stamp(events: list) -> None:
        # Called as the engine emits: a promoted row's first token goes out before the tick's
        # decode step (as the worker streams it), so it is not stamped at the end of step().
        now = time.perf_counter()
        for event in events:
            if not isinstance(event, FinalEvent):
                traces[event.request_id].token_times.append(now)

    engine = LLMEngine(EngineConfig(max_batch_size=wl.concurrency, kv_num_blocks=blocks,
                                    kv_block_size=KV_BLOCK_SIZE, max_pending=10_000),
                       backend, event_sink=stamp)
    todo = list(enumerate(wl.requests))
    live = 0

    def submit() -> None:
        nonlocal live
        i, spec = todo.pop(0)
        rid = f"r{i}"
        traces[rid] = Trace(time.perf_counter(), [])
        engine.submit(prompt_token_ids=spec.prompt, request_id=rid,
                      sampling=SamplingParams(max_tokens=spec.max_tokens, ignore_eos=True))
        live += 1

    while todo and live < wl.concurrency:
        submit()
    while live:
        for event in engine.step():
            if isinstance(event, FinalEvent):
                live -= 1
                if todo:
                    submit()
    return [traces[f"r{i}"] for i in range(len(wl.requests))]


_BACKEND = None


def _engine_backend(model_path: str):
    global _BACKEND
    if _BACKEND is None:
        from inference.backends.hf import TransformersBackend

        _BACKEND = TransformersBackend.from_pretrained(model_path)
    return _BACKEND


_HF = None
_GB = None  # the generate_batch manager of this process
_GB_RUNS = 0
_PLAN = None  # the workload this process measures (sizes long-lived state)


def _hf_model(model_path: str):
    global _HF
    if _HF is None:
        import torch
        from transformers import AutoModelForCausalLM

        _HF = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    return _HF


def run_generate(model_path: str, wl: Workload) -> list[Trace]:
    """Static batching: batches of ``concurrency`` requests, left-padded, run to the longest."""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    model = _hf_model(model_path)
    pad = model.generation_config.pad_token_id
    pad = pad if pad is not None else model.config.eos_token_id
    traces: list[Trace] = []

    class StepClock(StoppingCriteria):
        """Called once after every generation step: records when each step's tokens exist."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids, scores, **kwargs):  # noqa: ANN001 - transformers' signature
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    for first in range(0, len(wl.requests), wl.concurrency):
        batch = wl.requests[first:first + wl.concurrency]
        width = max(len(s.prompt) for s in batch)
        ids = torch.tensor([[pad] * (width - len(s.prompt)) + s.prompt for s in batch])
        mask = torch.tensor([[0] * (width - len(s.prompt)) + [1] * len(s.prompt) for s in batch])
        n_new = max(s.max_tokens for s in batch)
        clock = StepClock()
        submitted = time.perf_counter()
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n_new,
                           min_new_tokens=n_new, do_sample=False, pad_token_id=pad,
                           stopping_criteria=StoppingCriteriaList([clock]))
        for s in batch:
            traces.append(Trace(submitted, clock.times[:s.max_tokens]))
    return traces


def _gb_manager(model, wl: Workload):
    """The process's one continuous-batching manager, sized for workload ``wl``.

    A user keeps one manager and feeds it; creating one per run would charge each run several
    seconds of start-up. Its KV cache is sized to the workload, as the engine's pool is: left to
    its defaults it takes most of the machine's free memory, and its attention mask grows with
    the cache.
    """
    global _GB
    if _GB is None:
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        longest = max(len(s.prompt) + s.max_tokens for s in wl.requests)
        page = 256
        config = GenerationConfig(max_new_tokens=max(s.max_tokens for s in wl.requests),
                                  do_sample=False, eos_token_id=-1)
        cb_config = ContinuousBatchingConfig(
            page_size=page, num_blocks=wl.concurrency * (-(-longest // page) + 1),
            max_batch_tokens=GB_MAX_BATCH_TOKENS, max_requests_per_batch=wl.concurrency)
        _GB = model.init_continuous_batching(generation_config=config,
                                             continuous_batching_config=cb_config)
        _GB.start()
    return _GB


def run_generate_batch(model_path: str, wl: Workload) -> list[Trace]:
    """transformers' continuous batching manager, fed by the closed-loop client."""
    global _GB_RUNS
    manager = _gb_manager(_hf_model(model_path), _PLAN or wl)
    _GB_RUNS += 1
    tag = f"run{_GB_RUNS}-"
    traces: dict[str, Trace] = {}
    todo = list(enumerate(wl.requests))
    live = 0

    def submit() -> None:
        nonlocal live
        i, spec = todo.pop(0)
        rid = f"{tag}r{i}"
        traces[rid] = Trace(time.perf_counter(), [])
        manager.add_request(spec.prompt, request_id=rid, max_new_tokens=spec.max_tokens,
                            record_timestamps=True, eos_token_id=-1)
        live += 1

    while todo and live < wl.concurrency:
        submit()
    deadline = time.monotonic() + WORKER_TIMEOUT_S
    while live:
        result = manager.get_result(timeout=1)
        if time.monotonic() > deadline:
            raise TimeoutError("generate_batch did not finish")
        if result is None or not result.is_finished():
            continue
        if result.error:
            raise RuntimeError(f"generate_batch failed: {result.error}")
        traces[result.request_id].token_times = list(result.timestamps or [])
        live -= 1
        if todo:
            submit()
    return [traces[f"{tag}r{i}"] for i in range(len(wl.requests))]


RUNNERS = {"engine": run_engine, "generate": run_generate, "generate_batch": run_generate_batch}


def worker(system: str, workload: str, quick: bool, repeats: int, out: Path) -> None:
    """Run one system on one workload ``repeats`` times (after a warm-up) and write JSON."""
    sys.path.insert(0, str(REPO))
    from inference.model_store import resolve_model_path
    from inference.protocol import PlatformSettings
    from inference.tokenization import Tokenizer

    shared = PlatformSettings()
    model_path = str(resolve_model_path(shared.model_path, shared.model_cache_dir))
    corpus_ids = Tokenizer.from_folder(model_path).encode(CORPUS * 8)
    wl = build_workload(workload, quick, corpus_ids)
    runner = RUNNERS[system]
    global _PLAN
    _PLAN = wl  # what the warm-up sizes a long-lived manager for
    warm = Workload("warm-up", "", [Spec(corpus_ids[:24], 4), Spec(corpus_ids[30:40], 4)], 2)
    runner(model_path, warm)
    runs = []
    for _ in range(repeats):
        cpu_before = _cpu_jiffies()
        started = time.perf_counter()
        traces = runner(model_path, wl)
        ended = time.perf_counter()
        cpu_after = _cpu_jiffies()
        runs.append(summarize(traces, started, ended))
        # Cores kept busy by other processes meanwhile: a noisy machine shows up here.
        foreign = (cpu_after[0] - cpu_before[0]) - (cpu_after[1] - cpu_before[1])
        runs[-1]["foreign_cores"] = foreign / os.sysconf("SC_CLK_TCK") / (ended - started)
        expected = sum(s.max_tokens for s in wl.requests)
        got = runs[-1]["output_tokens"]
        if got != expected:
            raise RuntimeError(f"{system} produced {got} tokens, expected {expected}")
    if _GB is not None:
        _GB.stop(block=True, timeout=10)
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out.write_text(json.dumps({"runs": runs, "peak_rss_bytes": peak_rss,
                               "description": wl.description}))


def _cpu_jiffies() -> tuple[int, int]:
    """(busy jiffies of the whole machine, jiffies of this process); (0, 0) where unknown."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        busy = sum(int(x) for x in fields) - int(fields[3]) - int(fields[4])  # minus idle, iowait
        own = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        return busy, int(own[11]) + int(own[12])  # utime + stime
    except (OSError, IndexError, ValueError):
        return 0, 0


# --------------------------------------------------------------------------- orchestration


def median_run(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def run_one(system: str, workload: str, quick: bool, repeats: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", system,
               "--workload", workload, "--repeats", str(repeats), "--result", str(out)]
        if quick:
            cmd.append("--quick")
        started = time.monotonic()
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True,
                              timeout=WORKER_TIMEOUT_S)
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stderr or proc.stdout)[-2000:]
            return {"error": f"exit {proc.returncode}: {tail}"}
        result = json.loads(out.read_text())
    result["process_s"] = time.monotonic() - started
    return result


def format_table(results: dict[str, dict[str, dict]]) -> str:
    head = (f"{'wl':<3}{'system':<16}{'tok/s':>8}{'x gen':>7}{'x gb':>7}{'TTFT p50':>10}"
            f"{'TTFT p99':>10}{'ITL p50':>9}{'ITL p99':>9}{'RSS MB':>8}{'runs':>5}{'busy':>6}")
    lines = [head, "-" * len(head)]
    for wl, systems in results.items():
        base = {s: r.get("median", {}).get("output_tok_s") for s, r in systems.items()}
        for system, r in systems.items():
            if "error" in r:
                lines.append(f"{wl:<3}{system:<16}  failed: {r['error'].splitlines()[-1][:80]}")
                continue
            m = r["median"]

            def ratio(other: str, m: dict = m, base: dict = base) -> str:
                b = base.get(other)
                return f"{m['output_tok_s'] / b:.2f}" if b else "-"

            lines.append(
                f"{wl:<3}{system:<16}{m['output_tok_s']:>8.1f}{ratio('generate'):>7}"
                f"{ratio('generate_batch'):>7}{m['ttft_p50_s']:>9.2f}s{m['ttft_p99_s']:>9.2f}s"
                f"{m['itl_p50_s'] * 1000:>7.0f}ms{m['itl_p99_s'] * 1000:>7.0f}ms"
                f"{r['peak_rss_bytes'] / 2**20:>8.0f}{len(r['runs']):>5}"
                f"{m.get('foreign_cores', 0):>6.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(REPO))
    from benchmarks.cli import HelpFormatter, name_list, positive_int

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=HelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller workloads, one repeat")
    parser.add_argument("--systems", type=name_list(SYSTEMS), default=",".join(SYSTEMS),
                        metavar="LIST",
                        help=f"comma-separated systems to run, out of {', '.join(SYSTEMS)}")
    parser.add_argument("--workloads", type=name_list(WORKLOADS), default=",".join(WORKLOADS),
                        metavar="LIST",
                        help=f"comma-separated workloads to run, out of {', '.join(WORKLOADS)}")
    parser.add_argument("--repeats", type=positive_int, default=None, metavar="N",
                        help="repeats per system and workload, at least 1 (default: 1 with "
                             "--quick, else 3; the peers run workload b once)")
    parser.add_argument("--out", type=out_file, default=None, metavar="FILE",
                        help="JSON file to write, rewritten after every run so that an "
                             "interrupted benchmark keeps the figures of the runs that finished; "
                             "missing folders are created (default: benchmarks/results/"
                             "bench-<quick|full>-<time>.json)")
    parser.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--workload", choices=WORKLOADS, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.workload, args.quick, args.repeats or 1, args.result)
        return 0

    repeats = args.repeats or (1 if args.quick else 3)
    systems, workloads = args.systems, args.workloads
    results: dict[str, dict[str, dict]] = {}
    descriptions: dict[str, str] = {}
    started = time.monotonic()
    out = args.out or RESULTS_DIR / f"bench-{'quick' if args.quick else 'full'}-" \
                                    f"{time.strftime('%Y%m%d-%H%M%S')}.json"
    try:
        run_all(systems, workloads, repeats, args.quick, out, results, descriptions, started)
    except KeyboardInterrupt:
        kept = f"the finished runs' figures are in {out}" if out.exists() else "no run finished"
        print(f"\ninterrupted: {kept}", file=sys.stderr)
        return 130
    table = format_table(results)
    print()
    for wl, text in descriptions.items():
        print(f"workload {wl}: {text}")
    print(table)
    print(f"\ntotal {time.monotonic() - started:.0f} s; medians over runs; x gen / x gb: "
          "throughput ratio to generate / generate_batch; busy: cores other processes kept "
          "busy meanwhile (noise)")
    save(out, args.quick, descriptions, results)
    print(f"saved {out}")
    failed = [f"{system} on {wl}" for wl, by_system in results.items()
              for system, r in by_system.items() if "error" in r]
    if failed:
        print(f"ERROR: failed runs: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


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


def run_all(systems: list[str], workloads: list[str], repeats: int, quick: bool, out: Path,
            results: dict[str, dict[str, dict]], descriptions: dict[str, str],
            started: float) -> None:
    """Run every system on every workload ``repeats`` times, saving ``out`` after each run."""
    # Systems take turns, one run per process, so a slow spell of a shared machine hits them
    # alike rather than all the runs of one system.
    for wl in workloads:
        results[wl] = {}
        for rep in range(repeats):
            for system in systems:
                if rep and wl == "b" and system != "engine":
                    continue  # the peers take minutes on the mixed workload: one run
                if "error" in results[wl].get(system, {}):
                    continue
                print(f"[{time.monotonic() - started:6.0f}s] {system} on workload {wl}, "
                      f"run {rep + 1} ...", flush=True)
                one = run_one(system, wl, quick, 1)
                descriptions[wl] = one.pop("description", descriptions.get(wl, ""))
                merged = results[wl].setdefault(system, {"runs": [], "peak_rss_bytes": 0})
                if "error" in one:
                    merged["error"] = one["error"]
                    continue
                merged["runs"] += one["runs"]
                merged["peak_rss_bytes"] = max(merged["peak_rss_bytes"], one["peak_rss_bytes"])
                merged["median"] = median_run(merged["runs"])
                save(out, quick, descriptions, results)  # an interrupted run keeps its figures


def save(out: Path, quick: bool, descriptions: dict[str, str],
         results: dict[str, dict[str, dict]]) -> None:
    """Write the figures so far, with their table, as JSON."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "mode": "quick" if quick else "full",
        "machine": {"cpus": os.cpu_count(), "platform": sys.platform},
        "workloads": descriptions,
        "results": results,
        "table": format_table(results),
    }, indent=2, default=lambda o: asdict(o)))


if __name__ == "__main__":
    sys.exit(main())
