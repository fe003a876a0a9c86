"""Prefill against the machine's matrix-product peak: achieved GFLOPS of a 1,024-token prompt.

On the transformers backend (the default model unless ``MODEL_PATH`` is set), in each dtype of
``--dtypes`` side by side:

(i) ``backend``: one forward pass of the whole prompt, ``TransformersBackend.prefill`` with one
    :class:`~inference.engine.backends.base.PrefillChunk` of ``--tokens`` tokens into a KV pool just
    big enough;
    Where a bf16 model's layers run one native call each (``fused_prefill``), the same pass
    with each layer's PyTorch operations instead is timed beside it (``backend_torch_layers``);
(ii) ``engine``: the same prompt through an :class:`~inference.engine.llm_engine.LLMEngine` with its
    default settings (``max_tokens=1``), timed from submission to the first token: this includes
    the engine's chunking by ``PREFILL_CHUNK_SIZE``, its scheduling and sampling. Every repeat
    sends a different prompt, so that no prefix-cache hit shortens it.

Each figure is the median of ``--repeats`` runs after one warm-up. Achieved GFLOPS is the FLOPs
the prompt needs (below) over that time; tokens/s is the prompt's tokens over it.

FLOPs of a prefill of ``T`` tokens (a multiply-add is 2 FLOPs)::

    FLOPs = 2 * W * T  +  2 * V * H  +  4 * L * n_heads * d_head * sum_{i=1..T} i

* ``W``, the non-embedding matmul weights every token passes through (per model):
  ``L * (H * (n_heads + 2 * n_kv_heads) * d_head   [q, k, v]
  + n_heads * d_head * H   [o]  +  2 * I * H   [gate, up]  +  I * H   [down])``;
* ``V * H``: the LM head, for the last token only (the one whose logits are sampled);
* attention: ``QK^T`` and ``PV`` (2 x 2 FLOPs per query, key and head dimension), causal: the
  query at position ``i`` (from 1) attends ``i`` keys, ``sum = T (T + 1) / 2``.

``L`` layers, ``H`` hidden size, ``I`` MLP size, ``V`` vocabulary. Norms, rotary embedding,
softmax and activations are left out (a few per cent at most). For SmolLM2-135M (L 30, H 576,
9 heads and 3 KV heads of 64, I 1,536, V 49,152) and T 1,024: W = 106,168,320, so 217.4 GFLOP of
projections, 36.3 GFLOP of attention and 0.06 GFLOP of LM head: 253.8 GFLOP in all, about
0.25 GFLOP per prompt token. The engine's chunks compute the same FLOPs (each chunk's queries
attend the keys before them) plus one LM-head row per chunk, not counted.

Beside them, the same dtype's matrix-product peak, measured in the same process: GFLOPS of
``torch.mm`` on (a) a large square product (``--gemm-size``, 2,048 by default: ``2 n^3`` FLOPs)
and (b) the model's own projections at ``--tokens`` rows (q/k/v fused, o, gate/up fused, down),
each in its fastest form (``F.linear(x, W)``, ``torch.mm(W, x^T)``, or in bf16 oneDNN's product
over the weight reordered once, ``gemm.onednn_weight``, where this PyTorch has it), combined as one
layer's FLOPs over one layer's time. The shares achieved/peak are printed against the aim of
60 % of the matmul peak.

Usage::

    python -m benchmarks.kernels.prefill_flops                   # fp32 and bf16: 1-6 min on 2 cores
    python -m benchmarks.kernels.prefill_flops --dtypes float32 --repeats 2 --gemm-size 1024 # quick

Each dtype takes about 12 prefills of the prompt plus the peaks: under a minute where the
products run at 100-200 GFLOPS (fp32 on 2 cores, bf16 with AVX512_BF16 or AMX); a CPU without
native bf16 runs bf16 products several times slower than fp32 (about 10 GFLOPS on 2 cores), and
the bf16 half then takes about 5 minutes.

Writes ``prefill_flops.json`` under ``benchmarks/results/`` (``--out-dir`` elsewhere).
"""

from __future__ import annotations

import argparse
import gc
import math
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from benchmarks.harness.cli import HelpFormatter, add_out_dir_flag, name_list, positive_int
from benchmarks.harness.common import machine, write_json

DTYPES = ("float32", "bfloat16")
AIM = 0.60  # achieved GFLOPS over the matmul peak
# bf16 through the engine against the projections' peak (the llama.cpp comparison's prefill aim)
BF16_ENGINE_TARGET = 0.75
SEED = 7


@dataclass(frozen=True)
class ModelShape:
    """The sizes the FLOP count needs (a Llama-style decoder: q/k/v/o, gated MLP)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def from_config(cls, cfg: Any) -> ModelShape:
        """The shape of a Hugging Face model config (``LlamaConfig`` and alike)."""
        heads = int(cfg.num_attention_heads)
        return cls(layers=int(cfg.num_hidden_layers), hidden=int(cfg.hidden_size), heads=heads,
                   kv_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
                   head_dim=int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads),
                   intermediate=int(cfg.intermediate_size), vocab=int(cfg.vocab_size))

    def projections(self) -> list[tuple[str, int, int]]:
        """One layer's projection weights as ``(name, out_features, in_features)``, fused as the
        backend runs them: qkv, o, gate_up, down."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return [("qkv", q + 2 * kv, self.hidden), ("o", self.hidden, q),
                ("gate_up", 2 * self.intermediate, self.hidden),
                ("down", self.hidden, self.intermediate)]

    def matmul_params(self) -> int:
        """``W``: the non-embedding matmul weights a token passes through, all layers."""
        return self.layers * sum(out * inp for _, out, inp in self.projections())


def prefill_flops(shape: ModelShape, tokens: int) -> dict[str, int]:
    """FLOPs of a prefill of ``tokens`` prompt tokens from position 0 (the module's formula).

    Returns:
        ``linear`` (projections), ``lm_head`` (the last token's), ``attention`` (``QK^T`` and
        ``PV``, causal) and ``total``, in FLOPs.
    """
    linear = 2 * shape.matmul_params() * tokens
    lm_head = 2 * shape.vocab * shape.hidden if tokens else 0
    attention = 4 * shape.layers * shape.heads * shape.head_dim * tokens * (tokens + 1) // 2
    return {"linear": linear, "lm_head": lm_head, "attention": attention,
            "total": linear + lm_head + attention}


# --------------------------------------------------------------------------- timing


def median_time(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` in seconds over ``repeats`` calls, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def gemm_peak(dtype: Any, size: int, repeats: int) -> dict[str, float]:
    """GFLOPS of ``torch.mm`` on two ``size x size`` matrices (``2 size^3`` FLOPs)."""
    import torch

    gen = torch.Generator().manual_seed(SEED)
    a = torch.randn(size, size, generator=gen).to(dtype)
    b = torch.randn(size, size, generator=gen).to(dtype)
    with torch.inference_mode():
        seconds = median_time(lambda: torch.mm(a, b), repeats)
    return {"size": size, "seconds": seconds, "gflops": 2 * size**3 / seconds / 1e9}


def projection_peak(dtype: Any, shape: ModelShape, rows: int, repeats: int) -> dict[str, Any]:
    """GFLOPS of the model's projection products at ``rows`` rows, each in its fastest form
    (``F.linear(x, W)``, ``torch.mm(W, x^T)``, or in bf16 over the weight reordered for oneDNN);
    ``combined`` is one layer's FLOPs over the sum of the four best times."""
    import torch
    import torch.nn.functional as F

    from inference.engine.backends.native.gemm import onednn_linear, onednn_weight

    gen = torch.Generator().manual_seed(SEED)
    per_shape: dict[str, Any] = {}
    flops_sum = seconds_sum = 0.0
    with torch.inference_mode():
        for name, out, inp in shape.projections():
            w = (torch.randn(out, inp, generator=gen) * inp**-0.5).to(dtype)
            x = torch.randn(rows, inp, generator=gen).to(dtype)
            times = {"F.linear": median_time(lambda w=w, x=x: F.linear(x, w), repeats),
                     "W @ x^T": median_time(lambda w=w, x=x: torch.mm(w, x.t()), repeats)}
            reordered = onednn_weight(w) if dtype == torch.bfloat16 else None
            if reordered is not None:
                times["reordered"] = median_time(
                    lambda r=reordered, x=x: onednn_linear(x, r, None), repeats)
            best = min(times, key=times.get)
            flops = 2 * rows * out * inp
            per_shape[name] = {"out": out, "in": inp, "seconds": times, "best": best,
                               "gflops": flops / times[best] / 1e9}
            flops_sum += flops
            seconds_sum += times[best]
    return {"rows": rows, "shapes": per_shape, "gflops": flops_sum / seconds_sum / 1e9}


def backend_prefill_time(backend: Any, token_ids: Sequence[int], repeats: int) -> float:
    """Median seconds of one ``backend.prefill`` of all ``token_ids`` in one chunk."""
    from inference.engine.backends.base import PrefillChunk

    block = 16
    blocks = -(-len(token_ids) // block) + 1
    backend.allocate_kv_pool(blocks, block)
    chunk = PrefillChunk("prompt", list(token_ids), 0, list(range(blocks)))
    return median_time(lambda: backend.prefill([chunk]), repeats)


def engine_ttft(backend: Any, dtype: str, prompts: Sequence[Sequence[int]]) -> dict[str, Any]:
    """An engine with its default settings over ``backend``: the TTFT in seconds of each prompt
    (``max_tokens=1``) in turn, the first being the warm-up; its prefill settings; and whether
    every prompt was computed whole (no prefix-cache hit)."""
    from inference.engine.config import EngineConfig
    from inference.engine.llm_engine import LLMEngine
    from inference.engine.request import FinalEvent, SamplingParams

    first_token: dict[str, float] = {}

    def stamp(events: list) -> None:
        now = time.perf_counter()
        for event in events:
            if not isinstance(event, FinalEvent):
                first_token.setdefault(event.request_id, now)

    config = EngineConfig(dtype=dtype)
    engine = LLMEngine(config, backend, event_sink=stamp)
    ttfts, computed = [], []
    for i, prompt in enumerate(prompts):
        rid = f"p{i}"
        before = engine.stats()["prompt_tokens_computed"]
        submitted = time.perf_counter()
        engine.submit(prompt_token_ids=list(prompt), request_id=rid,
                      sampling=SamplingParams(max_tokens=1, ignore_eos=True))
        done = False
        while not done:
            done = any(isinstance(e, FinalEvent) and e.request_id == rid for e in engine.step())
        ttfts.append(first_token[rid] - submitted)
        computed.append(engine.stats()["prompt_tokens_computed"] - before)
    return {"ttfts_s": ttfts,
            "prefill_mode": config.effective_prefill_mode.value,
            "prefill_chunk_size": config.prefill_chunk_size,
            "all_computed": all(c == len(p) for c, p in zip(computed, prompts, strict=True))}


def measure_dtype(dtype_name: str, model_path: str, tokens: int, repeats: int,
                  gemm_size: int) -> dict[str, Any]:
    """Every figure of one dtype: the two matmul peaks, the backend's pass and the engine's
    TTFT, with their GFLOPS and shares of the peaks."""
    import torch

    from inference.engine.backends.hf import TransformersBackend

    dtype = getattr(torch, dtype_name)
    backend = TransformersBackend.from_pretrained(model_path, dtype=dtype_name)
    shape = ModelShape.from_config(backend.hf_model.config)
    flops = prefill_flops(shape, tokens)
    rng = random.Random(SEED)
    vocab = backend.vocab_size

    def prompt() -> list[int]:
        return [rng.randrange(vocab) for _ in range(tokens)]

    peaks = {"square": gemm_peak(dtype, gemm_size, repeats),
             "projections": projection_peak(dtype, shape, tokens, repeats)}
    backend_s = backend_prefill_time(backend, prompt(), repeats)
    layers_s = None
    if getattr(backend, "_decode_layers", None) is not None and backend._prefill_kernel_runs:
        # The same pass with each layer's PyTorch operations instead of one native call.
        backend.fused_prefill = False
        layers_s = backend_prefill_time(backend, prompt(), repeats)
        backend.fused_prefill = True
    engine = engine_ttft(backend, dtype_name, [prompt() for _ in range(repeats + 1)])
    engine_s = statistics.median(engine["ttfts_s"][1:])
    paths = {}
    timed = [("backend", backend_s), ("engine", engine_s)]
    if layers_s is not None:
        timed.insert(1, ("backend_torch_layers", layers_s))
    for path, seconds in timed:
        gflops = flops["total"] / seconds / 1e9
        paths[path] = {"seconds": seconds, "tokens_per_s": tokens / seconds, "gflops": gflops,
                       "share_of_square_peak": gflops / peaks["square"]["gflops"],
                       "share_of_projection_peak": gflops / peaks["projections"]["gflops"]}
    paths["engine"].update({k: engine[k] for k in ("prefill_mode", "prefill_chunk_size",
                                                    "all_computed", "ttfts_s")})
    del backend
    gc.collect()
    return {"dtype": dtype_name, "shape": asdict(shape), "tokens": tokens, "flops": flops,
            "peaks": peaks, "paths": paths}


# --------------------------------------------------------------------------- report


def format_report(results: list[dict[str, Any]]) -> str:
    """The table of tokens/s, GFLOPS and shares of the peaks, the peaks, and the aim's line."""
    head = (f"{'dtype':<10}{'path':<28}{'seconds':>9}{'tokens/s':>10}{'GFLOPS':>9}"
            f"{'of square':>11}{'of proj.':>10}")
    lines = [head, "-" * len(head)]
    for r in results:
        for path, p in r["paths"].items():
            what = {"backend": "one pass, 1 chunk",
                    "backend_torch_layers": "same, PyTorch layers"}.get(
                path, f"engine TTFT ({p.get('prefill_mode')} {p.get('prefill_chunk_size')})")
            lines.append(f"{r['dtype']:<10}{what:<28}{p['seconds']:>9.3f}"
                         f"{p['tokens_per_s']:>10.0f}{p['gflops']:>9.1f}"
                         f"{p['share_of_square_peak']:>10.0%}{p['share_of_projection_peak']:>10.0%}")
    lines.append("")
    for r in results:
        sq, pr = r["peaks"]["square"], r["peaks"]["projections"]
        shapes = ", ".join(f"{n} {s['out']}x{s['in']} {s['gflops']:.0f} ({s['best']})"
                           for n, s in pr["shapes"].items())
        lines.append(f"{r['dtype']} matmul peak: square {sq['size']}^3 {sq['gflops']:.1f} GFLOPS; "
                     f"projections at {pr['rows']} rows {pr['gflops']:.1f} GFLOPS ({shapes})")
    first = results[0]
    f = first["flops"]
    lines.append(f"FLOPs of {first['tokens']} tokens: {f['total'] / 1e9:.1f} G (projections "
                 f"{f['linear'] / 1e9:.1f}, attention {f['attention'] / 1e9:.1f}, LM head "
                 f"{f['lm_head'] / 1e9:.2f})")
    shares = "; ".join(
        f"{r['dtype']} {path} {p['share_of_projection_peak']:.0%} of the projection peak "
        f"({p['share_of_square_peak']:.0%} of the square)"
        for r in results for path, p in r["paths"].items())
    lines.append(f"aim: >= {AIM:.0%} of the matmul peak; measured: {shares}")
    for r in results:
        if r["dtype"] == "bfloat16":
            share = r["paths"]["engine"]["share_of_projection_peak"]
            verdict = "PASS" if share >= BF16_ENGINE_TARGET else "MISS"
            lines.append(f"bf16 through the engine: {share:.0%} of the projections' peak "
                         f"(target >= {BF16_ENGINE_TARGET:.0%}): {verdict}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=HelpFormatter)
    parser.add_argument("--dtypes", type=name_list(DTYPES, "dtype list"),
                        default=",".join(DTYPES), metavar="LIST",
                        help=f"comma-separated dtypes, out of {', '.join(DTYPES)}")
    parser.add_argument("--tokens", type=positive_int, default=1024,
                        help="prompt tokens (and the rows of the projection peak)")
    parser.add_argument("--repeats", type=positive_int, default=5,
                        help="timed runs of each figure (median), after one warm-up")
    parser.add_argument("--gemm-size", type=positive_int, default=2048,
                        help="n of the square n x n x n product of the matmul peak")
    add_out_dir_flag(parser, "the JSON file")
    args = parser.parse_args(argv)

    from inference.engine.model_store import resolve_model_path
    from inference.protocol.settings import PlatformSettings

    settings = PlatformSettings()
    model_path = str(resolve_model_path(settings.model_path, settings.model_cache_dir))
    before = machine()
    started = time.monotonic()
    results = []
    for dtype in args.dtypes:
        print(f"measuring {dtype} ...", flush=True)
        results.append(measure_dtype(dtype, model_path, args.tokens, args.repeats,
                                     args.gemm_size))
        engine = results[-1]["paths"]["engine"]
        if not engine["all_computed"]:
            print(f"WARNING: {dtype}: the engine reused cached prompt tokens; its TTFT is "
                  "too short", flush=True)
    print()
    print(format_report(results))
    print(f"\ntotal {time.monotonic() - started:.0f} s; medians of {args.repeats} runs after a "
          "warm-up; of square / of proj.: achieved GFLOPS over the square and the projection "
          "matmul peak")
    path = write_json("prefill_flops", {"args": vars(args), "machine_before": before,
                                        "model_path": model_path, "aim": AIM,
                                        "results": results}, args.out_dir)
    print(f"wrote {path}")
    return 0 if all(math.isfinite(r["paths"]["backend"]["gflops"]) for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
