"""A bf16 model's projections on a CPU with AVX512-BF16, over weights packed at load time.

:func:`pack_bf16_weight` lays a ``[out, in]`` bf16 weight out in the order the kernel of
``bf16_gemm.c`` reads it (tiles of 64 output features, each pair of inputs of a tile's features
side by side); :func:`bf16_packed_matmul` computes ``x W^T (+ bias)`` from it. The kernel is
the usual broadcast micro-kernel of a CPU GEMM (6 rows by 64 features in 24 fp32 accumulators,
VDPBF16PS, as in oneDNN's and BLIS's kernels), with the weight streamed in memory order: a
decode step's few rows are bound by reading the weights, and the plain layout read a few rows
at a time reached half the memory bandwidth. ``python -m benchmarks.kernels.bf16_gemm`` measures it
against ``F.linear`` in bf16 (oneDNN) on the default model's projections.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch
import torch.nn.functional as F

from inference.engine.backends import native as native_kernels

logger = logging.getLogger(__name__)

TILE = 64  # output features per packed tile (bf16_gemm.c's TILE)
# On a CPU with AMX whose packed kernel has no AMX path (amx_kernel: the OS refused the tiles),
# passes of at least this many rows through PackedLinear run oneDNN's product over the reordered
# weight (onednn_weight), and decode passes of this many rows the layer loop. On a 2-core Xeon
# with AMX (family 6 model 167), the default model's projections of 30 layers streamed from
# memory (``python -m benchmarks.kernels.bf16_gemm``): the reordered weight 13.8 ms a pass at 8
# rows and 33.6 at 256 against the kernel's AVX512-BF16 path's 23.1 and 286; a decode step of 8
# rows 34.1 ms through the layer loop against 37.2 in one native call a layer on that path, of
# 4 rows 27.4 against 26.1 (``python -m benchmarks.kernels.decode_step --dtype bfloat16``).
AMX_MIN_ROWS = 8


def onednn_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight [out, in]`` reordered once into oneDNN's blocked layout for its products
    (``torch.ops.mkldnn._reorder_linear_weight``, as PyTorch's Inductor prepacks a linear
    layer's weight), or None where this PyTorch has no oneDNN ops.

    ``F.linear`` over the plain weight reorders it on every call: on a 2-core Xeon with AMX
    (family 6 model 167) the default model's four projections of a layer took 0.45-0.7 of
    ``F.linear``'s time from 1 to 256 rows over the reordered weight (0.87 at 1,024), with the
    same sums (``python -m benchmarks.kernels.bf16_gemm``).
    """
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())
    except (AttributeError, RuntimeError) as exc:  # no oneDNN ops, or they refuse the weight
        logger.info("oneDNN's weight reorder is not available (%s): F.linear over the plain "
                    "weight", exc)
        return None


def onednn_linear(x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """``x [rows, in] W^T (+ bias)`` over ``weight`` from :func:`onednn_weight`: ``[rows, out]``
    in ``x``'s dtype."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@functools.cache
def amx_available() -> bool:
    """Whether this CPU has AMX with bf16 tiles (``amx_bf16`` and ``amx_tile`` in
    ``/proc/cpuinfo``), which oneDNN's bf16 products (``F.linear``) use."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = next((line.split(":", 1)[1].split() for line in f
                          if line.startswith("flags")), [])
    except OSError:
        return False
    return {"amx_bf16", "amx_tile"} <= set(flags)


def amx_kernel(lib: ctypes.CDLL | None) -> bool:
    """Whether ``lib``'s packed kernel runs its AMX path (``bf16_gemm.c``: built on a CPU with
    AMX, and the OS lets this process use the tiles) for passes of at least
    :func:`amx_kernel_min_rows` rows times parts."""
    return amx_kernel_min_rows(lib) > 0


def amx_kernel_min_rows(lib: ctypes.CDLL | None, min_rows: int = -1) -> int:
    """The packed kernel's AMX threshold (rows times parts of a pass: an fp32 input split in
    two bf16 parts counts twice); with ``min_rows >= 0`` set it (0: never) and return the one
    before. -1 where ``lib`` has no AMX path."""
    if not lib:
        return -1
    fn = lib.bf16_packed_matmul_amx_min_rows
    fn.restype, fn.argtypes = ctypes.c_int64, [ctypes.c_int64]
    return int(fn(min_rows))


def packed_matmul_available(lib: ctypes.CDLL | None) -> bool:
    """Whether ``lib`` (from :func:`inference.engine.backends.native.load`) was built with
    AVX512-BF16, so that :func:`bf16_packed_matmul` computes; ``False`` for no library."""
    return bool(lib) and bool(lib.bf16_packed_matmul_available())


def can_pack(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is a 2-d bf16 CPU tensor the kernel takes: ``out`` a multiple of
    :data:`TILE`, ``in`` even."""
    return (weight.dim() == 2 and weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
            and weight.shape[0] % TILE == 0 and weight.shape[1] % 2 == 0
            and min(weight.shape) > 0)


def pack_bf16_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight [out, in]`` bf16 packed as ``[out / 64, in / 2, 64, 2]`` (a new tensor, the same
    bytes as the weight).

    Raises:
        ValueError: if :func:`can_pack` is false for ``weight``.
    """
    if not can_pack(weight):
        raise ValueError(f"bf16 packed matmul: cannot pack a {tuple(weight.shape)} "
                         f"{weight.dtype} tensor on {weight.device} (bf16 on CPU, out a multiple "
                         f"of {TILE}, in even)")
    out, inp = weight.shape
    return weight.detach().reshape(out // TILE, TILE, inp // 2, 2).permute(0, 2, 1, 3).contiguous()


def split_fp32(x: torch.Tensor) -> torch.Tensor:
    """``x [rows, in]`` fp32 as ``[rows, 2, in]`` bf16: ``hi = bf16(x)`` and ``lo = bf16(x - hi)``
    (both rounded to nearest even), whose sum carries 16 significant bits of ``x``."""
    hi = x.to(torch.bfloat16)
    lo = (x - hi.float()).to(torch.bfloat16)
    return torch.stack([hi, lo], dim=1)


def bf16_packed_matmul(lib: ctypes.CDLL, x: torch.Tensor, packed: torch.Tensor,
                       bias: torch.Tensor | None = None, *, out_fp32: bool = False,
                       threads: int = 0) -> torch.Tensor:
    """``x W^T (+ bias)`` over ``packed`` (:func:`pack_bf16_weight` of ``W [out, in]``).

    Every product of two bf16 numbers is exact in fp32 and summed in fp32; the sums are rounded
    once to bf16 (nearest even), or returned in fp32 with ``out_fp32``.

    Args:
        lib: the library :func:`inference.engine.backends.native.load` returned, built with
            AVX512-BF16 (:func:`packed_matmul_available`).
        x: ``[rows, in]`` bf16, or ``[rows, 2, in]`` bf16 whose two parts are summed
            (:func:`split_fp32` of an fp32 ``x``); CPU, any strides (made contiguous).
        packed: ``[out / 64, in / 2, 64, 2]`` bf16, contiguous.
        bias: ``[out]`` (any float dtype, used in fp32), or None.
        out_fp32: return fp32 sums instead of rounding them to bf16.
        threads: OpenMP threads (0: ``torch.get_num_threads()``).

    Returns:
        ``[rows, out]`` bf16, or fp32 with ``out_fp32``.

    Raises:
        ValueError: for tensors of another dtype, device or shape than above, or a library built
            without AVX512-BF16.
    """
    if x.dtype != torch.bfloat16 or x.device.type != "cpu" or x.dim() not in (2, 3):
        raise ValueError(f"bf16 packed matmul: x must be a 2-d or 3-d bf16 CPU tensor, got "
                         f"{tuple(x.shape)} {x.dtype} on {x.device}")
    if (packed.dtype != torch.bfloat16 or packed.dim() != 4 or not packed.is_contiguous()
            or packed.shape[2:] != (TILE, 2)):
        raise ValueError(f"bf16 packed matmul: packed must be a contiguous [out / {TILE}, in / 2, "
                         f"{TILE}, 2] bf16 tensor, got {tuple(packed.shape)} {packed.dtype}")
    rows, parts, inp = x.shape[0], (1 if x.dim() == 2 else x.shape[1]), x.shape[-1]
    out = packed.shape[0] * TILE
    if parts not in (1, 2) or inp != 2 * packed.shape[1] or (
            bias is not None and tuple(bias.shape) != (out,)):
        bias_shape = None if bias is None else tuple(bias.shape)
        raise ValueError(f"bf16 packed matmul: shapes do not match: x {tuple(x.shape)}, packed "
                         f"{tuple(packed.shape)}, bias {bias_shape}")
    x = x.contiguous()
    if bias is not None:
        bias = bias.to(device="cpu", dtype=torch.float32).contiguous()
    y = torch.empty(rows, out, dtype=torch.float32 if out_fp32 else torch.bfloat16)
    rc = getattr(lib, native_kernels.GEMM_SYMBOL)(
        packed.data_ptr(), x.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(),
        rows, parts, out, inp, int(out_fp32), threads or torch.get_num_threads())
    if rc == 3:
        raise ValueError("bf16 packed matmul: the kernel library was built without AVX512-BF16")
    if rc:
        raise ValueError(f"bf16 packed matmul: error {rc}")
    return y


class PackedLinear:
    """One projection ``x W^T (+ bias)`` over ``W`` packed once (:func:`pack_bf16_weight`), for
    the forward pass: the shapes are checked here, so a call checks only ``x``.

    Attributes:
        packed: ``[out / 64, in / 2, 64, 2]`` bf16.
        bias: ``[out]`` fp32, or None.
        out_features, in_features: ``W``'s shape.
        onednn: on a CPU with AMX whose kernel has no AMX path, ``W`` reordered for oneDNN
            (:func:`onednn_weight`), which passes of :data:`AMX_MIN_ROWS` rows or more run on;
            else None.
        weight: there, where the reorder is unavailable, ``W`` for ``F.linear``; else None.
    """

    __slots__ = ("_bias_bf16", "_fn", "bias", "in_features", "onednn", "out_features", "packed",
                 "weight")

    def __init__(self, lib: ctypes.CDLL, weight: torch.Tensor,
                 bias: torch.Tensor | None = None, *, onednn: bool = True) -> None:
        """Pack ``weight [out, in]`` (bf16, CPU) for ``lib``; on a CPU with AMX whose kernel has
        no AMX path also reorder it for oneDNN, unless ``onednn`` is false (a caller that only
        asks for fp32 sums, which only the kernel gives).

        Raises:
            ValueError: if :func:`can_pack` is false for ``weight``, the bias is not ``[out]``,
                or ``lib`` was built without AVX512-BF16.
        """
        if not packed_matmul_available(lib):
            raise ValueError("bf16 packed matmul: the kernel library was built without "
                             "AVX512-BF16")
        self.packed = pack_bf16_weight(weight)
        self.out_features, self.in_features = weight.shape
        if bias is not None and tuple(bias.shape) != (self.out_features,):
            raise ValueError(f"bf16 packed matmul: bias {tuple(bias.shape)} does not match "
                             f"weight {tuple(weight.shape)}")
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self._fn = getattr(lib, native_kernels.GEMM_SYMBOL)
        # On a CPU with AMX whose kernel has no AMX path (amx_kernel), oneDNN's AMX tiles for
        # passes of AMX_MIN_ROWS rows or more: over the weight reordered for it, else the plain
        # weight. With the kernel's own AMX path neither: its products were as fast in a
        # prompt's pass (0.43 s against 0.44 for a 1,024-token prompt in 256-token chunks on a
        # 2-core Xeon family 6 model 167), without another copy of the weights.
        fallback = onednn and amx_available() and not amx_kernel(lib)
        self.onednn = onednn_weight(weight) if fallback else None
        self.weight = weight.detach() if fallback and self.onednn is None else None
        self._bias_bf16 = None if bias is None else bias.detach().to(torch.bfloat16)

    def __call__(self, x: torch.Tensor, *, out_fp32: bool = False) -> torch.Tensor:
        """``x [rows, in]`` bf16 (or ``[rows, 2, in]``, see :func:`bf16_packed_matmul`) times
        ``W^T`` plus the bias: ``[rows, out]`` bf16, or fp32 with ``out_fp32``.

        Raises:
            ValueError: for an ``x`` of another dtype, device or width.
        """
        if (x.dtype != torch.bfloat16 or x.device.type != "cpu" or x.dim() not in (2, 3)
                or x.shape[-1] != self.in_features or (x.dim() == 3 and x.shape[1] not in (1, 2))):
            raise ValueError(f"bf16 packed matmul: x must be a [rows, {self.in_features}] or "
                             f"[rows, 2, {self.in_features}] bf16 CPU tensor, got "
                             f"{tuple(x.shape)} {x.dtype} on {x.device}")
        x = x.contiguous()
        rows = x.shape[0]
        if rows >= AMX_MIN_ROWS and x.dim() == 2 and not out_fp32:
            # fp32 sums rounded once, as the kernel's
            if self.onednn is not None:
                return onednn_linear(x, self.onednn, self._bias_bf16)
            if self.weight is not None:
                return F.linear(x, self.weight, self._bias_bf16)
        y = torch.empty(rows, self.out_features,
                        dtype=torch.float32 if out_fp32 else torch.bfloat16)
        rc = self._fn(self.packed.data_ptr(), x.data_ptr(),
                      None if self.bias is None else self.bias.data_ptr(), y.data_ptr(), rows,
                      1 if x.dim() == 2 else x.shape[1], self.out_features, self.in_features,
                      int(out_fp32), torch.get_num_threads())
        if rc:
            raise ValueError(f"bf16 packed matmul: error {rc}")
        return y
