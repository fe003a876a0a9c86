"""Throughput and latency of this engine against plain transformers, on the same model and prompts.

Systems (each in its own subprocess, so peak RSS is per system and no two run at once), named
``KIND`` or ``KIND:DTYPE`` with ``DTYPE`` one of ``float32`` and ``bfloat16`` (``fp32``, ``bf16``):

* ``engine``: :class:`inference.engine.llm_engine.LLMEngine` over the transformers backend,
  in-process, ticked synchronously on the main thread (no web tier); plain ``engine`` is
  ``dtype="auto"``, what a user gets by default (the run prints what it resolved to),
  ``engine:float32`` forces it;
* ``generate:DTYPE``: ``model.generate`` with static batching at the same batch size (what a user
  would write instead), the model loaded with ``from_pretrained(..., dtype=DTYPE)``: each batch
  is padded to its longest prompt and runs to its longest answer;
* ``generate_batch:DTYPE``: transformers' own continuous batching manager (the engine behind
  ``model.generate_batch``), fed by the same closed-loop client.

A peer named without a dtype is its ``float32`` run. The default set is ``engine`` and both
peers in both dtypes (:data:`DEFAULT_SYSTEMS`). Each engine row's throughput is compared with
``generate`` and ``generate_batch`` in the dtype the engine ran in, and with ``generate:float32``
(``from_pretrained``'s default on the default model folder); a summary of the targets
(:data:`TARGETS`) ends the table, printed only (PASS or MISS, never asserted).

Workloads (greedy; every request generates exactly its ``max_tokens``: EOS is ignored):

* ``a``: fixed lengths: 32 requests of 40 prompt tokens, 64 new tokens, 32 at a time;
* ``b``: mixed: 64 requests, prompts of 16 to 384 tokens, ``max_tokens`` 16 to 192, 32 at a time;
* ``c``: batch 1: requests of 40 prompt tokens and 64 new tokens, one at a time.

A closed-loop client keeps ``concurrency`` requests in flight: a new one is submitted as soon as
one finishes. TTFT is from a request's submission to its first token; ITL is the gap between a
request's consecutive tokens (seconds). Output tokens/s counts the tokens requested, not padding.

Repeats: engine rows run ``--repeats`` times on every workload (3; 1 with ``--quick``), the
peers ``--peer-repeats`` times on a and c (2; 1 with ``--quick``) and once on b, where one run
takes minutes. Medians over the runs.

Usage::

    python benchmarks/serving/engine.py            # full, 5 systems: ~27 min on 2 cores
    python benchmarks/serving/engine.py --quick    # smaller workloads, 1 repeat: ~7 min
    python benchmarks/serving/engine.py --systems engine,engine:float32,generate:float32

The durations are estimates from the fp32 systems' speeds (the earlier 3-system run took 18 min):
workload b's single runs of the four peers take about 13 of the 27 minutes. On a CPU without
native bf16 (no AVX512_BF16 or AMX) the bf16 peers run slower and the run takes longer.

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
KINDS = ("engine", "generate", "generate_batch")
DTYPES = ("float32", "bfloat16")
DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}
DEFAULT_SYSTEMS = ("engine", "generate:float32", "generate:bfloat16", "generate_batch:float32",
                   "generate_batch:bfloat16")
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


@dataclass(frozen=True)
class System:
    """One system of the comparison: ``kind`` (engine, generate, generate_batch) and ``dtype``
    (float32, bfloat16, or auto: the engine's default)."""

    kind: str
    dtype: str

    @property
    def label(self) -> str:
        """The canonical name: ``engine`` for the engine's default dtype, else ``KIND:DTYPE``."""
        return self.kind if self.dtype == "auto" else f"{self.kind}:{self.dtype}"


def parse_system(text: str) -> System:
    """``KIND`` or ``KIND:DTYPE`` as a :class:`System`.

    ``engine`` alone is the engine's default dtype (``auto``); a peer alone is its ``float32``
    run. Only the engine takes ``auto``.

    Raises:
        ValueError: for an unknown kind or dtype.
    """
    kind, sep, dtype = text.strip().partition(":")
    kind, dtype = kind.strip(), dtype.strip().lower()
    if kind not in KINDS:
        raise ValueError(f"unknown {kind!r}; choose from {', '.join(KINDS)}")
    if not sep:
        return System(kind, "auto" if kind == "engine" else "float32")
    if dtype == "auto" and kind == "engine":
        return System(kind, "auto")
    if dtype not in DTYPE_NAMES:
        allowed = ", ".join([*(["auto"] if kind == "engine" else []), *DTYPES])
        raise ValueError(f"unknown dtype {dtype!r} in {text.strip()!r}; choose from {allowed}")
    return System(kind, DTYPE_NAMES[dtype])


def system_list(text: str) -> list[System]:
    """argparse ``type`` of ``--systems``: comma-separated :func:`parse_system` names (not
    empty; duplicates merged, order kept)."""
    systems: dict[str, System] = {}
    for item in text.split(","):
        if item.strip():
            try:
                system = parse_system(item)
            except ValueError as exc:
                raise argparse.ArgumentTypeError(str(exc)) from None
            systems.setdefault(system.label, system)
    if not systems:
        raise argparse.ArgumentTypeError("empty list of systems")
    return list(systems.values())


system_list.__name__ = "system list"  # what argparse calls the type in its errors


@dataclass(frozen=True)
class Target:
    """Engine throughput at least ``factor`` times ``peer``'s on workload ``workload``; ``peer``
    is ``KIND:DTYPE``, or ``KIND:same`` for the peer in the dtype the engine ran in."""

    workload: str
    peer: str
    factor: float


TARGETS = (
    Target("b", "generate:float32", 4.0),
    Target("b", "generate:bfloat16", 2.5),
    Target("b", "generate_batch:bfloat16", 3.0),
    Target("a", "generate:same", 1.2),
    Target("c", "generate:same", 1.2),
)


def _tok_s(row: dict | None) -> float | None:
    value = ((row or {}).get("median") or {}).get("output_tok_s")
    return value if value else None


def peer_label(kind: str, dtype: str | None) -> str | None:
    """The label of peer ``kind`` in ``dtype`` (a resolved dtype name); None without one."""
    return f"{kind}:{dtype}" if dtype in DTYPES else None


def ratios(rows: dict[str, dict]) -> dict[str, dict[str, float | None]]:
    """Throughput ratios of every row of one workload.

    Args:
        rows: label -> ``{"dtype": resolved dtype name, "median": {"output_tok_s": ...}}``.

    Returns:
        label -> ``x_gen`` and ``x_gb`` (to ``generate`` and ``generate_batch`` in the row's own
        dtype) and ``x_gen_fp32`` (to ``generate:float32``); None where that peer is missing or
        failed.
    """
    out: dict[str, dict[str, float | None]] = {}
    for label, row in rows.items():
        mine, dtype = _tok_s(row), row.get("dtype")

        def to(peer: str | None, mine: float | None = mine) -> float | None:
            base = _tok_s(rows.get(peer)) if peer else None
            return mine / base if mine and base else None

        out[label] = {"x_gen": to(peer_label("generate", dtype)),
                      "x_gb": to(peer_label("generate_batch", dtype)),
                      "x_gen_fp32": to("generate:float32")}
    return out


def check_targets(results: dict[str, dict[str, dict]]) -> list[dict]:
    """Each engine row's :data:`TARGETS` against the results (workload -> label -> row).

    Returns:
        One dict per engine row and target of a workload in the results: ``engine``,
        ``workload``, ``peer`` (the label compared with), ``factor`` (needed), ``measured`` (the
        ratio, None where either side is missing or failed) and ``verdict`` (``PASS``, ``MISS``,
        or ``n/a`` without a measurement).
    """
    engines = list(dict.fromkeys(label for rows in results.values() for label in rows
                                 if label.split(":")[0] == "engine"))
    checks = []
    for engine in engines:
        for target in TARGETS:
            if target.workload not in results:
                continue
            rows = results[target.workload]
            dtype = (rows.get(engine) or {}).get("dtype")
            kind, _, want = target.peer.partition(":")
            peer = peer_label(kind, dtype) if want == "same" else target.peer
            mine, base = _tok_s(rows.get(engine)), _tok_s(rows.get(peer)) if peer else None
            measured = mine / base if mine and base else None
            verdict = "n/a" if measured is None else (
                "PASS" if measured >= target.factor else "MISS")
            checks.append({"engine": engine, "workload": target.workload,
                           "peer": peer or f"{kind} in {dtype or 'its dtype'}",
                           "factor": target.factor, "measured": measured, "verdict": verdict})
    return checks


def format_targets(checks: list[dict]) -> str:
    """The targets summary: one line per check, e.g.
    ``b  engine >= 4.00x generate:float32: 4.31x  PASS``."""
    lines = []
    for c in checks:
        got = "not measured" if c["measured"] is None else f"{c['measured']:.2f}x"
        lines.append(f"{c['workload']}  {c['engine']} >= {c['factor']:.2f}x {c['peer']}: "
                     f"{got}  {c['verdict']}")
    return "\n".join(lines)


def planned_runs(system: System, workload: str, repeats: int, peer_repeats: int) -> int:
    """Runs of ``system`` on ``workload``: ``repeats`` for the engine, ``peer_repeats`` for a
    peer, and one for a peer on workload b (several minutes a run)."""
    if system.kind == "engine":
        return repeats
    return 1 if workload == "b" else peer_repeats


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


def run_engine(model_path: str, dtype: str, wl: Workload) -> list[Trace]:
    """The engine in ``dtype`` (``auto``: its default), ticked on this (the only torch) thread,
    fed by a closed-loop client."""
    from inference.engine.llm_engine import LLMEngine
    from inference.engine.request import FinalEvent, SamplingParams

    backend = _engine_backend(model_path, dtype)
    longest = max(len(s.prompt) + s.max_tokens for s in wl.requests)
    blocks = wl.concurrency * (-(-longest // KV_BLOCK_SIZE) + 1) + 16
    from inference.engine.config import EngineConfig

    traces: dict[str, Trace] = {}

    def stamp(events: list) -> None:
        # Called as the engine emits: a promoted row's first token goes out before the tick's
        # decode step (as the worker streams it), so it is not stamped at the end of step().
        now = time.perf_counter()
        for event in events:
            if not isinstance(event, FinalEvent):
                traces[event.request_id].token_times.append(now)

    engine = LLMEngine(EngineConfig(max_batch_size=wl.concurrency, kv_num_blocks=blocks,
                                    kv_block_size=KV_BLOCK_SIZE, max_pending=10_000,
                                    **ENGINE_SETTINGS),
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


def _engine_backend(model_path: str, dtype: str):
    global _BACKEND
    if _BACKEND is None:
        from inference.engine.backends.hf import TransformersBackend

        _BACKEND = TransformersBackend.from_pretrained(model_path, dtype=dtype)
    return _BACKEND


_HF = None
_GB = None  # the generate_batch manager of this process
_GB_RUNS = 0
_PLAN = None  # the workload this process measures (sizes long-lived state)
# The engine's PREFILL_MODE and TARGET_ITL_MS (empty / None: its defaults), from the flags.
ENGINE_SETTINGS: dict[str, object] = {}


def _hf_model(model_path: str, dtype: str):
    """The transformers model of this process, loaded in ``dtype`` (float32 or bfloat16)."""
    global _HF
    if _HF is None:
        import torch
        from transformers import AutoModelForCausalLM

        _HF = AutoModelForCausalLM.from_pretrained(model_path,
                                                   dtype=getattr(torch, dtype)).eval()
    return _HF


def run_generate(model_path: str, dtype: str, wl: Workload) -> list[Trace]:
    """Static batching: batches of ``concurrency`` requests, left-padded, run to the longest."""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    model = _hf_model(model_path, dtype)
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


def run_generate_batch(model_path: str, dtype: str, wl: Workload) -> list[Trace]:
    """transformers' continuous batching manager, fed by the closed-loop client."""
    global _GB_RUNS
    manager = _gb_manager(_hf_model(model_path, dtype), _PLAN or wl)
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


def resolved_dtype() -> str:
    """The dtype this process's model runs in (e.g. ``bfloat16``), once loaded; else ``""``."""
    model = _BACKEND if _BACKEND is not None else _HF
    return str(model.dtype).removeprefix("torch.") if model is not None else ""


def worker(system: System, workload: str, quick: bool, repeats: int, out: Path) -> None:
    """Run one system on one workload ``repeats`` times (after a warm-up) and write JSON."""
    sys.path.insert(0, str(REPO))
    from inference.engine.model_store import resolve_model_path
    from inference.protocol.settings import PlatformSettings
    from inference.tokenization import Tokenizer

    shared = PlatformSettings()
    model_path = str(resolve_model_path(shared.model_path, shared.model_cache_dir))
    corpus_ids = Tokenizer.from_folder(model_path).encode(CORPUS * 8)
    wl = build_workload(workload, quick, corpus_ids)
    runner = RUNNERS[system.kind]
    global _PLAN
    _PLAN = wl  # what the warm-up sizes a long-lived manager for
    warm = Workload("warm-up", "", [Spec(corpus_ids[:24], 4), Spec(corpus_ids[30:40], 4)], 2)
    runner(model_path, system.dtype, warm)
    runs = []
    for _ in range(repeats):
        cpu_before = _cpu_jiffies()
        started = time.perf_counter()
        traces = runner(model_path, system.dtype, wl)
        ended = time.perf_counter()
        cpu_after = _cpu_jiffies()
        runs.append(summarize(traces, started, ended))
        # Cores kept busy by other processes meanwhile: a noisy machine shows up here.
        foreign = (cpu_after[0] - cpu_before[0]) - (cpu_after[1] - cpu_before[1])
        runs[-1]["foreign_cores"] = foreign / os.sysconf("SC_CLK_TCK") / (ended - started)
        expected = sum(s.max_tokens for s in wl.requests)
        got = runs[-1]["output_tokens"]
        if got != expected:
            raise RuntimeError(f"{system.label} produced {got} tokens, expected {expected}")
    if _GB is not None:
        _GB.stop(block=True, timeout=10)
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out.write_text(json.dumps({"runs": runs, "peak_rss_bytes": peak_rss,
                               "description": wl.description, "dtype": resolved_dtype()}))


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


def run_one(system: System, workload: str, quick: bool, repeats: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", system.label,
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


DTYPE_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def format_table(results: dict[str, dict[str, dict]]) -> str:
    """The results (workload -> system label -> row) as a table, with :func:`ratios`."""
    head = (f"{'wl':<3}{'system':<24}{'dtype':>6}{'tok/s':>8}{'x gen':>7}{'x gb':>7}"
            f"{'x gen32':>8}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}{'ITL p99':>9}"
            f"{'RSS MB':>8}{'runs':>5}{'busy':>6}")
    lines = [head, "-" * len(head)]
    for wl, systems in results.items():
        by_label = ratios(systems)
        for system, r in systems.items():
            if "error" in r:
                lines.append(f"{wl:<3}{system:<24}  failed: {r['error'].splitlines()[-1][:80]}")
                continue
            m, x = r["median"], by_label[system]

            def fmt(value: float | None) -> str:
                return "-" if value is None else f"{value:.2f}"

            dtype = r.get("dtype", "")
            lines.append(
                f"{wl:<3}{system:<24}{DTYPE_SHORT.get(dtype, dtype):>6}"
                f"{m['output_tok_s']:>8.1f}{fmt(x['x_gen']):>7}{fmt(x['x_gb']):>7}"
                f"{fmt(x['x_gen_fp32']):>8}{m['ttft_p50_s']:>9.2f}s{m['ttft_p99_s']:>9.2f}s"
                f"{m['itl_p50_s'] * 1000:>7.0f}ms{m['itl_p99_s'] * 1000:>7.0f}ms"
                f"{r['peak_rss_bytes'] / 2**20:>8.0f}{len(r['runs']):>5}"
                f"{m.get('foreign_cores', 0):>6.2f}")
    return "\n".join(lines)


def engine_dtypes(results: dict[str, dict[str, dict]]) -> dict[str, str]:
    """Engine label -> the dtype it ran in (what ``auto`` resolved to, for plain ``engine``)."""
    found: dict[str, str] = {}
    for rows in results.values():
        for label, row in rows.items():
            if label.split(":")[0] == "engine" and row.get("dtype"):
                found.setdefault(label, row["dtype"])
    return found


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(REPO))
    from benchmarks.harness.cli import HelpFormatter, name_list, positive_int

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=HelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller workloads, one repeat")
    parser.add_argument("--systems", type=system_list, default=",".join(DEFAULT_SYSTEMS),
                        metavar="LIST",
                        help="comma-separated systems to run: KIND or KIND:DTYPE, KIND one of "
                             f"{', '.join(KINDS)}, DTYPE one of {', '.join(DTYPES)} (fp32, "
                             "bf16); engine alone is its default dtype (auto), a peer alone "
                             "float32")
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
    systems, workloads = args.systems, args.workloads
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
    checks = check_targets(results)
    if checks:
        print("\ntargets (throughput ratios; printed, not asserted):")
        print(format_targets(checks))
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


def save(out: Path, quick: bool, descriptions: dict[str, str],
         results: dict[str, dict[str, dict]]) -> None:
    """Write the figures so far, with their ratios, targets and table, as JSON."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "mode": "quick" if quick else "full",
        "machine": {"cpus": os.cpu_count(), "platform": sys.platform},
        "workloads": descriptions,
        "engine_dtypes": engine_dtypes(results),
        "results": results,
        "ratios": {wl: ratios(rows) for wl, rows in results.items()},
        "targets": check_targets(results),
        "table": format_table(results),
    }, indent=2, default=lambda o: asdict(o)))


if __name__ == "__main__":
    sys.exit(main())
