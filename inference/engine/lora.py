"""LoRA adapters in the forward pass: one adapter's weights laid out per fused projection, and
the low-rank delta of a pass whose rows run under different adapters.

A PEFT LoRA adapter (Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", 2021)
adds to a projection ``y = x W^T`` the term ``s * (x A^T) B^T``, with ``A [r, in]``,
``B [out, r]`` and ``s = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``). The
backend fuses q/k/v into one projection and gate/up into another; :class:`AdapterWeights` lays
an adapter out the same way: per layer and fused projection, ``A`` of its modules stacked
``[m * r, in]`` and each module's ``B`` transposed and scaled, side by side ``[r, sum widths]``
(a module the adapter does not target is left out; a projection none of whose modules it
targets has none).

A pass mixes rows of several adapters and of the bare base model (S-LoRA, Sheng et al. 2023;
Punica, Chen et al. 2023): the base projection runs once over all the pass's tokens, then each
adapter's delta is added to its own tokens only: :func:`add_deltas` in PyTorch, gathered by
index (a segment per adapter), or, in a decode pass, the native kernel row by row
(``decode_layer.c``). Row for row this is the merged model ``W + s B A`` up to rounding.

Tensor work here runs on the engine's compute thread; :func:`read_adapter_files` (file reading
only) is what a loader thread runs.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from inference.protocol import lora_config

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The projections an adapter may target, per fused projection of the backend, in fused order.
FUSED = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
         "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}
PROJECTIONS = tuple(name for names in FUSED.values() for name in names)
_TENSOR = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class AdapterError(Exception):
    """An adapter that cannot be loaded: its files are missing or unreadable, its digest is not
    the registry's, or its shapes or settings do not fit the model. The message says which."""


@dataclass(frozen=True)
class AdapterFiles:
    """An adapter's files as read from disk (by a loader thread): its config and the bytes of
    its safetensors file, whose SHA-256 matched the registry's ``digest``; ``key``: the
    adapter's (:func:`inference.protocol.messages.adapter_key`)."""

    digest: str
    config: dict[str, Any]
    weights: bytes
    key: str = ""


def read_adapter_files(folder: str | Path, digest: str, max_bytes: int) -> AdapterFiles:
    """Read an adapter's ``adapter_config.json`` and ``adapter_model.safetensors`` (file reading
    and hashing only: no tensor work, safe off the compute thread).

    Raises:
        AdapterError: a file is missing, unreadable or over ``max_bytes``, the config is not a
            JSON object, or the weights' SHA-256 is not ``digest``.
    """
    folder = Path(folder)
    try:
        config = json.loads((folder / CONFIG_FILE).read_text(encoding="utf-8"))
        path = folder / WEIGHTS_FILE
        size = path.stat().st_size
        if size > max_bytes:
            raise AdapterError(f"{WEIGHTS_FILE} holds {size} bytes, over {max_bytes}")
        weights = path.read_bytes()
    except OSError as exc:  # (its folder is the server's business: not in the message)
        what = Path(exc.filename).name if exc.filename else "its files"
        raise AdapterError(f"cannot read {what}: {exc.strerror or type(exc).__name__}") from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(f"{CONFIG_FILE} is not JSON text: {exc}") from exc
    if not isinstance(config, dict):
        raise AdapterError(f"{CONFIG_FILE} is not a JSON object")
    found = hashlib.sha256(weights).hexdigest()
    if found != digest:
        raise AdapterError(f"{WEIGHTS_FILE} changed since it was validated (SHA-256 {found[:12]}"
                           f"..., registered {digest[:12]}...)")
    return AdapterFiles(digest=digest, config=config, weights=weights)


@dataclass(frozen=True)
class ModelShape:
    """What an adapter's shapes are checked against: the model's layers and each projection's
    ``(in, out)`` features."""

    num_layers: int
    features: dict[str, tuple[int, int]]

    @classmethod
    def of(cls, num_layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int,
           head_dim: int) -> ModelShape:
        q, kv = heads * head_dim, kv_heads * head_dim
        return cls(num_layers, {
            "q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
            "o_proj": (q, hidden), "gate_proj": (hidden, intermediate),
            "up_proj": (hidden, intermediate), "down_proj": (intermediate, hidden)})


@dataclass(frozen=True)
class ProjectionLora:
    """An adapter's part of one fused projection of one layer: ``a [m * r, in]`` (the ``A`` of
    its ``m`` modules stacked) and ``b [r, sum widths]`` (each module's ``B`` transposed and
    scaled, side by side); module ``j`` writes output columns ``[offsets[j], offsets[j] +
    widths[j])`` of the fused projection from ``b``'s columns starting at ``columns[j]``."""

    a: torch.Tensor
    b: torch.Tensor
    offsets: tuple[int, ...]
    widths: tuple[int, ...]
    columns: tuple[int, ...]


@dataclass
class AdapterWeights:
    """One loaded adapter (``key``: :attr:`AdapterFiles.key`): per layer, per fused
    projection (``qkv``, ``o``, ``gate_up``, ``down``), its :class:`ProjectionLora` in the
    model's dtype, or None where the adapter targets none of its modules. ``rank``: its
    ``r``; ``nbytes``: its tensors' bytes; ``dtype``: its tensors'; ``native``: the native
    kernel's description of it (:mod:`inference.engine.backends.native.lora`, made on first
    use)."""

    key: str
    rank: int
    layers: list[dict[str, ProjectionLora | None]]
    nbytes: int
    dtype: torch.dtype = torch.float32
    native: Any = None


def _scale(config: dict[str, Any], rank: int) -> float:
    alpha = config.get("lora_alpha", rank)
    if (not isinstance(alpha, int | float) or isinstance(alpha, bool) or not math.isfinite(alpha)
            or not alpha > 0):
        raise AdapterError(f"lora_alpha must be a positive number, got {alpha!r}")
    scale = lora_config.scale(config, rank)
    if scale > lora_config.MAX_SCALE:
        raise AdapterError(f"lora_alpha={alpha!r} over r={rank} scales the deltas by "
                           f"{scale:.6g}, over {lora_config.MAX_SCALE:g}")
    return scale


def build_adapter(files: AdapterFiles, shape: ModelShape, dtype: torch.dtype,
                  max_rank: int) -> AdapterWeights:
    """Lay out an adapter's tensors for the forward pass (on the compute thread).

    Raises:
        AdapterError: not a LoRA adapter the engine runs (another PEFT type, DoRA,
            ``modules_to_save``, a rank over ``max_rank``, per-module ranks or alphas, another
            setting that changes what it computes: ``lora_config.unserved_fields``), a scale
            over ``lora_config.MAX_SCALE``, a tensor it does not expect (embeddings, the LM head,
            a module ``target_modules`` does not name), a shape that is not the model's, a
            missing ``A`` or ``B``, or a value that is not finite or not below
            ``lora_config.MAX_WEIGHT`` in magnitude.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load as load_safetensors

    config = files.config
    if str(config.get("peft_type", "")).upper() != "LORA":
        raise AdapterError(f"peft_type is {config.get('peft_type')!r}, not LORA")
    if config.get("use_dora") or config.get("modules_to_save") or config.get("rank_pattern") \
            or config.get("alpha_pattern"):
        raise AdapterError("DoRA, modules_to_save and per-module ranks or alphas are not served")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= max_rank:
        raise AdapterError(f"rank r={rank!r} is not within 1..{max_rank} (MAX_LORA_RANK)")
    unserved = lora_config.unserved_fields(config)
    if unserved:
        raise AdapterError(f"{CONFIG_FILE} sets {', '.join(unserved)}, which change what the "
                           "adapter computes and are not served")
    targets = config.get("target_modules")
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise AdapterError(f"{CONFIG_FILE}: target_modules is not a list of module names")
    scale = _scale(config, rank)
    try:
        tensors = load_safetensors(files.weights)
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise AdapterError(f"{WEIGHTS_FILE} is not a readable safetensors file: {exc}") from exc
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _TENSOR.match(name)
        if match is None or match.group(2) not in PROJECTIONS:
            raise AdapterError(f"tensor {name!r} is not a LoRA A/B of a served projection "
                               "(embeddings and the LM head cannot be adapted)")
        layer, module, part = int(match.group(1)), match.group(2), match.group(3)
        if layer >= shape.num_layers:
            raise AdapterError(f"tensor {name!r}: the model has {shape.num_layers} layers")
        fan_in, fan_out = shape.features[module]
        want = (rank, fan_in) if part == "A" else (fan_out, rank)
        if tuple(tensor.shape) != want:
            raise AdapterError(f"tensor {name!r} is {tuple(tensor.shape)}, the model needs "
                               f"{want}")
        if module not in targets:
            raise AdapterError(f"tensor {name!r} adapts {module}, which target_modules does not "
                               "name")
        if not torch.isfinite(tensor).all():
            raise AdapterError(f"tensor {name!r} holds a value that is not finite")
        if tensor.numel() and tensor.abs().max().item() >= lora_config.MAX_WEIGHT:
            raise AdapterError(f"tensor {name!r} holds a value of {lora_config.MAX_WEIGHT:g} or "
                               "more in magnitude")
        found.setdefault((layer, module), {})[part] = tensor
    for (layer, module), parts in found.items():
        if set(parts) != {"A", "B"}:
            raise AdapterError(f"layer {layer} {module}: lora_A and lora_B come in pairs")
    layers: list[dict[str, ProjectionLora | None]] = []
    nbytes = 0
    for i in range(shape.num_layers):
        fused: dict[str, ProjectionLora | None] = {}
        for proj, modules in FUSED.items():
            outs = [shape.features[m][1] for m in modules]
            present = [(j, found[(i, m)]) for j, m in enumerate(modules) if (i, m) in found]
            if not present:
                fused[proj] = None
                continue
            a = torch.cat([p["A"].float() for _, p in present]).to(dtype).contiguous()
            b = (torch.cat([p["B"].float().t() for _, p in present], dim=1) * scale)
            b = b.to(dtype).contiguous()
            widths = tuple(outs[j] for j, _ in present)
            fused[proj] = ProjectionLora(
                a, b, offsets=tuple(sum(outs[:j]) for j, _ in present), widths=widths,
                columns=tuple(sum(widths[:k]) for k in range(len(widths))))
            nbytes += a.numel() * a.element_size() + b.numel() * b.element_size()
        layers.append(fused)
    if not found:
        raise AdapterError("the adapter holds no LoRA tensors")
    return AdapterWeights(key=files.key or files.digest, rank=rank, layers=layers, nbytes=nbytes,
                          dtype=dtype)


@dataclass(frozen=True)
class LoraSegment:
    """The tokens of one pass that run under one adapter: ``index`` ``[n]`` int64 positions in
    the pass's packed tokens (None: every token of the pass)."""

    weights: AdapterWeights
    index: torch.Tensor | None


def segments(row_adapters: Sequence[AdapterWeights | None],
             row_tokens: Sequence[int]) -> list[LoraSegment]:
    """Group a pass's rows by adapter: one :class:`LoraSegment` per adapter present, over the
    packed token positions of its rows (rows in pass order, ``row_tokens[i]`` new tokens each);
    rows of the bare base model get none. ``[]`` when no row has an adapter."""
    by_adapter: dict[str, tuple[AdapterWeights, list[int]]] = {}
    start = 0
    for weights, count in zip(row_adapters, row_tokens, strict=True):
        if weights is not None:
            by_adapter.setdefault(weights.key, (weights, []))[1].extend(
                range(start, start + count))
        start += count
    out = []
    for weights, index in by_adapter.values():
        whole = len(index) == start
        out.append(LoraSegment(weights, None if whole else torch.tensor(index)))
    return out


def add_deltas(y: torch.Tensor, x: torch.Tensor, lora: Sequence[LoraSegment], layer: int,
               proj: str) -> torch.Tensor:
    """Add to ``y [N, out]`` (the base projection of ``x [N, in]``, changed in place) each
    segment's low-rank delta on its own tokens: ``(x A^T) B`` per module of the fused
    projection, ``B`` already scaled and transposed. Returns ``y``."""
    for segment in lora:
        part = segment.weights.layers[layer][proj]
        if part is None:
            continue
        rows = x if segment.index is None else x.index_select(0, segment.index)
        t = rows @ part.a.t()  # [n, modules * r]
        r = segment.weights.rank
        for j, (offset, width, column) in enumerate(
                zip(part.offsets, part.widths, part.columns, strict=True)):
            delta = t[:, j * r:(j + 1) * r] @ part.b[:, column:column + width]
            target = y[:, offset:offset + width]
            if segment.index is None:
                target.add_(delta)
            else:
                target.index_add_(0, segment.index, delta)
    return y
