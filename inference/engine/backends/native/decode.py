"""A model's decode pass one native call per layer: bf16 on a CPU with AVX512-BF16, or fp32 over
Q4_1 projections (``QUANTIZATION=q4_1``).

:class:`DecodeLayers` runs ``decode_layer.c``: for a pass in which every row decodes one token,
a layer's RMSNorms, projections (bf16: over the weights packed for
:mod:`inference.engine.backends.native.gemm`; fp32: over the GGUF file's Q4_1 blocks,
:mod:`inference.engine.backends.native.quant`), rotary embedding, K/V write, paged decode
attention, SiLU-gated MLP and residual adds are one C call instead of some thirty PyTorch
operations. At one row (a single stream) those operations' dispatch cost about a quarter of a
step; the arithmetic and its roundings are the PyTorch pass's (see ``decode_layer.c``).
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Sequence
from typing import Any

import torch

from inference.engine.backends.native import gemm as native_gemm

SYMBOLS = {torch.bfloat16: "decode_layer_bf16", torch.float32: "decode_layer_q4_1"}

_ERRORS = {
    1: "a row length below 1, a length or position beyond its block table or the rotary "
       "tables, or a slot outside the pool",
    2: "out of memory for the layer's activations",
    3: "a block table names a block outside the pool",
    4: "a model size the kernels do not take",
    5: "the kernel library was built without AVX512-BF16",
}


class _LayerT(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in (
        "ln1_w", "ln2_w", "w_qkv", "w_o", "w_gate_up", "w_down", "b_qkv", "b_o", "b_gate_up",
        "b_down", "pool", "p_qkv", "p_o", "p_gate_up", "p_down")] + [
        ("eps1", ctypes.c_double), ("eps2", ctypes.c_double)]


class _DimsT(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in (
        "hidden", "n_heads", "kv_heads", "head_dim", "intermediate", "num_blocks",
        "block_size", "max_positions", "int8_activations", "kv_bf16", "dense_above", "x16")] + [
        ("scale", ctypes.c_double)]


class _PassT(ctypes.Structure):
    _fields_ = [("tokens", ctypes.c_int64), ("positions", ctypes.c_void_p),
                ("slots", ctypes.c_void_p), ("p_rows", ctypes.c_int64),
                ("p_max_blocks", ctypes.c_int64), ("p_tables", ctypes.c_void_p),
                ("p_token_start", ctypes.c_void_p), ("p_pos_start", ctypes.c_void_p),
                ("d_rows", ctypes.c_int64), ("d_max_blocks", ctypes.c_int64),
                ("d_tables", ctypes.c_void_p), ("d_lens", ctypes.c_void_p),
                ("work", ctypes.c_void_p)]


def declare(lib: ctypes.CDLL) -> None:
    """The argument types of ``decode_layer.c``'s symbols on ``lib``."""
    for symbol in SYMBOLS.values():
        fn = getattr(lib, symbol)
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 3 + [ctypes.c_void_p,
                                                                      ctypes.c_int64]
    lib.pass_layer_bf16.restype = ctypes.c_int
    lib.pass_layer_bf16.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64, ctypes.c_void_p,
                                                            ctypes.c_int64]
    lib.pass_layer_bf16_work.restype = ctypes.c_int64
    lib.pass_layer_bf16_work.argtypes = [ctypes.c_void_p, ctypes.c_int64]


def supported(lib: Any, dtype: torch.dtype, layers: Sequence[Any], activation: Any,
              head_dim: int) -> bool:
    """Whether :class:`DecodeLayers` runs a model: every layer's projections (``layer.packed``)
    bf16 packed (a bf16 model, ``lib`` built with AVX512-BF16) or Q4_1 blocks (an fp32 model),
    no q/k norms, SiLU, an even head size up to 1,024."""
    if not (lib and activation is torch.nn.functional.silu and head_dim % 2 == 0
            and 0 < head_dim <= 1024 and len(layers) > 0
            and all(layer.packed is not None and layer.q_norm is None and layer.k_norm is None
                    for layer in layers)):
        return False
    projections = [p for layer in layers for p in layer.packed]
    if dtype == torch.bfloat16:
        return (bool(lib.bf16_packed_matmul_available())
                and all(isinstance(getattr(p, "packed", None), torch.Tensor)
                        for p in projections))
    return dtype == torch.float32 and all(getattr(p, "kind", "") == "q4_1" for p in projections)


def _bias(projection: Any) -> int | None:
    return None if projection.bias is None else projection.bias.data_ptr()


class DecodeLayers:
    """Every layer of a model with packed bf16 or Q4_1 projections (:func:`supported`), for
    decode passes of up to :attr:`max_rows` rows.

    Built once (the layer descriptors hold the weights' addresses; the weights must outlive it);
    :meth:`bind` points it at a KV pool, :meth:`__call__` runs one layer.

    Attributes:
        dtype: the activations' dtype (bf16, or fp32 over Q4_1); the pool's is the same, or
            bf16 under fp32 (a Q4_1 model's KV cache in bf16).
        max_rows: most rows of a pass (Q4_1 without the projections' values packed in bf16:
            their ``fused_max_rows``, beyond which the PyTorch pass runs them dense; with them,
            any: a pass of more rows takes the packed bf16 products in the same call).
    """

    def __init__(self, lib: ctypes.CDLL, layers: Sequence[Any], *, n_heads: int, kv_heads: int,
                 head_dim: int, scale: float, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Describe ``layers`` (each with ``packed``: four
        :class:`~inference.engine.backends.native.gemm.PackedLinear`, or four Q4_1
        :class:`~inference.engine.backends.native.quant.QuantLinear`) for ``lib``.

        ``cos``/``sin``: ``[positions, head_dim]`` rotary tables, bf16 for packed layers, fp32
        for Q4_1 ones.

        Raises:
            ValueError: for rotary tables of another dtype or width.
        """
        quantized = getattr(layers[0].packed[0], "kind", "") == "q4_1"
        self.dtype = torch.float32 if quantized else torch.bfloat16
        # Q4_1: the bf16 packed copies of the dense product (hf.quantized._dense_product)
        dense = [[getattr(getattr(p, "_dense_fn", None), "packed", None) for p in layer.packed]
                 for layer in layers] if quantized else []
        # Q4_1 on AVX-512 VNNI: every projection's blocks interleaved (QuantLinear.x16), or none
        self._x16 = int(quantized and all(getattr(p, "x16", None) is not None
                                          for layer in layers for p in layer.packed))
        # Passes of up to this many rows take the products over the blocks: any, over x16
        # blocks (QuantLinear); else the projections' own bound.
        self._dense_above = (0 if not quantized else sys.maxsize if self._x16
                             else min(p.fused_max_rows for layer in layers for p in layer.packed))
        whole = not quantized or all(d is not None for row in dense for d in row)
        self.max_rows = sys.maxsize if whole else self._dense_above
        if (not quantized and not native_gemm.amx_kernel(lib)
                and all(getattr(p, "onednn", None) is not None
                        for layer in layers for p in layer.packed)):
            # AMX without the kernel's AMX path: passes of more rows run faster through the
            # layer loop's oneDNN products
            self.max_rows = native_gemm.AMX_MIN_ROWS - 1
        if (cos.dtype != self.dtype or sin.dtype != self.dtype or cos.dim() != 2
                or cos.shape != sin.shape or cos.shape[1] != head_dim):
            raise ValueError(f"decode layers: rotary tables must be [positions, {head_dim}] "
                             f"{self.dtype}, got {tuple(cos.shape)} {cos.dtype}")
        declare(lib)
        self._fn = getattr(lib, SYMBOLS[self.dtype])
        self._lib, self._fn_work = lib, lib.pass_layer_bf16_work
        self._work: torch.Tensor | None = None  # run_pass's scratch, kept between passes
        self._pass_keep: list[torch.Tensor] = []
        self._cos, self._sin = cos.contiguous(), sin.contiguous()
        self._keep: list[torch.Tensor] = []
        self._layers: list[_LayerT] = []
        first = layers[0].packed
        self._hidden = first[0].in_features
        self._intermediate = first[3].in_features
        self._dims = (n_heads, kv_heads, head_dim, scale)
        self._int8 = int(quantized and bool(layers[0].packed[0].int8_activations))
        for layer in layers:
            ln1 = layer.ln1_w.detach().to(self.dtype).contiguous()
            ln2 = layer.ln2_w.detach().to(self.dtype).contiguous()
            self._keep += [ln1, ln2]
            qkv, o, gate_up, down = layer.packed
            weights = [(p.packed if not quantized else p.x16 if self._x16 else p.blocks
                        ).data_ptr() for p in (qkv, o, gate_up, down)]
            packed = ([d.packed.data_ptr() for d in dense[len(self._layers)]]
                      if quantized and whole else [None] * 4)
            self._layers.append(_LayerT(
                ln1.data_ptr(), ln2.data_ptr(), *weights, _bias(qkv), _bias(o),
                _bias(gate_up), _bias(down), None, *packed, float(layer.ln1_eps),
                float(layer.ln2_eps)))
        self._pool: torch.Tensor | None = None
        self._dims_t: _DimsT | None = None
        self._pool_ptrs: list[int] = []

    def bind(self, kv: torch.Tensor) -> None:
        """Use ``kv [layers, 2 * kv_heads, num_blocks, block_size, head_dim]`` (contiguous, in
        :attr:`dtype`) as the KV pool.

        Raises:
            ValueError: for a pool of another dtype, layer count or head shape.
        """
        n_heads, kv_heads, head_dim, scale = self._dims
        kv_dtypes = (self.dtype, torch.bfloat16)
        if (kv.dtype not in kv_dtypes or kv.dim() != 5 or not kv.is_contiguous()
                or kv.shape[0] != len(self._layers) or kv.shape[1] != 2 * kv_heads
                or kv.shape[4] != head_dim):
            raise ValueError(f"decode layers: the pool must be a contiguous [{len(self._layers)}"
                             f", {2 * kv_heads}, blocks, block_size, {head_dim}] "
                             f"{' or '.join(map(str, set(kv_dtypes)))} tensor, "
                             f"got {tuple(kv.shape)} {kv.dtype}")
        self._pool = kv
        self._dims_t = _DimsT(self._hidden, n_heads, kv_heads, head_dim, self._intermediate,
                              kv.shape[2], kv.shape[3], self._cos.shape[0], self._int8,
                              int(kv.dtype != self.dtype), self._dense_above, self._x16,
                              scale)
        step = kv.stride(0) * kv.element_size()
        self._pool_ptrs = [kv.data_ptr() + i * step for i in range(kv.shape[0])]
        for layer, ptr in zip(self._layers, self._pool_ptrs, strict=True):
            layer.pool = ptr

    def _check(self, h: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor) -> None:
        if self._dims_t is None:
            raise ValueError("decode layers: no KV pool bound (bind first)")
        rows = h.shape[0] if h.dim() == 2 else -1
        if (h.dtype != self.dtype or h.dim() != 2 or h.shape[1] != self._hidden
                or not h.is_contiguous() or tables.dtype != torch.int64 or tables.dim() != 2
                or not tables.is_contiguous() or lens.dtype != torch.int64 or lens.dim() != 1
                or not lens.is_contiguous() or tables.shape[0] != rows or lens.shape[0] != rows):
            raise ValueError(f"decode layers: h must be a contiguous [rows, {self._hidden}] "
                             f"{self.dtype} tensor, tables [rows, max_blocks] and lens [rows] "
                             f"contiguous int64; got h {tuple(h.shape)} {h.dtype}, tables "
                             f"{tuple(tables.shape)} {tables.dtype}, lens {tuple(lens.shape)} "
                             f"{lens.dtype}")

    @property
    def pool(self) -> torch.Tensor | None:
        """The pool :meth:`bind` was given, or None."""
        return self._pool

    def __call__(self, i: int, h: torch.Tensor, tables: torch.Tensor,
                 lens: torch.Tensor, lora: Any = None) -> None:
        """Run layer ``i`` over ``h [rows, hidden]`` in :attr:`dtype` (contiguous; overwritten
        with the layer's output), each row's new token at position ``lens[r] - 1``, its K/V
        written to the pool's slot that ``tables [rows, max_blocks]`` int64 names; ``lora``:
        None, or each row's LoRA adapter (:func:`inference.engine.backends.native.lora.rows`),
        whose deltas the layer adds to its projections.

        Raises:
            ValueError: before :meth:`bind`; for tensors of another dtype, layout or row count
                (checked at layer 0, once a pass); for a length or block id the pool cannot
                hold, or unsupported sizes.
            MemoryError: if the kernel cannot allocate its activations.
        """
        if i == 0:
            self._check(h, tables, lens)
        rc = self._fn(ctypes.byref(self._layers[i]), ctypes.byref(self._dims_t), h.data_ptr(),
                      self._cos.data_ptr(), self._sin.data_ptr(), tables.data_ptr(),
                      lens.data_ptr(), tables.shape[1], h.shape[0], torch.get_num_threads(),
                      lora, i)
        if rc == 2:
            raise MemoryError(f"decode layers: {_ERRORS[2]}")
        if rc:
            raise ValueError(f"decode layers: {_ERRORS.get(rc, f'error {rc}')}")

    def begin_pass(self, positions: torch.Tensor, slots: torch.Tensor,
                   prefill: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
                   decode: tuple[torch.Tensor, torch.Tensor] | None) -> _PassT:
        """Describe a bf16 pass of prompt chunks then decode rows for :meth:`run_pass`.

        Args:
            positions, slots: ``[tokens]`` int64, each new token's position in its row and its
                KV slot (``block id * block_size + offset``); the prefill rows' tokens first.
            prefill: None, or the prompt chunks' ``(tables [rows, max_blocks], token_start
                [rows + 1], pos_start [rows])`` int64 (as
                :func:`~inference.engine.backends.native.prefill.prefill_attention` takes them).
            decode: None, or the decode rows' ``(tables [rows, max_blocks], lens [rows])``
                int64, one token each, the pass's last.

        Raises:
            ValueError: for a model over Q4_1 projections (fp32 activations), before
                :meth:`bind`, or index tensors of another dtype or layout.
        """
        if self.dtype != torch.bfloat16 or self._dims_t is None:
            raise ValueError("decode layers: passes of prompt chunks run a bound bf16 model only")
        tensors = [positions, slots, *(prefill or ()), *(decode or ())]
        if any(t.dtype != torch.int64 or not t.is_contiguous() for t in tensors):
            raise ValueError("decode layers: a pass's index tensors must be contiguous int64")
        tokens = positions.shape[0]
        work = int(self._fn_work(ctypes.byref(self._dims_t), tokens))
        if self._work is None or self._work.numel() < work:
            self._work = torch.empty(work, dtype=torch.uint8)
        p_tables, p_start, p_pos = prefill or (None, None, None)
        d_tables, d_lens = decode or (None, None)
        self._pass_keep = tensors

        def ptr(t: torch.Tensor | None) -> int | None:
            return None if t is None else t.data_ptr()

        return _PassT(tokens, ptr(positions), ptr(slots),
                      0 if p_tables is None else p_tables.shape[0],
                      0 if p_tables is None else p_tables.shape[1], ptr(p_tables), ptr(p_start),
                      ptr(p_pos), 0 if d_tables is None else d_tables.shape[0],
                      0 if d_tables is None else d_tables.shape[1], ptr(d_tables),
                      ptr(d_lens), self._work.data_ptr())

    def run_pass(self, i: int, h: torch.Tensor, described: _PassT, lora: Any = None) -> None:
        """Run layer ``i`` of the pass :meth:`begin_pass` described over ``h [tokens, hidden]``
        bf16 (contiguous; overwritten with the layer's output); ``lora`` as in
        :meth:`__call__`, per token.

        Raises:
            ValueError: for ``h`` of another shape, dtype or layout (checked at layer 0), a
                position or slot outside the rotary tables or the pool, a block id outside the
                pool, or unsupported sizes.
            MemoryError: if the attention kernels cannot allocate their buffers.
        """
        if i == 0 and (h.dtype != self.dtype or h.dim() != 2 or not h.is_contiguous()
                       or h.shape != (described.tokens, self._hidden)):
            raise ValueError(f"decode layers: h must be a contiguous [{described.tokens}, "
                             f"{self._hidden}] {self.dtype} tensor, got {tuple(h.shape)} "
                             f"{h.dtype}")
        rc = self._lib.pass_layer_bf16(
            ctypes.byref(self._layers[i]), ctypes.byref(self._dims_t), h.data_ptr(),
            self._cos.data_ptr(), self._sin.data_ptr(), ctypes.byref(described),
            torch.get_num_threads(), lora, i)
        if rc == 2:
            raise MemoryError(f"decode layers: {_ERRORS[2]}")
        if rc:
            raise ValueError(f"decode layers: {_ERRORS.get(rc, f'error {rc}')}")
