"""The LoRA benchmark's peer: what a user writes with ``peft`` and transformers instead.

The requests are grouped by adapter (the bare model's requests apart). For each adapter,
``PeftModel.from_pretrained(base, folder)`` wraps the base model (unmerged, as a user loads
one; timed), its requests run through ``generate`` in static batches of up to ``concurrency``
(:func:`benchmarks.serving.engine.worker.generate_static`, the engine benchmark's transformers
peer: left padding, greedy, each batch run to its longest ``max_tokens`` and each request counted
for its own), then ``unload()`` gives the base model back for the next adapter. The token times
become :class:`~benchmarks.harness.metrics.RequestResult` on a clock that runs only while
``generate`` does: the figures leave the adapters' load times out (reported apart).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from benchmarks.harness.metrics import RequestResult
from benchmarks.harness.workload import RequestSpec
from benchmarks.serving.engine.workloads import Spec, Trace, Workload


def load_base(folder: str, dtype: str, device: Any) -> Any:
    """The model from ``folder`` in ``dtype`` (``float32``, ``bfloat16``) on ``device``."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype))
    return model.to(device).eval()


def run_peft(folder: str, dtype: str, device: Any, specs: Sequence[RequestSpec],
             prompts: Sequence[list[int]], concurrency: int) -> dict[str, Any]:
    """``specs`` (their token ids ``prompts``) one adapter at a time (module docstring).

    Returns:
        ``results`` (in the order of ``specs``), ``duration_s`` (seconds in ``generate``),
        ``load_s`` (each ``PeftModel.from_pretrained``'s seconds) and ``groups`` (per adapter:
        its name, requests, load and generate seconds).
    """
    from peft import PeftModel

    from benchmarks.serving.engine.worker import generate_static

    base = load_base(folder, dtype, device)
    groups: dict[str, list[int]] = {}
    for i, spec in enumerate(specs):
        groups.setdefault(spec.adapter.path if spec.adapter else "", []).append(i)
    _warm_up(base, prompts[0], next((p for p in groups if p), ""))
    results: list[RequestResult | None] = [None] * len(specs)
    generating = 0.0  # the clock of the figures: seconds spent in generate so far
    loads, summary = [], []
    for path, indices in sorted(groups.items(), key=lambda kv: (kv[0] == "", kv[0])):
        load_s = 0.0
        model = base
        if path:
            started = time.perf_counter()
            model = PeftModel.from_pretrained(base, path)
            load_s = time.perf_counter() - started
            loads.append(load_s)
        wl = Workload("peft", "", [Spec(list(prompts[i]), specs[i].max_tokens) for i in indices],
                      concurrency)
        started = time.perf_counter()
        traces = generate_static(model, wl)
        took = time.perf_counter() - started
        for i, trace in zip(indices, traces, strict=True):
            results[i] = _result(specs[i], len(prompts[i]), trace, started - generating)
        generating += took
        if path:
            base = model.unload()  # the base model, its LoRA layers taken out
        summary.append({"adapter": specs[indices[0]].tag, "requests": len(indices),
                        "load_s": round(load_s, 4), "generate_s": round(took, 3)})
    done = [r for r in results if r is not None]
    return {"results": done, "duration_s": generating, "load_s": loads, "groups": summary}


def _warm_up(base: Any, prompt: list[int], adapter_path: str) -> None:
    """A few tokens through the base model and through one adapter (loaded, then unloaded), so
    that no measured batch or load pays a first call's costs."""
    from peft import PeftModel

    from benchmarks.serving.engine.worker import generate_static

    warm = Workload("warm-up", "", [Spec(prompt[:16], 4), Spec(prompt[:8], 4)], 2)
    generate_static(base, warm)
    if adapter_path:
        model = PeftModel.from_pretrained(base, adapter_path)
        generate_static(model, warm)
        model.unload()


def _result(spec: RequestSpec, prompt_len: int, trace: Trace, origin: float) -> RequestResult:
    """One request's trace as what it saw, times in seconds from ``origin`` (perf_counter)."""
    times = [t - origin for t in trace.token_times]
    return RequestResult(spec.tenant, spec.tag, "ok", 200, trace.submitted - origin,
                         chunk_times_s=times, ended_s=times[-1] if times else 0.0,
                         prompt_tokens=prompt_len, output_tokens=len(times),
                         max_tokens=spec.max_tokens)
