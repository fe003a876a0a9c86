"""The elementwise steps of a bf16 pass whose products and attention run on PyTorch.

On a CPU with AMX, oneDNN's bf16 products (``F.linear``) and PyTorch's attention run on AMX tiles
several times faster than the native kernels' VDPBF16PS, so a bf16 pass with prompt chunks keeps
the layer loop of :mod:`inference.engine.backends.hf.forward`. Its elementwise steps there were
some twenty PyTorch operations a layer (RMSNorm in fp32 and back, the rotary embedding's
``cat``, products and sum, the K/V copy into the pool, SiLU and the gating product, the residual
adds), each a pass over memory with its own dispatch: about half of a 256-token chunk's time on
a 2-core Xeon with AMX. :class:`Elementwise` runs them as three calls of ``decode_layer.c``
(``bf16_add_rms_norm``, ``bf16_rope_kv_write``, ``bf16_silu_mul``), with the PyTorch pass's
roundings (see that file).
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

_ERRORS = {1: "a position outside the rotary tables or a slot outside the pool",
           4: "a head size the kernel does not take",
           5: "the kernel library was built without AVX512-BF16"}


def declare(lib: ctypes.CDLL) -> None:
    """The argument types of the three symbols on ``lib``."""
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.bf16_add_rms_norm.restype = ctypes.c_int
    lib.bf16_add_rms_norm.argtypes = [ptr] * 4 + [i64, i64, ctypes.c_double, i64]
    lib.bf16_silu_mul.restype = ctypes.c_int
    lib.bf16_silu_mul.argtypes = [ptr, ptr, i64, i64, i64]
    lib.bf16_rope_kv_write.restype = ctypes.c_int
    lib.bf16_rope_kv_write.argtypes = [ptr] * 7 + [i64] * 7


def _check(rc: int, what: str) -> None:
    if rc:
        raise ValueError(f"{what}: {_ERRORS.get(rc, f'error {rc}')}")


class Elementwise:
    """The three steps over one pass's tensors (bf16, CPU, contiguous; not checked per call:
    :func:`supported` is asked once per pass).

    Args:
        lib: the kernel library (:func:`inference.engine.backends.native.load`), built with
            AVX512-BF16.
        cos, sin: ``[max_positions, head_dim]`` bf16 rotary tables (rotate-half layout).
        threads: OpenMP threads (``torch.get_num_threads()`` at the pass's start).
    """

    __slots__ = ("_cos", "_lib", "_sin", "threads")

    def __init__(self, lib: ctypes.CDLL, cos: torch.Tensor, sin: torch.Tensor,
                 threads: int) -> None:
        self._lib, self._cos, self._sin, self.threads = lib, cos, sin, threads

    def add_rms_norm(self, h: torch.Tensor, d: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """``h += d`` in place (rounded to bf16; skipped for ``d`` None), then RMSNorm of ``h``
        times ``weight``: ``[rows, n]`` bf16."""
        y = torch.empty_like(h)
        rows, n = h.shape
        _check(self._lib.bf16_add_rms_norm(h.data_ptr(), None if d is None else d.data_ptr(),
                                           weight.data_ptr(), y.data_ptr(), rows, n, eps,
                                           self.threads), "RMSNorm")
        return y

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``SiLU(gate) * up`` of ``gate_up [rows, 2 I]`` (gate, then up): ``[rows, I]``."""
        rows, width = gate_up.shape
        act = torch.empty(rows, width // 2, dtype=gate_up.dtype)
        _check(self._lib.bf16_silu_mul(gate_up.data_ptr(), act.data_ptr(), rows, width // 2,
                                       self.threads), "SiLU")
        return act

    def rope_kv_write(self, qkv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                      pool: torch.Tensor, n_heads: int, kv_heads: int,
                      head_dim: int) -> torch.Tensor:
        """Rotate ``qkv [N, (n_heads + 2 kv_heads) head_dim]``'s q and k heads in place at
        ``positions [N]``, write each token's K and V heads to its slot ``slots [N]`` of one
        layer's ``pool [2 kv_heads, blocks, block_size, head_dim]``; return the rotated queries
        ``[N, n_heads, head_dim]``.

        Raises:
            ValueError: for a position beyond the rotary tables or a slot outside the pool
                (nothing written).
        """
        tokens = qkv.shape[0]
        q = torch.empty(tokens, n_heads, head_dim, dtype=qkv.dtype)
        _check(self._lib.bf16_rope_kv_write(
            qkv.data_ptr(), positions.data_ptr(), slots.data_ptr(), self._cos.data_ptr(),
            self._sin.data_ptr(), q.data_ptr(), pool.data_ptr(), tokens, n_heads, kv_heads,
            head_dim, pool.numel() // (2 * kv_heads * head_dim), self._cos.shape[0],
            self.threads), "rotary embedding")
        return q


def supported(lib: Any, h: torch.Tensor, pool: torch.Tensor, layer: Any, cos: torch.Tensor,
              activation: Any) -> bool:
    """Whether :class:`Elementwise` runs a pass: ``lib`` built with AVX512-BF16, bf16
    activations, pool and rotary tables on CPU, SiLU, no q/k norms."""
    return (bool(lib) and bool(lib.bf16_packed_matmul_available())
            and h.dtype == pool.dtype == cos.dtype == torch.bfloat16 and h.device.type == "cpu"
            and activation is torch.nn.functional.silu and layer.q_norm is None
            and layer.k_norm is None and pool.is_contiguous() and cos.is_contiguous())
