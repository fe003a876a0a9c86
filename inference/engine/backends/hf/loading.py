"""Loading a model for the backend: device and dtype, config and weights, fused per-layer weights.

:func:`resolve_device` and :func:`resolve_dtype` turn the ``DEVICE`` and ``DTYPE`` settings into
torch values (:func:`cpu_has_native_bf16`: whether ``auto`` picks bf16 on this CPU);
:func:`check_architecture` and :func:`load_model` read a local Hugging Face model folder offline;
:func:`_fuse_layer` turns each decoder layer into a :class:`_Layer` of fused weights, with its
norms' epsilons (:func:`_eps`) and the MLP activation (:func:`_activation`).

Supported architectures: Llama, Mistral, Qwen2 and Qwen3 style decoders (``q/k/v/o_proj``,
``gate/up/down_proj``, RMSNorm, rotary embedding with a position-only table).
"""

from __future__ import annotations

import logging
import platform
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from inference.engine.model_store import ModelLoadError

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


# CPU feature flags (``/proc/cpuinfo``) that give native bf16 dot products: x86 AVX512-BF16
# (VDPBF16PS) and AMX-BF16 (TDPBF16PS tiles); Arm FEAT_BF16 (``bf16``: BFDOT and BFMMLA).
_NATIVE_BF16_FLAGS = {"x86": ("avx512_bf16", "amx_bf16"), "arm": ("bf16",)}


def _cpu_flags() -> tuple[str, frozenset[str]]:
    """``(family, flags)``: ``"x86"``, ``"arm"`` or the machine name, and the first CPU's
    feature flags (``flags`` on x86, ``Features`` on Arm) from ``/proc/cpuinfo``; no flags where
    that file is missing (not Linux)."""
    machine = platform.machine().lower()
    family = ("x86" if machine in ("x86_64", "amd64", "i686", "i386")
              else "arm" if machine in ("aarch64", "arm64") else machine)
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return family, frozenset(value.split())
    except OSError:
        pass
    return family, frozenset()


def cpu_has_native_bf16() -> tuple[bool, str]:
    """Whether this CPU computes bf16 dot products natively, and why: ``(True, "CPU has
    avx512_bf16, amx_bf16")`` or ``(False, "CPU has neither avx512_bf16 nor amx_bf16")``.

    Reads the feature flags of ``/proc/cpuinfo``: on x86 ``avx512_bf16`` (AVX512-BF16) or
    ``amx_bf16`` (AMX-BF16); on 64-bit Arm ``bf16`` (FEAT_BF16, the BFDOT/BFMMLA instructions
    that oneDNN's Arm kernels use). PyTorch's own test
    (``torch.ops.mkldnn._is_mkldnn_bf16_supported``) is not used: it is true on any AVX512-BW
    CPU, where oneDNN emulates bf16 with conversions and a bf16 matmul runs no faster than fp32.
    Never raises.
    """
    family, flags = _cpu_flags()
    wanted = _NATIVE_BF16_FLAGS.get(family, ())
    if not wanted:
        return False, f"no native bf16 flag is known for {family or 'this'} CPUs"
    found = [flag for flag in wanted if flag in flags]
    if found:
        return True, f"CPU has {', '.join(found)}"
    names = " nor ".join(wanted) if len(wanted) > 1 else wanted[0]
    return False, f"CPU has {'neither ' if len(wanted) > 1 else 'no '}{names}"


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto``: on CPU bf16 where it has native bf16 dot products (:func:`cpu_has_native_bf16`),
    else fp32; bf16 on CUDA when supported (else fp16); fp16 on MPS. The CPU's choice and its
    reason are logged at INFO.

    Raises:
        ModelLoadError: for an unknown dtype name.
    """
    name = (name or "auto").strip().lower()
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        if device.type == "mps":
            return torch.float16
        native, reason = cpu_has_native_bf16()
        dtype = torch.bfloat16 if native else torch.float32
        logger.info("DTYPE=auto: %s (%s)", str(dtype).removeprefix("torch."), reason)
        return dtype
    if name not in _DTYPES:
        raise ModelLoadError(f"unknown DTYPE={name!r}; use auto, float32, float16 or bfloat16")
    return _DTYPES[name]


def check_architecture(cfg: Any) -> None:
    """Check that the model config ``cfg`` describes a supported decoder layout.

    Raises:
        ModelLoadError: for an unsupported architecture or rotary embedding type.
    """
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


def load_model(path: str, device: torch.device, dtype: torch.dtype) -> Any:
    """Load the ``*ForCausalLM`` model of the local model folder ``path`` (offline), in eval mode
    on ``device`` in ``dtype``.

    Raises:
        ModelLoadError: for a missing or broken model folder or an unsupported architecture.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

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
            path, dtype=dtype, local_files_only=True
        )
    except Exception as exc:  # safetensors, torch and transformers raise many kinds here
        raise ModelLoadError(f"model path {path!r}: cannot load the weights: {exc}") from exc
    model.to(device).eval()
    return model


def _context_limit(cfg: Any, max_model_len: int = 0) -> int:
    """Longest sequence (tokens) the model config ``cfg`` attends over in full: its
    ``max_position_embeddings``, at most its sliding window, at most ``max_model_len`` if positive.
    """
    limit = int(cfg.max_position_embeddings)
    window = getattr(cfg, "sliding_window", None)
    if window and getattr(cfg, "use_sliding_window", True):
        # Full attention is only the model's own attention up to its window.
        limit = min(limit, int(window))
    return min(limit, max_model_len) if max_model_len > 0 else limit


def _rotary_tables(inner: Any, max_model_len: int, device: torch.device,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each ``[max_model_len, head_dim]`` in ``dtype``: the rotary embedding of
    every position, from the decoder ``inner``'s own ``rotary_emb``."""
    with torch.inference_mode():
        pos = torch.arange(max_model_len, device=device)[None]
        probe = torch.zeros(1, device=device, dtype=torch.float32)
        cos, sin = inner.rotary_emb(probe, pos)
    return cos[0].to(dtype).contiguous(), sin[0].to(dtype).contiguous()


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
    # (qkv, o, gate_up, down) over packed copies of the weights, each a
    # :class:`~inference.engine.backends.native.gemm.PackedLinear` (bf16 on a CPU with AVX512-BF16;
    # set by the backend), or None: the plain weights above
    packed: tuple[Any, Any, Any, Any] | None = None


def _fuse_layer(layer: Any) -> _Layer:
    """The :class:`_Layer` of a decoder ``layer`` module (its q/k/v and gate/up weights fused).

    Raises:
        ModelLoadError: if the layer lacks a projection or norm of the supported layout.
    """
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
