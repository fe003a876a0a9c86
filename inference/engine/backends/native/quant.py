"""Products over weights as llama.cpp's GGUF files store them, read as they are: ggml's Q4_1
(the default model's projections) and Q8_0 (its tied embedding and LM head). No copy of the
weight in a wider type is needed for the product.

A quantized weight ``[out, in]`` is ``out * in / 32`` blocks, held here as an ``[out, in / 32 *
BYTES]`` uint8 tensor, the layout ``gguf.GGUFReader`` gives a tensor's data:

* Q4_1, 20 bytes a block: an fp16 scale ``d``, an fp16 minimum ``m``, 16 bytes of 4-bit codes
  ``q``; a weight's value is ``d * q + m`` (ggml's ``dequantize_row_q4_1``);
* Q8_0, 34 bytes a block: an fp16 scale ``d`` and 32 int8 codes ``q``; a value is ``d * q``
  (``dequantize_row_q8_0``).

:func:`quant_matmul` computes ``x W^T (+ bias)`` in the kernels of ``quant.c``, dequantizing
each block inside them (AVX2 where the CPU has it, else plain C), or with ``int8_activations``
over int8 codes of ``x`` per block of 32 as llama.cpp does (integer dot products: VNNI or AVX2);
:func:`dequantize` gives the weight in fp32, for products of many rows. :class:`QuantLinear` is
one projection of the forward pass.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import torch

QK = 32  # weights per block
BLOCK_BYTES = {"q4_1": 20, "q8_0": 34}
# The bytes of one x16 record: 16 features' blocks interleaved (pack_x16).
X16_RECORD = {"q4_1": 16 * 20, "q8_0": 16 * (32 + 2 + 4)}

_ERRORS = {1: "a size below 1, or in_features not a multiple of 32 (x16: out_features not a "
               "multiple of 16)",
           4: "the library was built without AVX-512 VNNI (x16)"}


def _check(kind: str, weight: torch.Tensor, in_features: int, *, x16: bool = False) -> int:
    """``out_features`` of a ``kind`` ``weight`` of ``in_features`` inputs (``x16``: in
    :func:`pack_x16`'s layout, 16 features a row).

    Raises:
        ValueError: an unknown ``kind``; ``weight`` is not a contiguous 2-d uint8 CPU tensor of
            ``in / 32`` blocks (or x16 records) a row; or ``in_features`` is not a positive
            multiple of 32.
    """
    if kind not in BLOCK_BYTES:
        raise ValueError(f"unknown quantization {kind!r}; choose from {', '.join(BLOCK_BYTES)}")
    if in_features < QK or in_features % QK:
        raise ValueError(f"{kind}: in_features {in_features} is not a positive multiple of {QK}")
    want = in_features // QK * (X16_RECORD if x16 else BLOCK_BYTES)[kind]
    if (weight.dtype != torch.uint8 or weight.dim() != 2 or weight.shape[1] != want
            or weight.device.type != "cpu" or not weight.is_contiguous()):
        raise ValueError(f"{kind}{' x16' if x16 else ''}: the weight must be a contiguous "
                         f"[{'out / 16' if x16 else 'out'}, {want}] uint8 CPU tensor for "
                         f"{in_features} inputs, not {tuple(weight.shape)} {weight.dtype}")
    return weight.shape[0] * (16 if x16 else 1)


def _threads(threads: int) -> int:
    return threads if threads > 0 else torch.get_num_threads()


def quant_matmul(lib: ctypes.CDLL, kind: str, x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None = None, *, threads: int = 0,
                 int8_activations: bool = False, x16: bool = False) -> torch.Tensor:
    """``x W^T (+ bias)`` with ``W`` in ``kind`` blocks (``q4_1`` or ``q8_0``), in fp32; with
    ``int8_activations``, ``x`` quantized per block of 32 to int8 codes first and each block's
    product an integer dot product, as llama.cpp computes it (``quant.c``: VNNI, or AVX2).

    Args:
        lib: the library :func:`inference.engine.backends.native.load` returned.
        kind: ``q4_1`` or ``q8_0``.
        x: ``[rows, in]``, any float dtype (computed in fp32).
        weight: ``[out, in / 32 * BLOCK_BYTES[kind]]`` uint8: each row's blocks.
        bias: ``[out]`` or None.
        threads: OpenMP threads (0: ``torch.get_num_threads()``).
        int8_activations: quantize ``x`` (each value off by up to half its block's
            ``max |x| / 127``).
        x16: ``weight`` is in :func:`pack_x16`'s layout (with ``int8_activations``).

    Returns:
        ``[rows, out]`` fp32.

    Raises:
        ValueError: a kind, shape, dtype or layout the kernel does not take.
        RuntimeError: the kernel refused the sizes.
    """
    if x.dim() != 2 or x.shape[0] < 1:
        raise ValueError(f"{kind}: x must be [rows, in] with rows >= 1, not {tuple(x.shape)}")
    rows, in_features = x.shape
    if x16 and not int8_activations:
        raise ValueError("x16: int8 activations only")
    out_features = _check(kind, weight, in_features, x16=x16)
    x = x.detach().to(torch.float32).contiguous()
    b = None if bias is None else bias.detach().to(torch.float32).contiguous()
    if b is not None and b.shape != (out_features,):
        raise ValueError(f"{kind}: bias must be [{out_features}], not {tuple(b.shape)}")
    y = torch.empty(rows, out_features, dtype=torch.float32)
    symbol = (f"{kind}_x16_q8_matmul" if x16 else f"{kind}_q8_matmul" if int8_activations
              else f"{kind}_matmul")
    code = getattr(lib, symbol)(weight.data_ptr(), x.data_ptr(),
                                0 if b is None else b.data_ptr(), y.data_ptr(), rows,
                                out_features, in_features, _threads(threads))
    if code == 2:
        raise MemoryError(f"{symbol}: out of memory for the activations' int8 codes")
    if code:
        raise RuntimeError(f"{symbol} failed ({code}): {_ERRORS.get(code, 'unknown')}")
    return y


def dequantize(lib: ctypes.CDLL, kind: str, weight: torch.Tensor, in_features: int, *,
               threads: int = 0) -> torch.Tensor:
    """The ``kind`` ``weight`` of ``in_features`` inputs as ``[out, in]`` fp32.

    Raises:
        ValueError: a kind, shape, dtype or layout the kernel does not take.
        RuntimeError: the kernel refused the sizes.
    """
    out_features = _check(kind, weight, in_features)
    out = torch.empty(out_features, in_features, dtype=torch.float32)
    code = getattr(lib, f"{kind}_dequantize")(weight.data_ptr(), out.data_ptr(), out_features,
                                              in_features, _threads(threads))
    if code:
        raise RuntimeError(f"{kind}_dequantize failed ({code}): {_ERRORS.get(code, 'unknown')}")
    return out


def x16_available(lib: ctypes.CDLL) -> bool:
    """Whether ``lib`` was compiled with the AVX-512 VNNI product over :func:`pack_x16`'s
    layout."""
    return bool(lib.q4_1_x16_available())


def pack_x16(lib: ctypes.CDLL, kind: str, weight: torch.Tensor,
             in_features: int) -> torch.Tensor:
    """``kind`` ``weight`` (``[out, in / 32 * BLOCK_BYTES[kind]]`` uint8) interleaved 16 output
    features at a time for ``{kind}_x16_q8_matmul`` (``quant.c``; the layout of llama.cpp's
    repacked CPU kernels): ``[out / 16, in / 32 * X16_RECORD[kind]]`` uint8 (Q4_1: the same
    bytes in another order; Q8_0: with each block's code sum beside them).

    Raises:
        ValueError: not ``kind`` blocks of ``in_features`` inputs, or ``out`` not a multiple of
            16.
    """
    out_features = _check(kind, weight, in_features)
    if out_features % 16:
        raise ValueError(f"{kind} x16: out_features {out_features} is not a multiple of 16")
    out = torch.empty(out_features // 16, in_features // QK * X16_RECORD[kind],
                      dtype=torch.uint8)
    if getattr(lib, f"{kind}_x16_pack")(weight.data_ptr(), out.data_ptr(), out_features,
                                        in_features):
        raise ValueError(f"{kind} x16: cannot pack [{out_features}, {in_features}]")
    return out


def simd(lib: ctypes.CDLL) -> bool:
    """Whether ``lib``'s quantized kernels were compiled with their AVX2 path (else plain C)."""
    return bool(lib.q4_1_simd())


class QuantLinear:
    """One projection of the forward pass over quantized weights: ``x W^T (+ bias)`` in fp32.

    Passes of up to ``fused_max_rows`` rows (decode, small mixed passes) run the fused kernel,
    which reads each weight's bytes once (0.625 a weight in Q4_1, 1.06 in Q8_0, against 4 in
    fp32); larger passes (prompt chunks), bound by arithmetic rather than by reading the weight,
    run ``dense_fn(x, dense, bias)`` over the weight's fp32 values (:func:`dequantize` of the
    same blocks). With the x16 products (``x16``: int8 activations on AVX-512 VNNI) every pass
    runs them: on a 2-core Xeon with AMX they took 0.4-0.5x the bf16 dense product's time from
    16 to 2,048 rows.

    Attributes:
        kind: ``q4_1`` or ``q8_0``.
        blocks: ``[out, in / 32 * BLOCK_BYTES[kind]]`` uint8.
        in_features, out_features: ``W``'s shape.
    """

    __slots__ = ("_dense_fn", "_lib", "bias", "blocks", "dense", "fused_max_rows",
                 "in_features", "int8_activations", "kind", "out_features", "x16")

    def __init__(self, lib: ctypes.CDLL, kind: str, blocks: torch.Tensor, in_features: int,
                 bias: torch.Tensor | None, dense: torch.Tensor, dense_fn: Callable[..., Any],
                 fused_max_rows: int, *, int8_activations: bool = False) -> None:
        """Raises:
            ValueError: ``blocks`` are not ``kind`` rows of ``in_features`` inputs, or ``dense``
                or ``bias`` do not match them."""
        self.out_features = _check(kind, blocks, in_features)
        if tuple(dense.shape) != (self.out_features, in_features):
            raise ValueError(f"{kind}: the dense weight {tuple(dense.shape)} does not match "
                             f"[{self.out_features}, {in_features}]")
        self._lib, self.kind, self.blocks, self.in_features = lib, kind, blocks, in_features
        self.bias = None if bias is None else bias.detach().float().contiguous()
        if self.bias is not None and self.bias.shape != (self.out_features,):
            raise ValueError(f"{kind}: bias must be [{self.out_features}], not "
                             f"{tuple(self.bias.shape)}")
        self.dense, self._dense_fn, self.fused_max_rows = dense, dense_fn, fused_max_rows
        self.int8_activations = int8_activations
        # With int8 activations on AVX-512 VNNI: the blocks also interleaved 16 features at a
        # time (pack_x16), which the fused passes read instead (the same products in a fraction
        # of the instructions).
        self.x16 = (pack_x16(lib, kind, blocks, in_features)
                    if int8_activations and self.out_features % 16 == 0 and x16_available(lib)
                    else None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.x16 is not None:  # any pass: the x16 products beat the dense ones at any size
            return quant_matmul(self._lib, self.kind, x, self.x16, self.bias,
                                int8_activations=True, x16=True)
        if x.shape[0] > self.fused_max_rows:
            return self._dense_fn(x, self.dense, self.bias)
        return quant_matmul(self._lib, self.kind, x, self.blocks, self.bias,
                            int8_activations=self.int8_activations)
