"""The attention paths of a forward pass over one layer's slice of the paged KV pool.

:func:`_paged_attention` runs decode attention with the native kernel; :func:`_gathered_attention`
gathers K/V by block table and runs ``scaled_dot_product_attention`` per group of rows.

Paged attention: the KV cache of every row lives in one pool tensor allocated once
(:meth:`~inference.engine.backends.hf.backend.TransformersBackend.allocate_kv_pool`). Each forward
pass writes the new tokens' K/V into the slots their row's block table names. A decode pass then
runs the native paged-attention kernel (:mod:`inference.engine.backends.native`), which reads each
row's K/V in place along its block table; a prefill pass (or a decode pass without the kernel)
gathers each row's K/V by block table and runs ``scaled_dot_product_attention`` with a per-row mask.
Either way rows of different lengths decode in one pass, and a prefill chunk attends causally to
itself and to every earlier position of its row (earlier chunks or prefix-cache hits).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from inference.engine.backends import native as native_kernels
from inference.engine.backends.hf.batch import _AttnPart, _Batch
from inference.engine.backends.native import prefill as native_prefill


def _paged_attention(lib: Any, b: _AttnPart, q: torch.Tensor, pool: torch.Tensor, n_heads: int,
                     kv_heads: int, group: int, dim: int, scale: float) -> torch.Tensor:
    """Decode attention of ``q [R, H, D]`` (one new token per row of part ``b``) by the native
    kernel ``lib``, K/V read in place from one layer's ``pool`` along the part's block tables;
    returns ``[R, H * D]``."""
    rows = b.rows
    return native_kernels.paged_decode_attention(
        lib, q.reshape(rows, kv_heads, group, dim).contiguous(), pool,
        b.tables, b.lengths, scale).view(rows, n_heads * dim)


def _gathered_attention(b: _AttnPart, q: torch.Tensor, pool: torch.Tensor, n_heads: int,
                        kv_heads: int, group: int, dim: int, block_size: int,
                        scale: float) -> torch.Tensor:
    """Attention of part ``b``'s queries ``q [N, H, D]`` over K/V gathered from one layer's
    ``pool`` by block table, per group of rows, with the part's masks; returns ``[N, H * D]``."""
    rows, t_max = b.rows, b.max_new
    q_width = n_heads * dim
    block_rows = pool.numel() // (block_size * dim)
    qf = q.reshape(-1, q_width)
    if b.pad_index is not None:
        qf = qf.index_select(0, b.pad_index)  # [R * T, H * D]
    # Query heads of one KV head side by side: [KV, R, G * T, D] (no K/V repeat for GQA).
    qh = qf.view(rows, t_max, kv_heads, group, dim).permute(2, 0, 3, 1, 4)
    qh = qh.reshape(kv_heads, rows, group * t_max, dim)
    parts = []
    for g in b.groups:
        gathered = pool.view(block_rows, -1).index_select(0, g.gather_index).to(q.dtype)
        gathered = gathered.view(2 * kv_heads, g.end - g.start, g.ctx_len, dim)
        k, v = gathered[:kv_heads], gathered[kv_heads:]  # [KV, rows, L, D]
        q_g = qh if len(b.groups) == 1 else qh[:, g.start:g.end]
        if g.causal:
            # A prompt's first chunk: is_causal lets the flash kernel skip the masked half
            # (about 30 % of a 1,024-token chunk's attention) and read no mask.
            length = q_g.shape[2] // group
            o_g = F.scaled_dot_product_attention(
                q_g.view(kv_heads, group, length, dim),
                k.expand(kv_heads, group, g.ctx_len, dim),
                v.expand(kv_heads, group, g.ctx_len, dim), is_causal=True, scale=scale)
            parts.append(o_g.view(kv_heads, 1, group * length, dim))
            continue
        parts.append(F.scaled_dot_product_attention(q_g, k, v,
                                                    attn_mask=g.additive_mask(q.dtype),
                                                    scale=scale))
    o = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)  # [KV, R, G * T, D]
    o = o.view(kv_heads, rows, group, t_max, dim).permute(1, 3, 0, 2, 4)
    o = o.reshape(rows * t_max, q_width)
    if b.unpad_index is not None:
        o = o.index_select(0, b.unpad_index)
    return o


def _attend(lib: Any, b: _Batch, q: torch.Tensor, pool: torch.Tensor, n_heads: int,
            kv_heads: int, group: int, dim: int, block_size: int, scale: float) -> torch.Tensor:
    """Attention of the pass's packed queries ``q [N, H, D]`` over one layer's ``pool``, part by
    part (a mixed pass: its prefill rows' part gathered, or through the native prefill kernel
    in bf16; its decode rows' part through the native decode kernel); returns ``[N, H * D]``."""
    outs = []
    for part in b.parts:
        q_part = q if len(b.parts) == 1 else q[part.token_start:part.token_end]
        if part.row_offsets is not None and part.row_positions is not None:
            # Prefill through the native kernel: K/V read in place along the block tables.
            assert part.tables is not None
            outs.append(native_prefill.prefill_attention(
                lib, q_part.reshape(-1, kv_heads, group, dim).contiguous(), pool, part.tables,
                part.row_offsets, part.row_positions, scale).view(-1, n_heads * dim))
        elif part.tables is not None:
            # Decode through the native kernel: K/V read in place from the pool.
            outs.append(_paged_attention(lib, part, q_part, pool, n_heads, kv_heads, group, dim,
                                         scale))
        else:
            outs.append(_gathered_attention(part, q_part, pool, n_heads, kv_heads, group, dim,
                                            block_size, scale))
    return outs[0] if len(outs) == 1 else torch.cat(outs)
