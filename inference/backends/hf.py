"""A real model behind the scheduler: a Hugging Face causal LM run over a paged KV block pool.

The weights and tokenizer come from ``transformers``; the forward pass is our own (in the manner
of nano-vllm), over the model's modules: embedding, per layer an RMSNorm, fused q/k/v projection,
rotary embedding, paged attention, output projection, RMSNorm, gated MLP; final norm and LM head.

Paged attention: the KV cache of every row lives in one pool tensor allocated once
(:meth:`TransformersBackend.allocate_kv_pool`). Each forward pass writes the new tokens' K/V into
the slots their row's block table names. A decode pass then runs the native paged-attention kernel
(:mod:`inference.backends.native`), which reads each row's K/V in place along its block table; a
prefill pass (or a decode pass without the kernel) gathers each row's K/V by block table and runs
``scaled_dot_product_attention`` with a per-row mask. Either way rows of different lengths decode
in one pass, and a prefill chunk attends causally to itself and to every earlier position of its
row (earlier chunks or prefix-cache hits).

Supported architectures: Llama, Mistral, Qwen2 and Qwen3 style decoders (``q/k/v/o_proj``,
``gate/up/down_proj``, RMSNorm, rotary embedding with a position-only table).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from inference.backends import native as native_kernels
from inference.backends.base import DecodeRow, ModelBackend, PrefillChunk
from inference.model_store import ModelLoadError, resolve_model_path

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
# Rope variants whose tables depend on the sequence length, not on the position alone.
UNSUPPORTED_ROPE_TYPES = frozenset({"dynamic", "longrope"})
_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def resolve_device(name: str = "auto") -> torch.device:
    """``auto``: CUDA if present, else Apple MPS, else CPU; otherwise the named device.

    Raises:
        ModelLoadError: if the named device is not available.
    """
    name = (name or "auto").strip().lower()
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"DEVICE={name!r} but CUDA is not available")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ModelLoadError(f"DEVICE={name!r} but MPS is not available")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto``: fp32 on CPU, bf16 on CUDA when supported (else fp16), fp16 on MPS.

    Raises:
        ModelLoadError: for an unknown dtype name.
    """
    name = (name or "auto").strip().lower()
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        if device.type == "mps":
            return torch.float16
        return torch.float32
    if name not in _DTYPES:
        raise ModelLoadError(f"unknown DTYPE={name!r}; use auto, float32, float16 or bfloat16")
    return _DTYPES[name]


class HFTokenizer:
    """The model's own tokenizer behind the :class:`~inference.backends.base.Tokenizer` protocol.

    Attributes:
        eos_token_ids: ids that end an answer: the tokenizer's EOS plus the model config's and
            generation config's ``eos_token_id`` values.
    """

    def __init__(self, tokenizer: Any, extra_eos_ids: Sequence[int] = ()) -> None:
        self._tok = tokenizer
        eos = set(int(i) for i in extra_eos_ids)
        if tokenizer.eos_token_id is not None:
            eos.add(int(tokenizer.eos_token_id))
        self.eos_token_ids: frozenset[int] = frozenset(eos)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> HFTokenizer:
        """Load the tokenizer (not the model) of the model folder ``path``, offline.

        Raises:
            ModelLoadError: if the folder has no usable tokenizer.
        """
        from transformers import AutoConfig, AutoTokenizer, GenerationConfig

        try:
            tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(
                f"model path {str(path)!r}: cannot load its tokenizer: {exc}") from exc
        eos: list[int] = []
        # Either config may be absent; the tokenizer's own EOS is always included.
        with contextlib.suppress(OSError, ValueError):
            eos += _as_id_list(AutoConfig.from_pretrained(str(path)).eos_token_id)
        with contextlib.suppress(OSError, ValueError):
            eos += _as_id_list(GenerationConfig.from_pretrained(str(path)).eos_token_id)
        return cls(tok, eos)

    @property
    def hf_tokenizer(self) -> Any:
        """The wrapped ``transformers`` tokenizer."""
        return self._tok

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, no special tokens added."""
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids``, special tokens skipped, no clean-up of spaces.

        A character whose bytes are split across tokens shows as U+FFFD until it is complete.
        """
        return self._tok.decode(
            list(token_ids), skip_special_tokens=True, clean_up_tokenization_spaces=False
        )

    def apply_chat_template(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """Prompt ids of chat ``messages`` by the model's own template, generation prompt added.

        Raises:
            ValueError: if the tokenizer has no chat template.
        """
        if not getattr(self._tok, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template")
        ids = self._tok.apply_chat_template(
            [dict(m) for m in messages], add_generation_prompt=True, tokenize=True,
            return_dict=False,
        )
        return [int(i) for i in ids]


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


@dataclass
class _Layer:
    """One decoder layer's weights, with q/k/v and gate/up fused for fewer, larger matmuls."""

    ln1_w: torch.Tensor
    ln1_eps: float
    w_qkv: torch.Tensor
    b_qkv: torch.Tensor | None
    w_o: torch.Tensor
    b_o: torch.Tensor | None
    ln2_w: torch.Tensor
    ln2_eps: float
    w_gate_up: torch.Tensor
    b_gate_up: torch.Tensor | None
    w_down: torch.Tensor
    b_down: torch.Tensor | None
    q_norm: tuple[torch.Tensor, float] | None
    k_norm: tuple[torch.Tensor, float] | None


@dataclass
class _AttnGroup:
    """Rows ``[start, end)`` of a pass whose K/V are gathered to one length ``L`` (whole blocks)."""

    start: int
    end: int
    gather_index: torch.Tensor  # [2 KV * rows * nb] rows of the layer's [2 KV * blocks, bs * D]
    mask: torch.Tensor  # [1, rows, G * T, L] bool, True = attend
    ctx_len: int


@dataclass
class _Batch:
    """Index tensors of one forward pass over ``R`` rows and ``N`` new tokens (packed).

    ``T`` is the most new tokens of any row. Attention runs per group of rows (see
    :func:`_attention_groups`); a prefill pass has one group.
    """

    tokens: torch.Tensor  # [N] token ids
    positions: torch.Tensor  # [N] absolute positions
    write_index: torch.Tensor  # [2 KV * N] rows of the layer's [2 KV * blocks * bs, D] view
    groups: list[_AttnGroup]
    tables: torch.Tensor | None  # [R, max blocks] int64: decode through the native kernel
    lengths: torch.Tensor | None  # [R] int64 tokens each row attends to (native kernel)
    pad_index: torch.Tensor | None  # [R * T] packed index of each padded query (None: no pad)
    unpad_index: torch.Tensor | None  # [N] padded index of each packed token
    last_index: torch.Tensor  # [R] packed index of each row's last new token
    rows: int
    max_new: int


# A further attention group costs about as much as gathering this many more K/V slots per row
# set (a gather and an attention call per layer, each ~20 us, against ~6 us of copying and
# reading per 100 slots), measured with the default model on a 2-core CPU.
GROUP_OVERHEAD_SLOTS = 256
MAX_ATTENTION_GROUPS = 4


def _attention_groups(blocks: Sequence[int], block_size: int,
                      max_groups: int = MAX_ATTENTION_GROUPS) -> list[tuple[int, int]]:
    """Split rows sorted by context length into at most ``max_groups`` runs.

    Each group's K/V are gathered to its longest row's length, so one group over rows of very
    different lengths copies and reads mostly padding. This picks the split that minimises
    ``sum(rows_in_group * longest_in_group) + GROUP_OVERHEAD_SLOTS * groups`` (dynamic
    programming over the sorted rows; ``O(K R^2)``).

    Args:
        blocks: KV blocks each row reads, ascending.
        block_size: tokens per block.
        max_groups: most groups (1: one group, as a prefill pass).

    Returns:
        ``[(start, end), ...]`` half-open row ranges covering ``range(len(blocks))`` in order.
    """
    n = len(blocks)
    inf = float("inf")
    # best[k][i]: cost of the first i rows in k groups; cut[k][i]: where the last group starts.
    max_groups = max(1, max_groups)
    best = [[inf] * (n + 1) for _ in range(max_groups + 1)]
    cut = [[0] * (n + 1) for _ in range(max_groups + 1)]
    best[0][0] = 0.0
    for k in range(1, max_groups + 1):
        for i in range(1, n + 1):
            width = blocks[i - 1] * block_size  # sorted: the group's last row is its longest
            for j in range(k - 1, i):
                cost = best[k - 1][j] + (i - j) * width + GROUP_OVERHEAD_SLOTS
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    k = min(range(1, max_groups + 1), key=lambda kk: best[kk][n])
    ranges: list[tuple[int, int]] = []
    end = n
    while k > 0:
        start = cut[k][end]
        ranges.append((start, end))
        end, k = start, k - 1
    return ranges[::-1]


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


class TransformersBackend(ModelBackend):
    """A Hugging Face causal LM over a paged KV block pool (see the module docstring).

    Attributes:
        tokenizer: the model's :class:`HFTokenizer`.
        vocab_size: logits per row.
        max_model_len: longest sequence (prompt + output, tokens) the backend accepts.
        device, dtype: where and in which precision the weights and KV pool live.
        attention_groups: most groups of similar-length rows a decode step's attention runs
            over (1: all rows gathered to the longest row's length).
        small_batch_gemm: compute projections as ``W @ x^T`` (:func:`_linear_cpu`); on by
            default on CPU, off elsewhere (``F.linear``).
        native_attention: run decode attention with the native paged kernel
            (:mod:`inference.backends.native`), reading K/V straight from the pool; on by default
            for fp32 on CPU, and off by itself where the kernel cannot be built (no C compiler).
    """

    def __init__(
        self,
        model: Any,
        tokenizer: HFTokenizer,
        *,
        max_model_len: int = 0,
    ) -> None:
        """Wrap a loaded ``*ForCausalLM`` ``model`` (eval mode, on its device and dtype).

        Raises:
            ModelLoadError: if the architecture is not a supported decoder layout.
        """
        cfg = model.config
        model_type = getattr(cfg, "model_type", "?")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelLoadError(
                f"unsupported model architecture {model_type!r}; supported: "
                f"{sorted(SUPPORTED_MODEL_TYPES)}"
            )
        rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type in UNSUPPORTED_ROPE_TYPES:
            raise ModelLoadError(f"unsupported rotary embedding type {rope_type!r}")
        self.tokenizer = tokenizer
        self.vocab_size = int(cfg.vocab_size)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.num_layers = int(cfg.num_hidden_layers)
        self.num_heads = int(cfg.num_attention_heads)
        self.num_kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self.num_heads)
        self.head_dim = int(
            getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        )
        self.group = self.num_heads // self.num_kv_heads
        self.scale = self.head_dim**-0.5
        limit = int(cfg.max_position_embeddings)
        window = getattr(cfg, "sliding_window", None)
        if window and getattr(cfg, "use_sliding_window", True):
            # Full attention is only the model's own attention up to its window.
            limit = min(limit, int(window))
        self.max_model_len = min(limit, max_model_len) if max_model_len > 0 else limit

        inner = model.model
        self._embed = inner.embed_tokens.weight
        self._norm = (inner.norm.weight, float(_eps(inner.norm)))
        self._lm_head_w = model.lm_head.weight
        self._lm_head_b = getattr(model.lm_head, "bias", None)
        self._layers = [self._fuse_layer(layer) for layer in inner.layers]
        self._act = _activation(cfg)
        # Speed settings, both on by default (``benchmarks/bench_decode_step.py`` compares them).
        self.attention_groups = MAX_ATTENTION_GROUPS
        self.small_batch_gemm = self.device.type == "cpu"
        self.native_attention = self.device.type == "cpu" and self.dtype == torch.float32
        # The kernel library (built now, before serving; False: unavailable; None: not tried).
        self._native: Any = None
        if self.native_attention:
            self._load_native()
        with torch.inference_mode():
            pos = torch.arange(self.max_model_len, device=self.device)[None]
            probe = torch.zeros(1, device=self.device, dtype=torch.float32)
            cos, sin = inner.rotary_emb(probe, pos)
        self._cos = cos[0].to(self.dtype).contiguous()  # [max_model_len, head_dim]
        self._sin = sin[0].to(self.dtype).contiguous()
        self._model = model
        self._kv: torch.Tensor | None = None
        self.num_blocks = 0
        self.block_size = 0

    # ----------------------------------------------------------------------------- loading

    @classmethod
    def from_config(cls, config: Any) -> TransformersBackend:
        """Load the backend an :class:`~inference.config.EngineConfig` describes.

        Uses ``model_path`` (empty: the default model, prepared on first use), ``device``,
        ``dtype`` and ``max_model_len``.

        Raises:
            ModelLoadError: for a missing or broken model folder, an unsupported architecture, an
                unknown dtype or an unavailable device.
        """
        return cls.from_pretrained(
            resolve_model_path(config.model_path),
            device=config.device,
            dtype=config.dtype,
            max_model_len=config.max_model_len,
        )

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        device: str = "auto",
        dtype: str = "auto",
        max_model_len: int = 0,
    ) -> TransformersBackend:
        """Load a local Hugging Face model folder (offline) and wrap it.

        Raises:
            ModelLoadError: as :meth:`from_config`.
        """
        from transformers import AutoConfig, AutoModelForCausalLM

        dev = resolve_device(device)
        torch_dtype = resolve_dtype(dtype, dev)
        path = str(path)
        try:
            hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError, KeyError) as exc:
            raise ModelLoadError(f"model path {path!r}: cannot read config.json: {exc}") from exc
        model_type = getattr(hf_config, "model_type", "?")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelLoadError(
                f"model path {path!r}: unsupported model architecture {model_type!r}; "
                f"supported: {sorted(SUPPORTED_MODEL_TYPES)}"
            )
        try:
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=torch_dtype, local_files_only=True
            )
        except Exception as exc:  # safetensors, torch and transformers raise many kinds here
            raise ModelLoadError(f"model path {path!r}: cannot load the weights: {exc}") from exc
        model.to(dev).eval()
        backend = cls(model, HFTokenizer.from_pretrained(path), max_model_len=max_model_len)
        logger.info(
            "loaded %s (%s) on %s as %s, max_model_len=%d",
            path, model_type, dev, torch_dtype, backend.max_model_len,
        )
        return backend

    def _load_native(self) -> None:
        """Build or load the native kernel; without it, switch ``native_attention`` off."""
        self._native = native_kernels.load() or False
        self.native_attention = bool(self._native)

    @property
    def hf_model(self) -> Any:
        """The wrapped ``transformers`` model (for comparisons with ``generate``)."""
        return self._model

    def _fuse_layer(self, layer: Any) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        try:
            q, k, v, o = attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj
            gate, up, down = mlp.gate_proj, mlp.up_proj, mlp.down_proj
            ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
        except AttributeError as exc:
            raise ModelLoadError(f"unsupported decoder layer layout: {exc}") from exc

        def cat_bias(*mods: Any) -> torch.Tensor | None:
            biases = [m.bias for m in mods]
            if all(b is None for b in biases):
                return None
            return torch.cat([
                b if b is not None else torch.zeros(m.out_features, dtype=m.weight.dtype,
                                                    device=m.weight.device)
                for b, m in zip(biases, mods, strict=True)
            ])

        def norm(mod: Any) -> tuple[torch.Tensor, float] | None:
            return None if mod is None else (mod.weight, float(_eps(mod)))

        def fuse(*mods: Any) -> torch.Tensor:
            # The modules' weights become views of the fused tensor: no second copy in memory,
            # and the wrapped model still runs (``hf_model``).
            fused = torch.cat([m.weight.detach() for m in mods])
            row = 0
            for m in mods:
                rows = m.weight.shape[0]
                m.weight = torch.nn.Parameter(fused[row:row + rows], requires_grad=False)
                row += rows
            return fused

        return _Layer(
            ln1_w=ln1.weight, ln1_eps=float(_eps(ln1)),
            w_qkv=fuse(q, k, v), b_qkv=cat_bias(q, k, v),
            w_o=o.weight, b_o=o.bias,
            ln2_w=ln2.weight, ln2_eps=float(_eps(ln2)),
            w_gate_up=fuse(gate, up), b_gate_up=cat_bias(gate, up),
            w_down=down.weight, b_down=down.bias,
            q_norm=norm(getattr(attn, "q_norm", None)), k_norm=norm(getattr(attn, "k_norm", None)),
        )

    # ----------------------------------------------------------------------------- KV pool

    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token takes across all layers (``2 * layers * kv_heads * dim``)."""
        elem = torch.empty((), dtype=self.dtype).element_size()
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
            dtype=self.dtype, device=self.device,
        )
        self.num_blocks, self.block_size = num_blocks, block_size

    # ----------------------------------------------------------------------------- forward

    def prefill(self, chunks: Sequence[PrefillChunk]) -> torch.Tensor:
        """Run prompt chunks of one or more rows in one forward pass, writing their KV.

        Returns:
            ``[len(chunks), vocab_size]`` fp32 logits of each chunk's last token.

        Raises:
            ValueError: for an empty chunk, a block table too short for its positions, or a
                position at or past ``max_model_len``.
        """
        if not chunks:
            return torch.empty(0, self.vocab_size)
        rows = [(list(c.token_ids), c.start_pos, c.block_table) for c in chunks]
        return self._run(rows)

    def decode(self, rows: Sequence[DecodeRow]) -> torch.Tensor:
        """One decode step for every row in one forward pass (rows may differ in length).

        Returns:
            ``[len(rows), vocab_size]`` fp32 logits of each row's next token.

        Raises:
            ValueError: as :meth:`prefill`.
        """
        if not rows:
            return torch.empty(0, self.vocab_size)
        return self._run([([r.token_id], r.position, r.block_table) for r in rows])

    def _run(self, rows: list[tuple[list[int], int, Sequence[int]]]) -> torch.Tensor:
        if self._kv is None:
            raise RuntimeError("allocate_kv_pool() must be called before prefill or decode")
        order = None
        native = self.native_attention and all(len(t) == 1 for t, _, _ in rows)
        if native and self._native is None:  # switched on after start-up: build it now
            self._load_native()
        native = native and bool(self._native)
        if not native and len(rows) > 1 and all(len(t) == 1 for t, _, _ in rows):
            # Decode: rows sorted by length, so attention can run over groups of similar length.
            order = sorted(range(len(rows)), key=lambda r: rows[r][1])
            rows = [rows[r] for r in order]
        with torch.inference_mode():
            batch = self._make_batch(rows, grouped=order is not None, native=native)
            logits = self._forward(batch)
            if order is not None:
                restore = torch.empty(len(order), dtype=torch.long)
                restore[torch.tensor(order)] = torch.arange(len(order))
                logits = logits.index_select(0, restore.to(logits.device))
        return logits.float().cpu() if logits.device.type != "cpu" else logits.float()

    def _make_batch(self, rows: list[tuple[list[int], int, Sequence[int]]],
                    grouped: bool = False, native: bool = False) -> _Batch:
        """Index tensors for ``rows``.

        ``grouped``: rows are sorted by length (decode through gathers); ``native``: a decode
        pass whose attention the native kernel runs from block tables (no gather groups).
        """
        bs = self.block_size
        num_rows = len(rows)
        max_new = max(len(t) for t, _, _ in rows)
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        tables: list[Sequence[int]] = []
        need_blocks: list[int] = []
        last: list[int] = []
        starts: list[int] = []
        lengths: list[int] = []
        uneven = any(len(t) != max_new for t, _, _ in rows)
        pad_index: list[int] = []
        unpad_index: list[int] = []
        for r, (toks, start, table) in enumerate(rows):
            n = len(toks)
            end = start + n
            if n == 0:
                raise ValueError("empty prefill chunk")
            if end > self.max_model_len:
                raise ValueError(f"position {end - 1} is past max_model_len={self.max_model_len}")
            need = -(-end // bs)
            if len(table) < need:
                raise ValueError(f"block table of {len(table)} blocks cannot hold {end} tokens")
            base = len(tokens)
            tokens.extend(toks)
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            tables.append(table)
            need_blocks.append(need)
            last.append(base + n - 1)
            starts.append(start)
            lengths.append(end)
            if uneven:
                pad_index.extend(base + min(i, n - 1) for i in range(max_new))
                unpad_index.extend(r * max_new + i for i in range(n))

        dev = self.device
        # Dim-0 gathers and writes over flat views (a gather along an inner dim is ~2x slower):
        # K/V head h of block b is row h * num_blocks + b of the [2 KV * blocks, bs * D] view.
        heads = torch.arange(2 * self.num_kv_heads)[:, None]
        ranges = (_attention_groups(need_blocks, bs, self.attention_groups) if grouped
                  else [(0, num_rows)])
        groups = []
        table_t = length_t = None
        if native:
            ranges = []
            width = max(need_blocks)
            table_t = torch.tensor([list(t[:n]) + [0] * (width - n)
                                    for t, n in zip(tables, need_blocks, strict=True)],
                                   dtype=torch.int64)
            length_t = torch.tensor(lengths, dtype=torch.int64)
        for g_start, g_end in ranges:
            max_blocks = max(need_blocks[g_start:g_end])
            block_ids: list[int] = []
            for r in range(g_start, g_end):
                block_ids.extend(tables[r][:need_blocks[r]])
                block_ids.extend([0] * (max_blocks - need_blocks[r]))
            g_rows = g_end - g_start
            ctx_len = max_blocks * bs
            key_pos = torch.arange(ctx_len)
            len_t = torch.tensor(lengths[g_start:g_end])
            if max_new == 1:
                mask = (key_pos[None, :] < len_t[:, None])[None, :, None, :]  # [1, R, 1, L]
            else:
                start_t = torch.tensor(starts[g_start:g_end])
                query_pos = start_t[:, None] + torch.arange(max_new)[None, :]  # [R, T]
                query_pos = torch.minimum(query_pos, (len_t - 1)[:, None])
                mask = key_pos[None, None, :] <= query_pos[:, :, None]  # [R, T, L]
                mask = mask[:, None].expand(g_rows, self.group, max_new, ctx_len)
                mask = mask.reshape(1, g_rows, self.group * max_new, ctx_len)
            gather_index = heads * self.num_blocks + torch.tensor(block_ids)[None, :]
            groups.append(_AttnGroup(start=g_start, end=g_end,
                                     gather_index=gather_index.reshape(-1).to(dev),
                                     mask=mask.to(dev), ctx_len=ctx_len))
        write_index = heads * (self.num_blocks * bs) + torch.tensor(slots)[None, :]
        return _Batch(
            tokens=torch.tensor(tokens, device=dev),
            positions=torch.tensor(positions, device=dev),
            write_index=write_index.reshape(-1).to(dev),
            groups=groups,
            tables=table_t,
            lengths=length_t,
            pad_index=torch.tensor(pad_index, device=dev) if uneven else None,
            unpad_index=torch.tensor(unpad_index, device=dev) if uneven else None,
            last_index=torch.tensor(last, device=dev),
            rows=num_rows,
            max_new=max_new,
        )

    def _forward(self, b: _Batch) -> torch.Tensor:
        assert self._kv is not None
        n_heads, kv_heads, dim, group = self.num_heads, self.num_kv_heads, self.head_dim, self.group
        rows = b.rows
        num_tokens = b.tokens.shape[0]
        q_width = n_heads * dim
        qk_heads = n_heads + kv_heads
        cos = self._cos[b.positions][:, None, :]  # [N, 1, D]
        sin = self._sin[b.positions][:, None, :]
        half = dim // 2
        kv_all = self._kv  # [layers, 2 * kv_heads, blocks, block_size, D]
        slot_rows = kv_all[0].numel() // dim

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
                o = native_kernels.paged_decode_attention(
                    self._native, q.reshape(rows, kv_heads, group, dim).contiguous(), pool,
                    b.tables, b.lengths, self.scale).view(rows, q_width)
            else:
                o = self._gathered_attention(b, q, pool)
            h = h + linear(o, layer.w_o, layer.b_o)

            x = _rms_norm(h, layer.ln2_w, layer.ln2_eps)
            gate_up = linear(x, layer.w_gate_up, layer.b_gate_up)
            gate, up = gate_up.chunk(2, dim=-1)
            h = h + linear(self._act(gate) * up, layer.w_down, layer.b_down)

        h = _rms_norm(h.index_select(0, b.last_index), *self._norm)
        return linear(h, self._lm_head_w, self._lm_head_b)  # [R, vocab]

    def _gathered_attention(self, b: _Batch, q: torch.Tensor, pool: torch.Tensor) -> torch.Tensor:
        """Attention of ``q [N, H, D]`` over K/V gathered from one layer's ``pool`` by block
        table, per group of rows, with the batch's masks; returns ``[N, H * D]``."""
        kv_heads, group, dim = self.num_kv_heads, self.group, self.head_dim
        rows, t_max = b.rows, b.max_new
        q_width = self.num_heads * dim
        block_rows = pool.numel() // (self.block_size * dim)
        qf = q.reshape(-1, q_width)
        if b.pad_index is not None:
            qf = qf.index_select(0, b.pad_index)  # [R * T, H * D]
        # Query heads of one KV head side by side: [KV, R, G * T, D] (no K/V repeat for GQA).
        qh = qf.view(rows, t_max, kv_heads, group, dim).permute(2, 0, 3, 1, 4)
        qh = qh.reshape(kv_heads, rows, group * t_max, dim)
        parts = []
        for g in b.groups:
            gathered = pool.view(block_rows, -1).index_select(0, g.gather_index)
            gathered = gathered.view(2 * kv_heads, g.end - g.start, g.ctx_len, dim)
            k, v = gathered[:kv_heads], gathered[kv_heads:]  # [KV, rows, L, D]
            q_g = qh if len(b.groups) == 1 else qh[:, g.start:g.end]
            parts.append(F.scaled_dot_product_attention(q_g, k, v, attn_mask=g.mask,
                                                        scale=self.scale))
        o = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)  # [KV, R, G * T, D]
        o = o.view(kv_heads, rows, group, t_max, dim).permute(1, 3, 0, 2, 4)
        o = o.reshape(rows * t_max, q_width)
        if b.unpad_index is not None:
            o = o.index_select(0, b.unpad_index)
        return o


def _eps(norm: Any) -> float:
    for name in ("variance_epsilon", "eps"):
        if hasattr(norm, name):
            return float(getattr(norm, name))
    raise ModelLoadError(f"cannot find the epsilon of {type(norm).__name__}")


def _activation(cfg: Any) -> Any:
    from transformers.activations import ACT2FN

    name = getattr(cfg, "hidden_act", "silu")
    if name in ("silu", "swish"):
        return F.silu
    try:
        return ACT2FN[name]
    except KeyError as exc:
        raise ModelLoadError(f"unsupported activation {name!r}") from exc
