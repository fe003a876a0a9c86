"""The native LoRA kernel (``lora.c``): an adapter described for it, a pass's rows' adapters,
and the deltas of one projection added in place.

:func:`table` describes a loaded :class:`~inference.engine.lora.AdapterWeights` once (a
``lora_proj_t`` per layer and fused projection, pointing into its tensors, which it keeps
alive); :func:`rows` gives a pass the array of its tokens' tables (NULL for the bare model);
:func:`add` runs ``lora_add_bf16`` or ``lora_add_f32`` over one projection's output. The decode
layers (:mod:`inference.engine.backends.native.decode`) take the same array.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import torch

from inference.engine.lora import FUSED, AdapterWeights

PROJECTIONS = tuple(FUSED)  # the kernel's proj index: 0 qkv, 1 o, 2 gate_up, 3 down
SYMBOLS = {torch.bfloat16: "lora_add_bf16", torch.float32: "lora_add_f32"}


class _ProjT(ctypes.Structure):
    _fields_ = [("a", ctypes.c_void_p), ("b", ctypes.c_void_p), ("r", ctypes.c_int64),
                ("m", ctypes.c_int64), ("ldb", ctypes.c_int64),
                ("off", ctypes.c_int64 * 3), ("width", ctypes.c_int64 * 3),
                ("col", ctypes.c_int64 * 3)]


def declare(lib: ctypes.CDLL) -> None:
    """The argument types of ``lora.c``'s symbols on ``lib``."""
    for symbol in SYMBOLS.values():
        fn = getattr(lib, symbol)
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                       ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                       ctypes.c_int64]


def table(weights: AdapterWeights) -> int:
    """The address of ``weights``' ``lora_proj_t[layers * 4]`` (made once, kept on it)."""
    if weights.native is None:
        entries = (_ProjT * (4 * len(weights.layers)))()
        for i, layer in enumerate(weights.layers):
            for j, proj in enumerate(PROJECTIONS):
                part = layer[proj]
                if part is None:
                    continue  # a NULL a: nothing added
                entry = entries[4 * i + j]
                entry.a, entry.b = part.a.data_ptr(), part.b.data_ptr()
                entry.r, entry.m, entry.ldb = weights.rank, len(part.widths), part.b.shape[1]
                for k, (off, width, col) in enumerate(
                        zip(part.offsets, part.widths, part.columns, strict=True)):
                    entry.off[k], entry.width[k], entry.col[k] = off, width, col
        weights.native = entries
    return ctypes.addressof(weights.native)


def rows(adapters: Sequence[AdapterWeights | None]) -> Any:
    """The ``[tokens]`` pointer array of a pass: each token's adapter table, or NULL."""
    return (ctypes.c_void_p * len(adapters))(*[None if w is None else table(w)
                                               for w in adapters])


def add(lib: ctypes.CDLL, y: torch.Tensor, x: torch.Tensor, pointers: Any, layer: int,
        proj: str) -> None:
    """Add to ``y [N, out]`` in place the deltas of ``layer``'s ``proj`` for the ``N`` tokens'
    adapters ``pointers`` (:func:`rows`); ``x [N, in]`` its input, both contiguous, bf16 or fp32
    as the adapters' tensors.

    Raises:
        ValueError: for a rank or width the kernel does not take.
    """
    rc = getattr(lib, SYMBOLS[y.dtype])(
        pointers, layer, PROJECTIONS.index(proj), x.data_ptr(), x.shape[1], y.data_ptr(),
        y.shape[1], y.shape[0], torch.get_num_threads())
    if rc:
        raise ValueError(f"native LoRA: a rank or width the kernel does not take ({rc})")
