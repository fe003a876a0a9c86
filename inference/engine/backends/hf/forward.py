"""The decoder's forward pass: RMSNorm, the projections' matmul, and one pass over all layers.

:func:`_rms_norm` normalises the last dimension; :func:`_linear_cpu` computes ``F.linear`` in the
orientation that runs fastest on CPU for the few tokens of a decode pass; :class:`_Forward` (a base
class of :class:`~inference.engine.backends.hf.backend.TransformersBackend`) runs the pass:
embedding, per layer an RMSNorm, fused q/k/v projection, rotary embedding, paged attention
(:mod:`inference.engine.backends.hf.attention`), output projection, RMSNorm, gated MLP; final norm
and LM head.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from inference.engine.backends import native as native_kernels
from inference.engine.backends.base import PassYielded
from inference.engine.backends.hf.attention import _attend
from inference.engine.backends.hf.batch import _Batch
from inference.engine.backends.hf.loading import _Layer
from inference.engine.backends.native import elementwise as native_elementwise
from inference.engine.backends.native import gemm as native_gemm
from inference.engine.backends.native import lora as native_lora_kernel
from inference.engine.lora import add_deltas

# Most tokens of a pass whose adapters' deltas the native kernel adds (token by token); a pass of
# more, or one without the kernel, takes PyTorch's grouped products (inference.engine.lora). The
# kernel wins at every size measured: a 16-row decode pass of the default model in bf16, 12 rows
# under 4 adapters, took 67 ms against 58 ms bare (PyTorch's deltas: 114 ms); a 256-token
# prefill pass of 4 rows under 4 adapters as long as the bare one (PyTorch's: 1.4x), Intel Xeon
# family 6 model 207, 2 cores.
NATIVE_LORA_MAX_TOKENS = 1 << 16


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


# Rows (tokens in a pass) up to which ``W @ x^T`` beats ``F.linear``, per dtype; a dtype not
# named here always takes ``F.linear``. fp32: crossover measured at 512 (see _linear_cpu).
# bf16: none. Each projection of the default model (qkv 960x576, o 576x576, gate_up 3072x576,
# down 576x1536, lm_head 49152x576), fastest of 21 interleaved rounds, 2 threads, on an AVX-512
# CPU without native bf16 (oneDNN converts): ``W @ x^T`` takes 0.95 to 1.11 of ``F.linear``'s
# time at every M of 1, 16, 32, ..., 1024 rows, 1.4 to 1.7 at 8 rows and 4 to 5 at 2 rows.
SMALL_GEMM_MAX_ROWS = {torch.float32: 512}


def _linear_cpu(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, w, b)`` for ``x [M, K]``, ``w [N, K]``, in the orientation that runs faster
    on CPU for ``M`` rows in ``x``'s dtype (:data:`SMALL_GEMM_MAX_ROWS`).

    Returns a contiguous ``[M, N]`` tensor. In fp32 up to 512 rows it computes ``(w @ x^T)^T``:
    on CPU (MKL's SGEMM) this orientation runs markedly faster when ``M`` (tokens in the pass) is
    small, as in decode. ``M`` of 8 or more is padded to a multiple of 8 rows (the GEMM kernels'
    register-block width); padded rows are dropped. Above 512 rows, and in bf16 at any ``M``,
    plain ``F.linear`` is used. Measured on a 2-core x86 CPU with the default model in fp32 (the
    four projections of 30 layers): 2 rows take about 1/3 of the time they take with
    ``F.linear``, 24 to 256 rows 0.73 to 0.85 of it; at 1,024 rows ``F.linear`` takes 0.83 of
    this orientation's time, at 4,096 rows 0.75.
    """
    m = x.shape[0]
    if m > SMALL_GEMM_MAX_ROWS.get(x.dtype, 0):
        return F.linear(x, w, b)
    padded = m if m < 8 else -(-m // 8) * 8
    if padded != m:
        x = F.pad(x, (0, 0, 0, padded - m))
    out = torch.mm(w, x.t()) if b is None else torch.addmm(b[:, None], w, x.t())
    return out.t()[:m].contiguous()


def _describe_pass(fused: Any, b: _Batch) -> Any:
    """``fused.begin_pass`` of batch ``b`` when its layers can run one native call each: a bf16
    model, its prompt chunks' attention by the native prefill kernel (a first part with
    ``row_offsets``), and any decode rows' by the native decode kernel (a last part with
    ``tables`` and ``lengths``); else None."""
    if fused.dtype != torch.bfloat16 or not b.parts or b.parts[0].row_offsets is None:
        return None
    first, rest = b.parts[0], b.parts[1:]
    if first.tables is None or first.row_positions is None or len(rest) > 1:
        return None
    decode = None
    if rest:
        last = rest[0]
        if last.tables is None or last.lengths is None or last.row_offsets is not None:
            return None
        decode = (last.tables, last.lengths)
    tokens = b.tokens.shape[0]
    return fused.begin_pass(b.positions, b.write_index[:tokens],
                            (first.tables, first.row_offsets, first.row_positions), decode)


class _Forward:
    """The forward pass of :class:`~inference.engine.backends.hf.backend.TransformersBackend`.

    A base class of the backend, which sets the attributes below (its constructor, and
    :meth:`~inference.engine.backends.hf.backend.TransformersBackend.allocate_kv_pool` for
    ``_kv`` and ``block_size``).
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
    # (final norm weight, eps, LM head bias) in fp32 for a bf16/fp16 model on CPU
    _head_fp32: tuple[torch.Tensor, float, torch.Tensor | None] | None = None
    # the LM head's weight in fp32, for passes with more logit rows than the native kernel takes
    _head_w_fp32: torch.Tensor | None = None
    # the LM head over its packed weight (a bf16 model on a CPU with AVX512-BF16), see _logits
    _lm_head_packed: Any = None
    packed_gemm: bool = False
    # the LM head over the GGUF file's Q8_0 embedding (QUANTIZATION=q4_1, hf.quantized), or None
    _lm_head_q: Any = None
    yield_check: Callable[[], bool] | None = None  # ModelBackend's: asked before each layer
    fused_decode: bool = False  # decode passes through _decode_layers (native.decode)
    # bf16 passes with prompt chunks (and decode rows) one native call per layer, where the
    # prefill attention kernel runs them (native.decode.DecodeLayers.run_pass)
    fused_prefill: bool = True
    _decode_layers: Any = None
    # bf16 passes through the layer loop below: the elementwise steps native (native.elementwise)
    native_steps: bool = True

    def _forward(self, b: _Batch) -> torch.Tensor:
        """Run the decoder over batch ``b``: write its new tokens' K/V into the pool and return
        ``[R + extra, vocab]`` logits of the tokens ``b.logit_index`` names (each row's last new
        token, then the other tokens of rows that asked for all; fp32 on CPU, see
        :meth:`_logits`; the model's dtype elsewhere)."""
        assert self._kv is not None
        n_heads, kv_heads, dim, group = self.num_heads, self.num_kv_heads, self.head_dim, self.group
        num_tokens = b.tokens.shape[0]
        kv_all = self._kv  # [layers, 2 * kv_heads, blocks, block_size, D]
        native_lib, block_size, scale = self._native, self.block_size, self.scale

        linear = _linear_cpu if self.small_batch_gemm else F.linear
        packed_gemm = self.packed_gemm
        h = F.embedding(b.tokens, self._embed)  # [N, hidden]
        give_way = self.yield_check
        fused, part, lora = self._decode_layers, b.parts[0], b.lora
        # The adapters' deltas by the native kernel (token by token: NATIVE_LORA_MAX_TOKENS).
        native_lora = (native_lora_kernel.rows(b.lora_tokens)
                       if lora and native_lib and num_tokens <= NATIVE_LORA_MAX_TOKENS
                       and all(s.weights.dtype == h.dtype for s in lora) else None)
        if (fused is not None and packed_gemm and self.fused_decode and len(b.parts) == 1
                and (not lora or native_lora is not None)
                and part.tables is not None and part.lengths is not None
                and part.row_offsets is None and num_tokens == b.rows <= fused.max_rows):
            # A decode pass: one native call per layer (native.decode).
            if fused.pool is not kv_all:
                fused.bind(kv_all)
            for i in range(len(self._layers)):
                if give_way is not None and give_way():
                    raise PassYielded(f"stopped before layer {i}")
                fused(i, h, part.tables, part.lengths, native_lora)
            return self._logits(h.index_select(0, b.logit_index), linear)

        described = None
        if (fused is not None and packed_gemm and self.fused_prefill
                and fused.dtype == torch.bfloat16 and (not lora or native_lora is not None)):
            if fused.pool is not kv_all:
                fused.bind(kv_all)
            described = _describe_pass(fused, b)
        if described is not None:
            # Prompt chunks (then decode rows): one native call per layer.
            for i in range(len(self._layers)):
                if give_way is not None and give_way():
                    raise PassYielded(f"stopped before layer {i}")
                fused.run_pass(i, h, described, native_lora)
            return self._logits(h.index_select(0, b.logit_index), linear)

        # bf16 on a CPU with AVX512-BF16: the elementwise steps as three native calls a layer
        # (native.elementwise), the products and attention as below.
        ew = (native_elementwise.Elementwise(native_lib, self._cos, self._sin,
                                             torch.get_num_threads())
              if self.native_steps and self._layers and native_elementwise.supported(
                  native_lib, h, kv_all, self._layers[0], self._cos, self._act) else None)
        if ew is None:
            cos = self._cos[b.positions][:, None, :]  # [N, 1, D]
            sin = self._sin[b.positions][:, None, :]
        slot_rows = kv_all[0].numel() // dim
        slots = b.write_index[:num_tokens]
        pending = None  # the last residual delta not yet added to h (native steps)
        for i, layer in enumerate(self._layers):
            if give_way is not None and give_way():
                raise PassYielded(f"stopped before layer {i}")
            packed = layer.packed if packed_gemm else None
            x = (ew.add_rms_norm(h, pending, layer.ln1_w, layer.ln1_eps) if ew
                 else _rms_norm(h, layer.ln1_w, layer.ln1_eps))
            # [N, (H + 2 KV) * D]
            qkv = packed[0](x) if packed else linear(x, layer.w_qkv, layer.b_qkv)
            if lora:
                qkv = self._lora(qkv, x, lora, native_lora, i, "qkv")
            pool = kv_all[i]  # [2 KV, blocks, block_size, D]
            if ew:
                q = ew.rope_kv_write(qkv.contiguous(), b.positions, slots, pool, n_heads,
                                     kv_heads, dim)
            else:
                q = self._rope_kv_write(layer, qkv, cos, sin, pool, b.write_index, slot_rows)

            o = _attend(native_lib, b, q, pool, n_heads, kv_heads, group, dim, block_size,
                        scale)  # [N, H * D]
            o_out = packed[1](o) if packed else linear(o, layer.w_o, layer.b_o)
            if lora:
                o_out = self._lora(o_out, o, lora, native_lora, i, "o")
            if ew:
                x = ew.add_rms_norm(h, o_out.contiguous(), layer.ln2_w, layer.ln2_eps)
            else:
                h = h + o_out
                x = _rms_norm(h, layer.ln2_w, layer.ln2_eps)
            gate_up = (packed[2](x) if packed
                       else linear(x, layer.w_gate_up, layer.b_gate_up))
            if lora:
                gate_up = self._lora(gate_up, x, lora, native_lora, i, "gate_up")
            if ew:
                act = ew.silu_mul(gate_up.contiguous())
            else:
                gate, up = gate_up.chunk(2, dim=-1)
                act = self._act(gate) * up
            down = packed[3](act) if packed else linear(act, layer.w_down, layer.b_down)
            if lora:
                down = self._lora(down, act, lora, native_lora, i, "down")
            if ew:
                pending = down.contiguous()
            else:
                h = h + down
        if pending is not None:
            h = h + pending

        return self._logits(h.index_select(0, b.logit_index), linear)  # [R + extra, vocab]

    def _rope_kv_write(self, layer: _Layer, qkv: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor, pool: torch.Tensor, write_index: torch.Tensor,
                       slot_rows: int) -> torch.Tensor:
        """The rotary embedding of ``qkv [N, (H + 2 KV) * D]``'s q and k heads (after the
        layer's q/k norms, if any), its K/V written to ``pool`` at ``write_index``; returns the
        queries ``[N, H, D]``."""
        n_heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        num_tokens, qk_heads, half = qkv.shape[0], n_heads + kv_heads, dim // 2
        qk = qkv[:, : qk_heads * dim].reshape(num_tokens, qk_heads, dim)
        if layer.q_norm is not None and layer.k_norm is not None:
            qk = torch.cat([
                _rms_norm(qk[:, :n_heads], *layer.q_norm),
                _rms_norm(qk[:, n_heads:], *layer.k_norm),
            ], dim=1)
        rotated = torch.cat([-qk[..., half:], qk[..., :half]], dim=-1)
        qk = qk * cos + rotated * sin  # [N, H + KV, D]
        kv_new = torch.cat(
            [qk[:, n_heads:], qkv[:, qk_heads * dim:].reshape(num_tokens, kv_heads, dim)], dim=1
        )  # [N, 2 KV, D]
        kv_new = kv_new.transpose(0, 1).reshape(-1, dim)  # [2 KV * N, D]
        pool.view(slot_rows, dim).index_copy_(0, write_index, kv_new.to(pool.dtype))
        return qk[:, :n_heads]

    def _lora(self, y: torch.Tensor, x: torch.Tensor, lora: list[Any], native: Any, layer: int,
              proj: str) -> torch.Tensor:
        """``y`` (a projection's output over ``x``) plus the pass's adapters' deltas: by the
        native kernel over the tokens' table ``native`` (None: in PyTorch)."""
        if native is None:
            return add_deltas(y, x, lora, layer, proj)
        y = y.contiguous()
        native_lora_kernel.add(self._native, y, x.contiguous(), native, layer, proj)
        return y

    def _logits(self, h: torch.Tensor, linear: Any) -> torch.Tensor:
        """``[R, vocab]`` logits of the hidden states ``h [R, hidden]``: final norm and LM head.

        On CPU a model in bf16 (or fp16) gets fp32 logits: the final norm and the LM head run in
        fp32 over ``h`` widened exactly to fp32. The head's product: with ``packed_gemm``, the
        packed kernel (:mod:`inference.engine.backends.native.gemm`) over the normed ``x`` split in
        bf16 hi and lo parts (within 2^-17 of it), summed in fp32; else up to
        :func:`~inference.engine.backends.native.bf16_weight_matmul_max_rows` rows, the native
        kernel over the bf16 weight (fp32 results from half the bytes: on VDPBF16PS with the fp32
        input split in two bf16 parts, within 2^-17 of it, or over exactly widened weights); more
        rows, or without the kernel, an fp32 matmul over an fp32 copy of the weight (made on first
        use; ``vocab * hidden * 4`` bytes). A bf16 matmul would round every logit to bf16 (8
        significant bits: up to 0.06 off at a logit of 16, and many exact ties), and PyTorch
        2.13 has no CPU matmul of bf16 inputs with an fp32 output. Elsewhere (fp32, or CUDA and
        MPS) they run in the model's dtype.
        """
        if self._lm_head_q is not None:
            return self._lm_head_q(_rms_norm(h, *self._norm))
        if h.dtype == torch.float32 or h.device.type != "cpu":
            return linear(_rms_norm(h, *self._norm), self._lm_head_w, self._lm_head_b)
        if self._head_fp32 is None:
            norm_w, eps = self._norm
            bias = None if self._lm_head_b is None else self._lm_head_b.float()
            self._head_fp32 = (norm_w.float(), eps, bias)
        norm_w, eps, bias = self._head_fp32
        x = _rms_norm(h.float(), norm_w, eps)
        if self.packed_gemm and self._lm_head_packed is not None:
            # VDPBF16PS over the packed head, x split in bf16 hi and lo: fp32 logits at the
            # speed of a bf16 product (inference.engine.backends.native.gemm).
            return self._lm_head_packed(native_gemm.split_fp32(x), out_fp32=True)
        lib, w = self._native, self._lm_head_w
        if (lib and w.dtype == torch.bfloat16
                and x.shape[0] <= native_kernels.bf16_weight_matmul_max_rows(lib)):
            # Half the bytes of the fp32 copy: at decode the head is bound by memory bandwidth.
            return native_kernels.bf16_weight_matmul(lib, x.contiguous(), w.contiguous(), bias)
        if self._head_w_fp32 is None:
            self._head_w_fp32 = w.float()
        return linear(x, self._head_w_fp32, bias)
