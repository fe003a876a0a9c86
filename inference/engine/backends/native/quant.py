"""Products over 4-bit weights as llama.cpp's GGUF files store them (ggml's Q4_1), read as they
are: no copy of the weight in a wider type is kept.

A Q4_1 weight ``[out, in]`` is ``out * in / 32`` blocks of 20 bytes (an fp16 scale ``d``, an
fp16 minimum ``m``, 16 bytes of 4-bit codes ``q``; a weight's value is ``d * q + m``: ggml's
``dequantize_row_q4_1``), held here as a ``[out, in / 32 * 20]`` uint8 tensor, the layout
``gguf.GGUFReader`` gives a tensor's data. :func:`q4_1_matmul` computes ``x W^T (+ bias)`` in
the kernel of ``q4_1.c``, dequantizing each block inside it (AVX2 where the CPU has it);
:func:`q4_1_dequantize` gives the weight in fp32, for products of many rows.
"""

from __future__ import annotations

import ctypes

import torch

QK = 32  # weights per block
BLOCK_BYTES = 20  # fp16 d, fp16 m, 16 bytes of codes

_ERRORS = {1: "a size below 1, or in_features not a multiple of 32"}


def _check(weight: torch.Tensor, in_features: int) -> int:
    """``out_features`` of a Q4_1 ``weight`` of ``in_features`` inputs.

    Raises:
        ValueError: ``weight`` is not a contiguous 2-d uint8 CPU tensor of ``in / 32 * 20``
            bytes a row, or ``in_features`` is not a positive multiple of 32.
    """
    if in_features < QK or in_features % QK:
        raise ValueError(f"q4_1: in_features {in_features} is not a positive multiple of {QK}")
    want = in_features // QK * BLOCK_BYTES
    if (weight.dtype != torch.uint8 or weight.dim() != 2 or weight.shape[1] != want
            or weight.device.type != "cpu" or not weight.is_contiguous()):
        raise ValueError(f"q4_1: the weight must be a contiguous [out, {want}] uint8 CPU tensor "
                         f"for {in_features} inputs, not {tuple(weight.shape)} {weight.dtype}")
    return weight.shape[0]


def _threads(threads: int) -> int:
    return threads if threads > 0 else torch.get_num_threads()


def q4_1_matmul(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None = None, *, threads: int = 0) -> torch.Tensor:
    """``x W^T (+ bias)`` with ``W`` in Q4_1 blocks, in fp32.

    Args:
        lib: the library :func:`inference.engine.backends.native.load` returned.
        x: ``[rows, in]``, any float dtype (computed in fp32).
        weight: ``[out, in / 32 * 20]`` uint8: each row's Q4_1 blocks.
        bias: ``[out]`` or None.
        threads: OpenMP threads (0: ``torch.get_num_threads()``).

    Returns:
        ``[rows, out]`` fp32.

    Raises:
        ValueError: a shape, dtype or layout the kernel does not take.
        RuntimeError: the kernel refused the sizes.
    """
    if x.dim() != 2 or x.shape[0] < 1:
        raise ValueError(f"q4_1: x must be [rows, in] with rows >= 1, not {tuple(x.shape)}")
    rows, in_features = x.shape
    out_features = _check(weight, in_features)
    x = x.detach().to(torch.float32).contiguous()
    b = None if bias is None else bias.detach().to(torch.float32).contiguous()
    if b is not None and b.shape != (out_features,):
        raise ValueError(f"q4_1: bias must be [{out_features}], not {tuple(b.shape)}")
    y = torch.empty(rows, out_features, dtype=torch.float32)
    code = lib.q4_1_matmul(weight.data_ptr(), x.data_ptr(), 0 if b is None else b.data_ptr(),
                           y.data_ptr(), rows, out_features, in_features, _threads(threads))
    if code:
        raise RuntimeError(f"q4_1_matmul failed ({code}): {_ERRORS.get(code, 'unknown')}")
    return y


def q4_1_dequantize(lib: ctypes.CDLL, weight: torch.Tensor, in_features: int, *,
                    threads: int = 0) -> torch.Tensor:
    """The Q4_1 ``weight`` of ``in_features`` inputs as ``[out, in]`` fp32.

    Raises:
        ValueError: a shape, dtype or layout the kernel does not take.
        RuntimeError: the kernel refused the sizes.
    """
    out_features = _check(weight, in_features)
    out = torch.empty(out_features, in_features, dtype=torch.float32)
    code = lib.q4_1_dequantize(weight.data_ptr(), out.data_ptr(), out_features, in_features,
                               _threads(threads))
    if code:
        raise RuntimeError(f"q4_1_dequantize failed ({code}): {_ERRORS.get(code, 'unknown')}")
    return out


def simd(lib: ctypes.CDLL) -> bool:
    """Whether ``lib``'s Q4_1 kernel was compiled with its AVX2 path (else its plain loop)."""
    return bool(lib.q4_1_simd())
