"""A LoRA adapter's folder checked before it is served: its ``adapter_config.json``, its
``adapter_model.safetensors`` (header, tensor names, shapes against the base model, values) and
its SHA-256 digest.

Pure functions of their arguments: no Django, no settings, and neither torch nor numpy (the web
tier's Celery worker runs them): the safetensors header is parsed here (an 8-byte little-endian
length, then that many bytes of JSON), and values are tested for being finite from their bit
patterns, a chunk of the file at a time. Every refusal is a :class:`ValueError` whose message
names the problem, in words an adapter's author can act on.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

from inference.protocol import lora_config

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The projections an adapter may adapt, by the block that holds them.
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
TARGET_MODULES = ATTENTION_MODULES + MLP_MODULES
# Files a folder may not hold: pickles (loading one runs code), whatever their name.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
# The dtypes a tensor may have, and their sizes (bytes).
DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2}
# The largest safetensors header (bytes; the safetensors library's own limit).
MAX_HEADER_BYTES = 100_000_000
# The largest adapter_config.json read (bytes).
MAX_CONFIG_BYTES = 1 << 20
# A LoRA weight of one projection of one layer, as PEFT saves it.
TENSOR_RE = re.compile(r"base_model\.model\.model\.layers\.(0|[1-9][0-9]{0,5})\."
                       r"(self_attn|mlp)\.([a-z_]+)\.lora_(A|B)\.weight")
# How much of the file is read at a time (bytes; a multiple of every dtype's size).
CHUNK_BYTES = 4 << 20


class AdapterFacts(NamedTuple):
    """What a valid adapter is: its LoRA ``rank`` (``r``), the projections it adapts
    (``targets``, in :data:`TARGET_MODULES` order), the SHA-256 ``digest`` (hex) of its
    safetensors file and the ``size`` of its two files (bytes)."""

    rank: int
    targets: tuple[str, ...]
    digest: str
    size: int


@dataclass(frozen=True)
class Tensor:
    """A tensor of a safetensors header: ``dtype``, ``shape``, and its data's ``begin`` and
    ``end`` as offsets into the file (bytes)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def read_header(file: BinaryIO, size: int) -> dict[str, Tensor]:
    """The tensors of the safetensors file ``file`` (read from its start) of ``size`` bytes,
    by name; ``__metadata__`` is skipped.

    Raises:
        ValueError: not a safetensors file (a header length past the file or over
            :data:`MAX_HEADER_BYTES`, a header that is not a JSON object of tensors, a tensor
            without a valid dtype, shape or data range), a dtype other than F32, F16 and BF16,
            a tensor whose range does not hold exactly its shape's bytes, or ranges that lie
            past the end of the file, overlap or leave a gap.
    """
    file.seek(0)
    start = file.read(8)
    if len(start) < 8:
        raise ValueError(f"{WEIGHTS_FILE} is not a safetensors file: it is shorter than the "
                         "8 bytes of a header length.")
    length = int.from_bytes(start, "little")
    if length < 2 or length > MAX_HEADER_BYTES or 8 + length > size:
        raise ValueError(f"{WEIGHTS_FILE} is not a safetensors file: its first 8 bytes give a "
                         f"header of {length} bytes, past the file's {size} bytes (a pickle, "
                         "such as adapter_model.bin, is never accepted).")
    raw = file.read(length)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ValueError(f"{WEIGHTS_FILE} is not a safetensors file: its header is not "
                         "JSON.") from exc
    if not isinstance(header, dict):
        raise ValueError(f"{WEIGHTS_FILE} is not a safetensors file: its header is not a JSON "
                         "object.")
    data_start = 8 + length
    tensors = {name: _tensor(name, entry, data_start) for name, entry in header.items()
               if name != "__metadata__"}
    _check_ranges(tensors, size)
    return tensors


def _tensor(name: str, entry: Any, data_start: int) -> Tensor:
    if not isinstance(entry, dict):
        raise ValueError(f"{WEIGHTS_FILE}: the header's entry of tensor '{name}' is not an "
                         "object.")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"{WEIGHTS_FILE}: tensor '{name}' has dtype {dtype!r}; only F32, F16 "
                         "and BF16 are accepted.")
    if not (isinstance(shape, list) and all(_count(n) for n in shape)):
        raise ValueError(f"{WEIGHTS_FILE}: tensor '{name}' has no valid shape.")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_count, offsets))
            and offsets[0] <= offsets[1]):
        raise ValueError(f"{WEIGHTS_FILE}: tensor '{name}' has no valid data_offsets.")
    if offsets[1] - offsets[0] != math.prod(shape) * DTYPE_BYTES[dtype]:
        raise ValueError(f"{WEIGHTS_FILE}: tensor '{name}' has a data range of "
                         f"{offsets[1] - offsets[0]} bytes, not the "
                         f"{math.prod(shape) * DTYPE_BYTES[dtype]} of its shape {shape} in "
                         f"{dtype}.")
    return Tensor(name, dtype, tuple(shape), data_start + offsets[0], data_start + offsets[1])


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_ranges(tensors: Mapping[str, Tensor], size: int) -> None:
    """The data ranges lie inside the file, one after the other from the header's end to the
    file's end, as the safetensors format lays them out."""
    ordered = sorted(tensors.values(), key=lambda t: (t.begin, t.end))
    for tensor in ordered:
        if tensor.end > size:
            raise ValueError(f"{WEIGHTS_FILE}: tensor '{tensor.name}' has a data range "
                             f"(bytes {tensor.begin} to {tensor.end}) beyond the end of the "
                             f"file ({size} bytes).")
    for before, after in zip(ordered, ordered[1:], strict=False):
        if after.begin != before.end:
            why = "overlaps" if after.begin < before.end else "leaves a gap after"
            raise ValueError(f"{WEIGHTS_FILE}: the data of tensor '{after.name}' {why} that "
                             f"of '{before.name}'.")
    if ordered and ordered[-1].end != size:
        raise ValueError(f"{WEIGHTS_FILE}: {size - ordered[-1].end} bytes follow the last "
                         "tensor's data.")


def check_config(config: Any, max_rank: int) -> tuple[int, tuple[str, ...]]:
    """The rank ``r`` and the ``target_modules`` of a parsed ``adapter_config.json``.

    Raises:
        ValueError: not a JSON object; ``peft_type`` not ``LORA``; ``r`` not an integer from 1
            to ``max_rank``; ``lora_alpha`` not a positive number; ``modules_to_save``,
            DoRA (``use_dora``), per-module ranks or alphas (``rank_pattern``,
            ``alpha_pattern``), ``fan_in_fan_out`` or a ``bias`` other than ``none``; another
            field that changes what the adapter computes set
            (:func:`inference.protocol.lora_config.unserved_fields`); a scale ``lora_alpha / r``
            over :data:`inference.protocol.lora_config.MAX_SCALE`; ``target_modules`` a string
            (a regex) or not a non-empty list of :data:`TARGET_MODULES`.
    """
    if not isinstance(config, dict):
        raise ValueError(f"{CONFIG_FILE} is not a JSON object.")
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{CONFIG_FILE}: peft_type is {config.get('peft_type')!r}; only LoRA "
                         "adapters ('LORA') are served.")
    rank = config.get("r")
    if not _count(rank) or not 1 <= rank <= max_rank:
        raise ValueError(f"{CONFIG_FILE}: the rank r={rank!r} is not an integer from 1 to "
                         f"{max_rank} (MAX_LORA_RANK).")
    alpha = config.get("lora_alpha")
    if (not isinstance(alpha, int | float) or isinstance(alpha, bool) or not math.isfinite(alpha)
            or alpha <= 0):
        raise ValueError(f"{CONFIG_FILE}: lora_alpha={alpha!r} is not a positive number.")
    if config.get("modules_to_save"):
        raise ValueError(f"{CONFIG_FILE}: modules_to_save ({config['modules_to_save']!r}) is "
                         "not supported: an adapter holds LoRA weights only, no module trained "
                         "in full.")
    if config.get("use_dora"):
        raise ValueError(f"{CONFIG_FILE}: DoRA (use_dora) is not supported.")
    for field in ("rank_pattern", "alpha_pattern"):
        if config.get(field):
            raise ValueError(f"{CONFIG_FILE}: {field} (per-module ranks or alphas) is not "
                             "supported.")
    if config.get("fan_in_fan_out"):
        raise ValueError(f"{CONFIG_FILE}: fan_in_fan_out is not supported.")
    unserved = lora_config.unserved_fields(config)
    if unserved:
        raise ValueError(f"{CONFIG_FILE}: {', '.join(f'{n}={config[n]!r}' for n in unserved)}: "
                         "not served (a setting that changes what the adapter computes); "
                         "leave it unset (null).")
    if lora_config.scale(config, rank) > lora_config.MAX_SCALE:
        raise ValueError(f"{CONFIG_FILE}: lora_alpha={alpha!r} over r={rank} scales the deltas by "
                         f"{lora_config.scale(config, rank):.6g}, over "
                         f"{lora_config.MAX_SCALE:g}.")
    if config.get("bias", "none") not in ("none", None):
        raise ValueError(f"{CONFIG_FILE}: bias={config['bias']!r} is not supported (only "
                         "'none').")
    targets = config.get("target_modules")
    if isinstance(targets, str):
        raise ValueError(f"{CONFIG_FILE}: target_modules is a string ({targets!r}), which PEFT "
                         "reads as a regex: not supported; list the modules.")
    if not (isinstance(targets, list) and targets and all(isinstance(t, str) for t in targets)):
        raise ValueError(f"{CONFIG_FILE}: target_modules is not a non-empty list of module "
                         "names.")
    unknown = sorted({t for t in targets if t not in TARGET_MODULES})
    if unknown:
        raise ValueError(f"{CONFIG_FILE}: target_modules names {', '.join(unknown)}; only "
                         f"{', '.join(TARGET_MODULES)} are supported.")
    return rank, tuple(m for m in TARGET_MODULES if m in targets)


def projection_shapes(base_config: Mapping[str, Any]) -> tuple[int, dict[str, tuple[int, int]]]:
    """The base model's layers and each projection's (in features, out features), from its
    ``config.json`` (``hidden_size``, ``intermediate_size``, ``num_attention_heads``,
    ``num_key_value_heads`` (default: the heads), ``head_dim`` (default: hidden / heads),
    ``num_hidden_layers``).

    Raises:
        ValueError: one of them is missing or not a positive integer.
    """
    def positive(field: str, default: Any = None) -> int:
        value = base_config.get(field) or default
        if not _count(value) or value == 0:
            raise ValueError(f"the base model's config.json has no valid {field} ({value!r}).")
        return value

    hidden, intermediate = positive("hidden_size"), positive("intermediate_size")
    heads = positive("num_attention_heads")
    kv_heads = positive("num_key_value_heads", heads)
    head_dim = positive("head_dim", hidden // heads)
    layers = positive("num_hidden_layers")
    return layers, {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
                    "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden),
                    "gate_proj": (hidden, intermediate), "up_proj": (hidden, intermediate),
                    "down_proj": (intermediate, hidden)}


def check_tensors(tensors: Mapping[str, Tensor], rank: int, targets: tuple[str, ...],
                  base_config: Mapping[str, Any]) -> tuple[str, ...]:
    """The projections the tensors adapt (in :data:`TARGET_MODULES` order), each checked to be a
    LoRA weight of the base model: ``lora_A`` of shape [r, in features], ``lora_B`` of shape
    [out features, r] (:func:`projection_shapes`), of a layer the base model has, of a module
    among ``targets``, every ``lora_A`` with its ``lora_B`` and back.

    Raises:
        ValueError: any other tensor (embeddings or an ``lm_head``, as an adapter with resized
            embeddings holds), a layer past the base model's, a module not in ``targets``, a
            wrong shape, a weight without its pair, or no tensor at all.
    """
    layers, shapes = projection_shapes(base_config)
    pairs: dict[tuple[int, str], set[str]] = {}
    for name, tensor in tensors.items():
        match = TENSOR_RE.fullmatch(name)
        block = match and ("self_attn" if match[3] in ATTENTION_MODULES else "mlp")
        if match is None or match[3] not in TARGET_MODULES or match[2] != block:
            if "embed" in name or "lm_head" in name:
                raise ValueError(f"{WEIGHTS_FILE} holds '{name}': resized embeddings or a "
                                 "trained lm_head are not supported (LoRA weights of the "
                                 "projections only).")
            raise ValueError(f"{WEIGHTS_FILE} holds '{name}', which is not a LoRA weight of a "
                             f"supported projection ({', '.join(TARGET_MODULES)}).")
        layer, module, side = int(match[1]), match[3], match[4]
        if layer >= layers:
            raise ValueError(f"{WEIGHTS_FILE}: tensor '{name}' is of layer {layer}; the base "
                             f"model has {layers} layers.")
        if module not in targets:
            raise ValueError(f"{WEIGHTS_FILE}: tensor '{name}' adapts {module}, which "
                             f"target_modules does not name.")
        fan_in, fan_out = shapes[module]
        expected = (rank, fan_in) if side == "A" else (fan_out, rank)
        if tensor.shape != expected:
            raise ValueError(f"{WEIGHTS_FILE}: tensor '{name}' has shape {list(tensor.shape)}; "
                             f"the base model's {module} with r={rank} needs "
                             f"{list(expected)}.")
        pairs.setdefault((layer, module), set()).add(side)
    if not pairs:
        raise ValueError(f"{WEIGHTS_FILE} holds no LoRA weight.")
    for (layer, module), sides in sorted(pairs.items()):
        if sides != {"A", "B"}:
            missing = "lora_B" if "A" in sides else "lora_A"
            raise ValueError(f"{WEIGHTS_FILE}: layer {layer}'s {module} has no {missing} "
                             "weight (every lora_A needs its lora_B).")
    return tuple(m for m in TARGET_MODULES if any(key[1] == m for key in pairs))


# Bytes whose bits make a value not finite (its exponent all ones), by the byte they test:
# the top byte of an F32 or BF16 value (sign, then 7 exponent bits), the byte below it (the
# exponent's last bit on top), and the top byte of an F16 value (sign, 5 exponent bits, 2 more).
_HIGH = bytes(int(b & 0x7F == 0x7F) for b in range(256))
_LOW = bytes(int(b >= 0x80) for b in range(256))
_F16_HIGH = bytes(int(b & 0x7C == 0x7C) for b in range(256))


def _weight_bound_tables(exponent: int) -> tuple[bytes, bytes, bytes]:
    """Byte tables of a value at or over ``2 ** exponent`` in magnitude (infinities and NaN
    included): F32/BF16's top byte alone, the top byte when the next byte's top bit decides,
    and F16's top byte."""
    t = 127 + exponent  # the least biased exponent of such a value (F32, BF16)
    high = bytes(int((b & 0x7F) > t >> 1 or ((b & 0x7F) == t >> 1 and not t & 1))
                 for b in range(256))
    edge = bytes(int((b & 0x7F) == t >> 1 and bool(t & 1)) for b in range(256))
    f16 = bytes(int((b >> 2) & 0x1F >= 15 + exponent) for b in range(256))
    return high, edge, f16


_BIG_HIGH, _BIG_EDGE, _BIG_F16 = _weight_bound_tables(lora_config.MAX_WEIGHT_EXPONENT)


def all_within(data: bytes, dtype: str) -> bool:
    """Whether every value of ``data`` (as :func:`all_finite` takes it) is below
    :data:`inference.protocol.lora_config.MAX_WEIGHT` in magnitude."""
    if dtype == "F16":
        return 1 not in data[1::2].translate(_BIG_F16)
    width = DTYPE_BYTES[dtype]
    high = data[width - 1::width]
    if 1 in high.translate(_BIG_HIGH):
        return False
    edge = int.from_bytes(high.translate(_BIG_EDGE), "little")
    return edge & int.from_bytes(data[width - 2::width].translate(_LOW), "little") == 0


def all_finite(data: bytes, dtype: str) -> bool:
    """Whether every value of ``data`` (little-endian values of ``dtype``: F32, F16 or BF16,
    whole values only) is finite (neither NaN nor infinite)."""
    if dtype == "F16":
        return 1 not in data[1::2].translate(_F16_HIGH)
    width = DTYPE_BYTES[dtype]
    high = data[width - 1::width].translate(_HIGH)
    low = data[width - 2::width].translate(_LOW)
    return int.from_bytes(high, "little") & int.from_bytes(low, "little") == 0


def _chunks(file: BinaryIO, begin: int, end: int) -> Iterator[bytes]:
    file.seek(begin)
    while begin < end:
        chunk = file.read(min(CHUNK_BYTES, end - begin))
        if not chunk:
            raise ValueError(f"{WEIGHTS_FILE} ended while it was read.")
        begin += len(chunk)
        yield chunk


def check_values(file: BinaryIO, tensors: Mapping[str, Tensor]) -> None:
    """Read every tensor's values from ``file``, a chunk at a time.

    Raises:
        ValueError: a tensor holds a value that is NaN or infinite, or of
            :data:`inference.protocol.lora_config.MAX_WEIGHT` or more in magnitude, or the file
            cannot be read to its end.
    """
    for tensor in sorted(tensors.values(), key=lambda t: t.begin):
        for chunk in _chunks(file, tensor.begin, tensor.end):
            if not all_finite(chunk, tensor.dtype):
                raise ValueError(f"{WEIGHTS_FILE}: tensor '{tensor.name}' holds a value that "
                                 "is not finite (NaN or infinity).")
            if not all_within(chunk, tensor.dtype):
                raise ValueError(f"{WEIGHTS_FILE}: tensor '{tensor.name}' holds a value of "
                                 f"{lora_config.MAX_WEIGHT:g} or more in magnitude: LoRA "
                                 "weights are far smaller, and such a one can overflow the "
                                 "model's activations.")


def digest_of(file: BinaryIO, size: int) -> str:
    """The SHA-256 (hex) of the ``size`` bytes of ``file``."""
    sha = hashlib.sha256()
    for chunk in _chunks(file, 0, size):
        sha.update(chunk)
    return sha.hexdigest()


def _inside(path: Path, root: Path, what: str) -> Path:
    resolved = path.resolve()
    if resolved == root or not resolved.is_relative_to(root):
        raise ValueError(f"{what} is not under ADAPTER_ROOT ({root}).")
    return resolved


def check_adapter(folder: str | Path, base_config: Mapping[str, Any], *, root: Path,
                  max_rank: int, max_bytes: int) -> AdapterFacts:
    """Check the LoRA adapter in ``folder`` against its base model's ``config.json``
    (``base_config``, parsed) and the limits: ``root`` (``ADAPTER_ROOT``, resolved), the
    largest rank ``max_rank`` (``MAX_LORA_RANK``) and the most bytes of its two files
    ``max_bytes`` (``MAX_ADAPTER_BYTES``).

    Raises:
        ValueError: the folder, or one of its files, is not under ``root`` (symlinks
            followed); a file is missing; the folder holds a pickle (:data:`PICKLE_SUFFIXES`,
            ``adapter_model.bin`` among them); the files are over ``max_bytes``; or
            :func:`check_config`, :func:`read_header`, :func:`check_tensors` or
            :func:`check_values` refuses it. The message names the problem.
    """
    where = _inside(Path(folder).expanduser(), root, f"the folder {folder}")
    if not where.is_dir():
        raise ValueError(f"the folder {folder} does not exist.")
    pickles = sorted(str(p.relative_to(where)) for p in where.rglob("*")
                     if p.suffix.lower() in PICKLE_SUFFIXES)
    if pickles:
        raise ValueError(f"the folder holds {', '.join(pickles)}: pickle files (.bin, .pt, "
                         f".pkl, ...) are never loaded; an adapter is {WEIGHTS_FILE} only.")
    files = {}
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        path = _inside(where / name, root, name)
        if not path.is_file():
            raise ValueError(f"the folder has no {name}.")
        files[name] = path
    size = sum(path.stat().st_size for path in files.values())
    if size > max_bytes:
        raise ValueError(f"the adapter's files hold {size} bytes, over the limit of {max_bytes} "
                         "(MAX_ADAPTER_BYTES).")
    if files[CONFIG_FILE].stat().st_size > MAX_CONFIG_BYTES:
        raise ValueError(f"{CONFIG_FILE} is over {MAX_CONFIG_BYTES} bytes.")
    try:
        config = json.loads(files[CONFIG_FILE].read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ValueError(f"{CONFIG_FILE} is not valid JSON.") from exc
    rank, targets = check_config(config, max_rank)
    weights_size = files[WEIGHTS_FILE].stat().st_size
    with files[WEIGHTS_FILE].open("rb") as file:
        tensors = read_header(file, weights_size)
        adapted = check_tensors(tensors, rank, targets, base_config)
        check_values(file, tensors)
        digest = digest_of(file, weights_size)
    return AdapterFacts(rank, adapted, digest, size)
