"""The transformers backend itself: :class:`TransformersBackend` over a paged KV block pool.

It loads the model (through :mod:`inference.engine.backends.hf.loading`), allocates the KV pool, and
runs prefill chunks and decode rows: it builds each pass's batch
(:mod:`inference.engine.backends.hf.batch`) and runs the forward pass of its base class
(:mod:`inference.engine.backends.hf.forward`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from inference.engine.backends import native as native_kernels
from inference.engine.backends.base import DecodeRow, ModelBackend, PrefillChunk
from inference.engine.backends.hf.batch import MAX_ATTENTION_GROUPS, _make_batch
from inference.engine.backends.hf.forward import _Forward
from inference.engine.backends.hf.loading import (
    _activation,
    _context_limit,
    _eps,
    _fuse_layer,
    _rotary_tables,
    check_architecture,
    load_model,
    resolve_device,
    resolve_dtype,
)
from inference.engine.backends.hf.lora_rows import _LoraRows
from inference.engine.backends.hf.quantized import load_q4_1
from inference.engine.backends.native import decode as native_decode
from inference.engine.backends.native import elementwise as native_elementwise
from inference.engine.backends.native import gemm as native_gemm
from inference.engine.backends.native import lora as native_lora
from inference.engine.backends.native import prefill as prefill_kernel
from inference.engine.model_store import ModelLoadError, default_gguf_path, resolve_model_path
from inference.tokenization import Tokenizer, TokenizerLoadError

logger = logging.getLogger(__name__)


class TransformersBackend(_LoraRows, _Forward, ModelBackend):
    """A Hugging Face causal LM over a paged KV block pool (see
    :mod:`inference.engine.backends.hf`).

    Attributes:
        tokenizer: the model's tokenizer and chat template (:mod:`inference.tokenization`).
        vocab_size: logits per row.
        max_model_len: longest sequence (prompt + output, tokens) the backend accepts.
        device, dtype: where and in which precision the weights and KV pool live.
        attention_groups: most groups of similar-length rows a decode step's attention runs
            over (1: all rows gathered to the longest row's length).
        small_batch_gemm: compute projections as ``W @ x^T``
            (:func:`~inference.engine.backends.hf.forward._linear_cpu`); on by
            default on CPU, off elsewhere (``F.linear``).
        native_attention: run decode attention with the native paged kernel
            (:mod:`inference.engine.backends.native`), reading K/V straight from the pool; on by
            default for fp32 and bf16 on CPU, and off by itself where the kernel cannot be built (no
            C compiler).
        native_prefill_attention: run a bf16 model's prefill attention (prompt chunks, at any
            offset) with the native prefill kernel
            (:mod:`inference.engine.backends.native.prefill`), reading K/V from the pool along the
            block tables; on by default, used where the kernel runs (bf16 on a CPU with
            AVX512-BF16, head size 64), else the gather path.
        packed_gemm: compute a bf16 model's projections and LM head with the native packed
            kernel (:mod:`inference.engine.backends.native.gemm`) over copies of the weights packed
            at load time (as many bytes again as the layers' and the head's weights); on by
            default for bf16 on a CPU with AVX512-BF16, unavailable elsewhere.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Tokenizer,
        *,
        max_model_len: int = 0,
        kernel_dir: str = "",
    ) -> None:
        """Wrap a loaded ``*ForCausalLM`` ``model`` (eval mode, on its device and dtype).

        Raises:
            ModelLoadError: if the architecture is not a supported decoder layout.
        """
        cfg = model.config
        check_architecture(cfg)
        self.tokenizer = tokenizer
        self.vocab_size = int(cfg.vocab_size)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        # The KV pool's: the model's, or bf16 under QUANTIZATION=q4_1 (from_pretrained).
        self.kv_dtype = self.dtype
        self.num_layers = int(cfg.num_hidden_layers)
        self.num_heads = int(cfg.num_attention_heads)
        self.num_kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self.num_heads)
        self.head_dim = int(
            getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        )
        self.group = self.num_heads // self.num_kv_heads
        self.scale = self.head_dim**-0.5
        self.max_model_len = _context_limit(cfg, max_model_len)

        inner = model.model
        self._embed = inner.embed_tokens.weight
        self._norm = (inner.norm.weight, float(_eps(inner.norm)))
        self._lm_head_w = model.lm_head.weight
        self._lm_head_b = getattr(model.lm_head, "bias", None)
        self._layers = [_fuse_layer(layer) for layer in inner.layers]
        self._act = _activation(cfg)
        # Speed settings, both on by default (``benchmarks/kernels/decode_step.py`` compares them).
        self.attention_groups = MAX_ATTENTION_GROUPS
        self.small_batch_gemm = self.device.type == "cpu"
        self.native_attention = (self.device.type == "cpu"
                                 and (self.dtype, self.dtype) in native_kernels.SYMBOLS)
        # The kernel library (built now, before serving; False: unavailable; None: not tried).
        self._native: Any = None
        self._kernel_dir = kernel_dir
        self.packed_gemm = False
        self.quantization = ""  # "q4_1": projections over GGUF blocks (hf.quantized)
        # Prefill attention by the native kernel where it runs (bf16, AVX512-BF16, head 64).
        self.native_prefill_attention = True
        self._prefill_kernel_runs = False  # set with the library (_load_native)
        if self.native_attention:
            self._load_native()
        # [max_model_len, head_dim] each
        self._cos, self._sin = _rotary_tables(inner, self.max_model_len, self.device, self.dtype)
        # Decode passes one native call per layer (bf16 packed or Q4_1 projections).
        self.fused_decode = True
        self._decode_layers = None
        self._build_decode_layers()
        self._model = model
        self._kv: torch.Tensor | None = None
        self.num_blocks = 0
        self.block_size = 0

    # ----------------------------------------------------------------------------- loading

    @classmethod
    def from_config(cls, config: Any) -> TransformersBackend:
        """Load the backend an :class:`~inference.engine.config.EngineConfig` describes.

        Uses ``model_path`` (empty: the default model, prepared on first use), ``device``,
        ``dtype``, ``max_model_len`` and ``llm_kernel_dir``.

        Raises:
            ModelLoadError: for a missing or broken model folder, an unsupported architecture, an
                unknown dtype or an unavailable device.
        """
        gguf = ""
        if config.quantization:
            gguf = config.quantized_weights or str(default_gguf_path())
        return cls.from_pretrained(
            resolve_model_path(config.model_path),
            device=config.device,
            dtype=config.dtype,
            max_model_len=config.max_model_len,
            kernel_dir=config.llm_kernel_dir,
            quantization=config.quantization,
            quantized_weights=gguf,
            kv_cache_dtype=config.kv_cache_dtype,
        )

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        device: str = "auto",
        dtype: str = "auto",
        max_model_len: int = 0,
        kernel_dir: str = "",
        quantization: str = "",
        quantized_weights: str | Path = "",
        kv_cache_dtype: str = "auto",
    ) -> TransformersBackend:
        """Load a local Hugging Face model folder (offline) and wrap it; with ``quantization``
        ``q4_1``, its projections run over the Q4_1 weights of the GGUF file
        ``quantized_weights`` (:mod:`inference.engine.backends.hf.quantized`), in fp32, over a
        KV cache in bf16 (``kv_cache_dtype`` auto or bfloat16) or fp32.

        Raises:
            ModelLoadError: as :meth:`from_config`, and for a GGUF file that is not this model's.
        """
        if quantization and dtype not in ("auto", "float32"):
            raise ModelLoadError(f"QUANTIZATION={quantization} computes in float32, not {dtype}")
        # Quantized weights run on the CPU kernels: "auto" is the CPU even where a GPU is.
        dev = resolve_device("cpu" if quantization and device == "auto" else device)
        torch_dtype = torch.float32 if quantization else resolve_dtype(dtype, dev)
        path = str(path)
        model = load_model(path, dev, torch_dtype)
        try:
            tokenizer = Tokenizer.from_folder(path)
        except TokenizerLoadError as exc:
            raise ModelLoadError(f"model path {path!r}: cannot load its tokenizer: {exc}") from exc
        backend = cls(model, tokenizer, max_model_len=max_model_len, kernel_dir=kernel_dir)
        if quantization:
            if quantization != "q4_1" or dev.type != "cpu":
                raise ModelLoadError(f"QUANTIZATION={quantization!r} runs on CPU with q4_1 only")
            load_q4_1(backend, quantized_weights)
            if kv_cache_dtype != "float32":
                backend.kv_dtype = torch.bfloat16
        logger.info(
            "loaded %s (%s) on %s as %s, max_model_len=%d",
            path, model.config.model_type, dev, torch_dtype, backend.max_model_len,
        )
        return backend

    def _load_native(self) -> None:
        """Build or load the native kernel; without it, switch ``native_attention`` off."""
        self._native = native_kernels.load(self._kernel_dir) or False
        self.native_attention = bool(self._native)
        if self._native:
            native_lora.declare(self._native)
            native_elementwise.declare(self._native)
        # On a CPU with AMX, PyTorch's attention over the gathered K/V (its bf16 products on
        # AMX tiles) beats the native prefill kernel: a 1,024-token prompt pass took 0.35 s
        # against 0.57 on a 2-core Xeon with AMX (family 6 model 167).
        self._prefill_kernel_runs = (prefill_kernel.supported(self._native, self.dtype,
                                                              self.head_dim, self.group)
                                     and not native_gemm.amx_available())
        if (self._native and self.dtype == torch.bfloat16 and self.device.type == "cpu"
                and native_gemm.packed_matmul_available(self._native)):
            self._pack_weights()

    def _pack_weights(self) -> None:
        """Packed copies of every projection (and the LM head) the native kernel takes: those
        with ``out`` a multiple of 64 and ``in`` even; a layer with one that does not fit keeps
        its plain weights. Sets ``packed_gemm``."""
        lib = self._native

        def pack(w: torch.Tensor, b: torch.Tensor | None) -> Any:
            return native_gemm.PackedLinear(lib, w, b)

        for layer in self._layers:
            weights = ((layer.w_qkv, layer.b_qkv), (layer.w_o, layer.b_o),
                       (layer.w_gate_up, layer.b_gate_up), (layer.w_down, layer.b_down))
            if all(native_gemm.can_pack(w) for w, _ in weights):
                layer.packed = tuple(pack(w, b) for w, b in weights)  # type: ignore[assignment]
        if native_gemm.can_pack(self._lm_head_w):  # fp32 logits: the kernel's sums only
            self._lm_head_packed = native_gemm.PackedLinear(lib, self._lm_head_w,
                                                            self._lm_head_b, onednn=False)
        self.packed_gemm = (self._lm_head_packed is not None
                            or any(layer.packed is not None for layer in self._layers))
        logger.info("bf16 projections on the native packed kernel: %d of %d layers%s",
                    sum(layer.packed is not None for layer in self._layers), len(self._layers),
                    ", and the LM head" if self._lm_head_packed is not None else "")

    def _build_decode_layers(self) -> None:
        """Describe the layers for :mod:`inference.engine.backends.native.decode` where it
        runs the model (its projections packed in bf16, or Q4_1 ones after
        :func:`~inference.engine.backends.hf.quantized.load_q4_1`); else leave it None."""
        if self.packed_gemm and native_decode.supported(self._native, self.dtype, self._layers,
                                                        self._act, self.head_dim):
            self._decode_layers = native_decode.DecodeLayers(
                self._native, self._layers, n_heads=self.num_heads, kv_heads=self.num_kv_heads,
                head_dim=self.head_dim, scale=self.scale, cos=self._cos, sin=self._sin)

    @property
    def hf_model(self) -> Any:
        """The wrapped ``transformers`` model (for comparisons with ``generate``)."""
        return self._model

    # ----------------------------------------------------------------------------- KV pool

    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token takes across all layers (``2 * layers * kv_heads * dim``)."""
        elem = torch.empty((), dtype=self.kv_dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem

    def allocate_kv_pool(self, num_blocks: int, block_size: int) -> None:
        """Allocate the pool once: ``[layers, 2 * kv_heads, num_blocks, block_size, head_dim]``.

        Index ``h`` of dim 1 holds K of KV head ``h`` for ``h < kv_heads``, V of head
        ``h - kv_heads`` otherwise, so one copy writes and one gather reads both. The pool is
        zero-filled: padded gathers never see non-finite values. Its size never changes while
        an engine runs; a second call (a new engine over the same loaded weights) replaces the
        pool and drops its contents.

        Raises:
            ValueError: for a non-positive size.
        """
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"bad KV pool size: {num_blocks} blocks x {block_size} tokens")
        self._kv = None  # free the old pool before allocating the new one
        self._kv = torch.zeros(
            self.num_layers, 2 * self.num_kv_heads, num_blocks, block_size, self.head_dim,
            dtype=self.kv_dtype, device=self.device,
        )
        self.num_blocks, self.block_size = num_blocks, block_size

    def copy_block(self, source: int, target: int) -> None:
        """Copy block ``source``'s K and V, every layer and head, into block ``target``
        (copy-on-write of a prompt's partial block when a request forks into choices; the
        native kernels read the same pool, so they see the copy too)."""
        assert self._kv is not None, "allocate_kv_pool first"
        self._kv[:, :, target].copy_(self._kv[:, :, source])

    # ----------------------------------------------------------------------------- forward

    def prefill(self, chunks: Sequence[PrefillChunk]) -> torch.Tensor:
        """Run prompt chunks of one or more rows in one forward pass, writing their KV.

        Returns:
            ``[len(chunks) + extra, vocab_size]`` fp32 logits of each chunk's last token, then
            of the other tokens of the chunks with ``all_logits``
            (:meth:`~inference.engine.backends.base.ModelBackend.prefill`).

        Raises:
            ValueError: for an empty chunk, a block table too short for its positions, or a
                position at or past ``max_model_len``.
        """
        if not chunks:
            return torch.empty(0, self.vocab_size)
        rows = [(list(c.token_ids), c.start_pos, c.block_table) for c in chunks]
        # A pass of one-token chunks is a decode pass (the decode attention paths).
        return self._run(rows, 0 if all(len(t) == 1 for t, _, _ in rows) else len(rows),
                         [c.all_logits for c in chunks], [c.row_id for c in chunks])

    def decode(self, rows: Sequence[DecodeRow]) -> torch.Tensor:
        """One decode step for every row in one forward pass (rows may differ in length).

        Returns:
            ``[len(rows), vocab_size]`` fp32 logits of each row's next token.

        Raises:
            ValueError: as :meth:`prefill`.
        """
        if not rows:
            return torch.empty(0, self.vocab_size)
        return self._run([([r.token_id], r.position, r.block_table) for r in rows], 0,
                         row_ids=[r.row_id for r in rows])

    def prefill_and_decode(self, chunks: Sequence[PrefillChunk],
                           rows: Sequence[DecodeRow]) -> torch.Tensor:
        """Prompt chunks and decode rows in ONE forward pass (``PREFILL_MODE=mixed_batch``).

        The projections and MLPs run once over all the pass's tokens; attention runs per part:
        the chunks' queries over K/V gathered by block table (causal within each chunk), the
        decode rows' through the native kernel (or gathered per group of similar lengths).

        Returns:
            ``[len(chunks) + len(rows) + extra, vocab_size]`` fp32 logits: each chunk's last
            token, then each decode row's next token, then the other tokens of the chunks with
            ``all_logits``.

        Raises:
            ValueError: as :meth:`prefill`.
        """
        if not rows:
            return self.prefill(chunks)
        if not chunks:
            return self.decode(rows)
        prefill = [(list(c.token_ids), c.start_pos, c.block_table) for c in chunks]
        decode = [([r.token_id], r.position, r.block_table) for r in rows]
        return self._run(prefill + decode, len(prefill), [c.all_logits for c in chunks],
                         [c.row_id for c in chunks] + [r.row_id for r in rows])

    def _run(self, rows: list[tuple[list[int], int, Sequence[int]]],
             decode_from: int, all_logits: Sequence[bool] = (),
             row_ids: Sequence[str] = ()) -> torch.Tensor:
        """One pass over ``rows`` (ids ``row_ids``: their LoRA adapters): rows
        ``[0, decode_from)`` prefill chunks, the rest decode rows (one token each);
        ``[len(rows) + extra, vocab]`` logits in ``rows``' order, then the other tokens' of the
        rows ``all_logits`` marks (prefill rows only)."""
        if self._kv is None:
            raise RuntimeError("allocate_kv_pool() must be called before prefill or decode")
        order = None
        decoding = decode_from < len(rows)
        native = self.native_attention and decoding
        if native and self._native is None:  # switched on after start-up: build it now
            self._load_native()
        native = native and bool(self._native)
        native_prefill = (decode_from > 0 and self.native_prefill_attention
                          and self._prefill_kernel_runs)
        if not native and len(rows) - decode_from > 1:
            # Decode rows sorted by length, so attention can run over groups of similar length.
            order = [*range(decode_from),
                     *sorted(range(decode_from, len(rows)), key=lambda r: rows[r][1])]
            rows = [rows[r] for r in order]
            row_ids = [row_ids[r] for r in order] if row_ids else row_ids
        with torch.inference_mode():
            batch = _make_batch(
                rows, block_size=self.block_size, num_blocks=self.num_blocks,
                num_kv_heads=self.num_kv_heads, group=self.group,
                max_model_len=self.max_model_len, max_groups=self.attention_groups,
                device=self.device, grouped=order is not None, native=native,
                decode_from=decode_from, all_logits=all_logits, native_prefill=native_prefill,
            )
            if row_ids:
                batch.lora, batch.lora_tokens = self._lora_segments(
                    row_ids, [len(t) for t, _, _ in rows])
            logits = self._forward(batch)
            if order is not None:  # (only decode rows moved: the extra rows keep their place)
                restore = torch.arange(logits.shape[0])
                restore[torch.tensor(order)] = torch.arange(len(order))
                logits = logits.index_select(0, restore.to(logits.device))
        return logits.float().cpu() if logits.device.type != "cpu" else logits.float()
