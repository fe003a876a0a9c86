"""The decoder's forward pass: RMSNorm, the projections' matmul, and one pass over all layers.

:func:`_rms_norm` normalises the last dimension; :func:`_linear_cpu` computes ``F.linear`` in the
orientation that runs fastest on CPU for the few tokens of a decode pass; :class:`_Forward` (a base
class of :class:`~inference.backends.hf.backend.TransformersBackend`) runs the pass: embedding,
per layer an RMSNorm, fused q/k/v projection, rotary embedding, paged attention
(:mod:`inference.backends.hf.attention`), output projection, RMSNorm, gated MLP; final norm and
LM head.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from inference.backends.hf.attention import _gathered_attention, _paged_attention
from inference.backends.hf.batch import _Batch
from inference.backends.hf.loading import _Layer


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


# Rows (tokens in a pass) above which ``F.linear`` beats ``W @ x^T`` (crossover measured at 512).
LARGE_GEMM_ROWS = 512


def _linear_cpu(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, w, b)`` for ``x [M, K]``, ``w [N, K]``, computed as ``(w @ x^T)^T``.

    Returns a contiguous ``[M, N]`` tensor. On CPU (MKL's SGEMM) this orientation runs markedly
    faster when ``M`` (tokens in the pass) is small, as in decode. ``M`` of 8 or more is padded
    to a multiple of 8 rows (the GEMM kernels' register-block width); padded rows are dropped.
    Above ``LARGE_GEMM_ROWS`` rows plain ``F.linear`` is faster again and is used.
    Measured on a 2-core x86 CPU with the default model (the four projections of 30 layers):
    2 rows take about 1/3 of the time they take with ``F.linear``, 24 to 256 rows 0.73 to 0.85
    of it; at 1,024 rows ``F.linear`` takes 0.83 of this orientation's time, at 4,096 rows 0.75.
    """
    m = x.shape[0]
    if m > LARGE_GEMM_ROWS:
        return F.linear(x, w, b)
    padded = m if m < 8 else -(-m // 8) * 8
    if padded != m:
        x = F.pad(x, (0, 0, 0, padded - m))
    out = torch.mm(w, x.t()) if b is None else torch.addmm(b[:, None], w, x.t())
    return out.t()[:m].contiguous()


class _Forward:
    """The forward pass of :class:`~inference.backends.hf.backend.TransformersBackend`.

    A base class of the backend, which sets the attributes below (its constructor, and
    :meth:`~inference.backends.hf.backend.TransformersBackend.allocate_kv_pool` for ``_kv`` and
    ``block_size``).
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    group: int  # query heads per KV head
    scale: float  # softmax scale, ``head_dim ** -0.5``
    block_size: int
    small_batch_gemm: bool
    _native: Any  # the native kernel library (False: unavailable; None: not tried)
    _kv: torch.Tensor | None  # [layers, 2 * kv_heads, blocks, block_size, D]
    _cos: torch.Tensor  # [max_model_len, head_dim]
    _sin: torch.Tensor
    _embed: torch.Tensor
    _layers: list[_Layer]
    _act: Any
    _norm: tuple[torch.Tensor, float]
    _lm_head_w: torch.Tensor
    _lm_head_b: torch.Tensor | None

    def _forward(self, b: _Batch) -> torch.Tensor:
        """Run the decoder over batch ``b``: write its new tokens' K/V into the pool and return
        ``[R, vocab]`` logits of each row's last new token (in the model's dtype)."""
        assert self._kv is not None
        n_heads, kv_heads, dim, group = self.num_heads, self.num_kv_heads, self.head_dim, self.group
        num_tokens = b.tokens.shape[0]
        qk_heads = n_heads + kv_heads
        cos = self._cos[b.positions][:, None, :]  # [N, 1, D]
        sin = self._sin[b.positions][:, None, :]
        half = dim // 2
        kv_all = self._kv  # [layers, 2 * kv_heads, blocks, block_size, D]
        slot_rows = kv_all[0].numel() // dim
        native_lib, block_size, scale = self._native, self.block_size, self.scale

        linear = _linear_cpu if self.small_batch_gemm else F.linear
        h = F.embedding(b.tokens, self._embed)  # [N, hidden]
        for i, layer in enumerate(self._layers):
            x = _rms_norm(h, layer.ln1_w, layer.ln1_eps)
            qkv = linear(x, layer.w_qkv, layer.b_qkv)  # [N, (H + 2 KV) * D]
            qk = qkv[:, : qk_heads * dim].reshape(num_tokens, qk_heads, dim)
            if layer.q_norm is not None and layer.k_norm is not None:
                qk = torch.cat([
                    _rms_norm(qk[:, :n_heads], *layer.q_norm),
                    _rms_norm(qk[:, n_heads:], *layer.k_norm),
                ], dim=1)
            rotated = torch.cat([-qk[..., half:], qk[..., :half]], dim=-1)
            qk = qk * cos + rotated * sin  # [N, H + KV, D]
            q = qk[:, :n_heads]
            kv_new = torch.cat(
                [qk[:, n_heads:], qkv[:, qk_heads * dim:].reshape(num_tokens, kv_heads, dim)], dim=1
            )  # [N, 2 KV, D]

            pool = kv_all[i]  # [2 KV, blocks, block_size, D]
            kv_new = kv_new.transpose(0, 1).reshape(-1, dim)  # [2 KV * N, D]
            pool.view(slot_rows, dim).index_copy_(0, b.write_index, kv_new)

            if b.tables is not None:
                # Decode through the native kernel: K/V read in place from the pool.
                o = _paged_attention(native_lib, b, q, pool, n_heads, kv_heads, group, dim, scale)
            else:
                o = _gathered_attention(b, q, pool, n_heads, kv_heads, group, dim, block_size,
                                        scale)
            h = h + linear(o, layer.w_o, layer.b_o)

            x = _rms_norm(h, layer.ln2_w, layer.ln2_eps)
            gate_up = linear(x, layer.w_gate_up, layer.b_gate_up)
            gate, up = gate_up.chunk(2, dim=-1)
            h = h + linear(self._act(gate) * up, layer.w_down, layer.b_down)

        h = _rms_norm(h.index_select(0, b.last_index), *self._norm)
        return linear(h, self._lm_head_w, self._lm_head_b)  # [R, vocab]
