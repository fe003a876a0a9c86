"""Prefill attention of a bf16 model on a CPU with AVX512-BF16, read from the paged KV pool.

:func:`prefill_attention` runs ``prefill_attention.c``: the new tokens of one or more rows (prompt
chunks at any offset in their rows) attend causally to every earlier position of their row, K
and V read along each row's block table, with FlashAttention's online softmax over chunks of 64
keys and the products on VDPBF16PS. It replaces gathering each row's K/V into a padded tensor and
``scaled_dot_product_attention`` with an explicit mask, which PyTorch 2.13's CPU kernel runs
at a fraction of its speed with ``is_causal`` (a chunk at an offset cannot use ``is_causal``).
"""

from __future__ import annotations

import ctypes

import torch

from inference.engine.backends import native as native_kernels

HEAD_DIM = 64  # the only head size the kernel takes
MAX_GROUP = 24  # most query heads per KV head

_ERRORS = {
    1: "a row has no new tokens, a negative position, or positions past its block table",
    2: "out of memory for the packed K/V chunks",
    3: "unsupported here (no AVX512-BF16, a head size other than 64, or a group above 24)",
    4: "a block table names a block outside the pool",
}


def supported(lib: ctypes.CDLL | None, dtype: torch.dtype, head_dim: int, group: int) -> bool:
    """Whether :func:`prefill_attention` runs for a model of this dtype and attention shape with
    ``lib`` (from :func:`inference.engine.backends.native.load`, built with AVX512-BF16)."""
    return (bool(lib) and bool(lib.bf16_packed_matmul_available()) and dtype == torch.bfloat16
            and head_dim == HEAD_DIM and 1 <= group <= MAX_GROUP)


def prefill_attention(lib: ctypes.CDLL, q: torch.Tensor, pool: torch.Tensor,
                      tables: torch.Tensor, token_start: torch.Tensor, pos_start: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """Causal attention of the packed new tokens of ``rows`` rows over one layer's paged pool.

    Row ``r``'s new tokens are ``q[token_start[r]:token_start[r + 1]]`` at positions
    ``pos_start[r]`` onwards; each attends to its row's positions up to its own. Scores,
    softmax and the output's sums are fp32; the softmax weights are rounded to bf16 for the
    product with V (as ``scaled_dot_product_attention`` does in bf16) and the output once to
    bf16.

    Args:
        lib: the library :func:`inference.engine.backends.native.load` returned (see
        :func:`supported`). q: ``[tokens, kv_heads, group, 64]`` bf16 (CPU, contiguous).
        pool: ``[2 * kv_heads, num_blocks, block_size, 64]`` bf16, K heads then V heads, the new
            tokens' K/V already written.
        tables: ``[rows, max_blocks]`` int64 block ids.
        token_start: ``[rows + 1]`` int64 offsets of each row's tokens in ``q``.
        pos_start: ``[rows]`` int64 position of each row's first new token.
        scale: the softmax scale (``head_dim ** -0.5``).

    Returns:
        ``[tokens, kv_heads, group, 64]`` bf16.

    Raises:
        ValueError: for tensors of another dtype, device, rank or layout than above, shapes
            that do not match, or rows the pool or block tables cannot hold.
        MemoryError: if the kernel cannot allocate its packed K/V chunks.
    """
    for name, tensor, dtype, dims in (("q", q, torch.bfloat16, 4),
                                      ("pool", pool, torch.bfloat16, 4),
                                      ("tables", tables, torch.int64, 2),
                                      ("token_start", token_start, torch.int64, 1),
                                      ("pos_start", pos_start, torch.int64, 1)):
        if (tensor.dtype != dtype or tensor.device.type != "cpu" or tensor.dim() != dims
                or not tensor.is_contiguous()):
            raise ValueError(f"prefill attention: {name} must be a contiguous {dims}-d {dtype} "
                             f"CPU tensor, got {tuple(tensor.shape)} {tensor.dtype} on "
                             f"{tensor.device}")
    tokens, kv_heads, group, head_dim = q.shape
    rows = tables.shape[0]
    if (pool.shape[0] != 2 * kv_heads or pool.shape[3] != head_dim
            or token_start.shape[0] != rows + 1 or pos_start.shape[0] != rows
            or (rows and (int(token_start[0]) != 0 or int(token_start[-1]) != tokens))):
        raise ValueError(f"prefill attention: shapes do not match: q {tuple(q.shape)}, pool "
                         f"{tuple(pool.shape)}, tables {tuple(tables.shape)}, token_start "
                         f"{tuple(token_start.shape)}, pos_start {tuple(pos_start.shape)}")
    out = torch.empty_like(q)
    rc = getattr(lib, native_kernels.PREFILL_SYMBOL)(
        q.data_ptr(), pool.data_ptr(), tables.data_ptr(), token_start.data_ptr(),
        pos_start.data_ptr(), out.data_ptr(), rows, kv_heads, group, head_dim, pool.shape[1],
        pool.shape[2], tables.shape[1], scale, torch.get_num_threads())
    if rc == 2:
        raise MemoryError(f"prefill attention: {_ERRORS[2]}")
    if rc:
        raise ValueError(f"prefill attention: {_ERRORS.get(rc, f'error {rc}')}")
    return out
