"""Small LoRA adapters for the tests, made without torch or PEFT: an ``adapter_config.json`` and
an ``adapter_model.safetensors`` (written with ``safetensors.numpy``, or byte by byte for what
that library refuses to write) with the default model's shapes; and the fixtures of a private
``ADAPTER_ROOT`` and of checks run inline instead of by Celery."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

# The fixtures a folder's conftest.py takes with ``from tests.support.adapters import *``.
__all__ = ["adapter_root", "base_config", "checks_inline"]

PREFIX = "base_model.model.model.layers"
BLOCK = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
         "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def default_config() -> dict[str, Any]:
    """The prepared default model's ``config.json`` (skips when the model is not prepared)."""
    from inference.protocol.models import model_folder

    path = model_folder() / "config.json"
    if not path.is_file():
        pytest.skip(f"the default model is not prepared in {model_folder()}")
    return json.loads(path.read_text())


@pytest.fixture
def base_config() -> dict[str, Any]:
    """The default model's ``config.json``."""
    return default_config()


@pytest.fixture
def adapter_root(settings, tmp_path) -> Path:
    """``ADAPTER_ROOT`` in a folder of this test (resolved)."""
    root = (tmp_path / "adapters").resolve()
    root.mkdir(mode=0o700)
    settings.LLM_PLATFORM = {**settings.LLM_PLATFORM, "ADAPTER_ROOT": str(root)}
    return root


@pytest.fixture
def checks_inline(monkeypatch) -> list[int]:
    """An adapter's check runs in this process when it would be queued to Celery (once its
    transaction commits); returns the ids checked."""
    from gateway import adapter_validation
    from tenants import adapters

    checked: list[int] = []

    def validate(adapter_id: int) -> None:
        checked.append(adapter_id)
        adapter_validation.validate(adapter_id)

    monkeypatch.setattr(adapters, "send_validation", validate)
    return checked


def shapes(config: dict[str, Any], module: str, rank: int) -> tuple[tuple[int, int], ...]:
    """The shapes of ``module``'s lora_A and lora_B at ``rank`` over the model of ``config``."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv = config.get("num_key_value_heads") or heads
    fan_in, fan_out = {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv * head_dim),
                       "v_proj": (hidden, kv * head_dim), "o_proj": (heads * head_dim, hidden),
                       "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
                       "down_proj": (inter, hidden)}[module]
    return (rank, fan_in), (fan_out, rank)


def tensor_name(layer: int, module: str, side: str) -> str:
    return f"{PREFIX}.{layer}.{BLOCK[module]}.{module}.lora_{side}.weight"


def lora_tensors(config: dict[str, Any], *, rank: int = 4,
                 modules: Iterable[str] = ("q_proj", "v_proj"), layers: Iterable[int] = (0, 1),
                 dtype: Any = np.float32, seed: int = 0) -> dict[str, np.ndarray]:
    """LoRA weights of ``modules`` in ``layers``, small random values."""
    rng = np.random.default_rng(seed)
    out = {}
    for layer in layers:
        for module in modules:
            a, b = shapes(config, module, rank)
            out[tensor_name(layer, module, "A")] = (rng.standard_normal(a) * 0.01).astype(dtype)
            out[tensor_name(layer, module, "B")] = (rng.standard_normal(b) * 0.01).astype(dtype)
    return out


def adapter_config(rank: int = 4, modules: Iterable[str] = ("q_proj", "v_proj"),
                   **fields: Any) -> dict[str, Any]:
    """An ``adapter_config.json`` as PEFT writes one (``fields`` added or replaced)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
            "lora_dropout": 0.0, "target_modules": list(modules), "bias": "none",
            "base_model_name_or_path": "SmolLM2-135M-Instruct", "modules_to_save": None,
            "use_dora": False, "fan_in_fan_out": False, **fields}


def safetensors_bytes(tensors: dict[str, np.ndarray]) -> bytes:
    """The bytes of a safetensors file of ``tensors`` (``safetensors.numpy``)."""
    from safetensors.numpy import save

    return save(tensors)


def raw_safetensors(tensors: dict[str, tuple[str, tuple[int, ...], bytes]]) -> bytes:
    """A safetensors file written byte by byte: each tensor's dtype, shape and data (any dtype,
    BF16 included, which numpy has not)."""
    header, offset = {}, 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape),
                        "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + b"".join(t[2] for t in tensors.values())


def write_adapter(folder: Path, config: dict[str, Any] | None = None, *,
                  tensors: dict[str, np.ndarray] | None = None, weights: bytes | None = None,
                  rank: int = 4, modules: Iterable[str] = ("q_proj", "v_proj")) -> Path:
    """Write an adapter into ``folder`` (made if missing): ``config`` (default
    :func:`adapter_config`), and ``weights`` as the safetensors file's bytes, else ``tensors``,
    else :func:`lora_tensors` over the default model."""
    folder.mkdir(parents=True, exist_ok=True)
    modules = tuple(modules)
    config = config if config is not None else adapter_config(rank, modules)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    if weights is None:
        if tensors is None:
            tensors = lora_tensors(default_config(), rank=rank, modules=modules)
        weights = safetensors_bytes(tensors)
    (folder / "adapter_model.safetensors").write_bytes(weights)
    return folder


def registered(root: Path, name: str, owner: Any = None, *, base: str = "",
               config: dict[str, Any] | None = None, **write: Any) -> Any:
    """An adapter ``name`` over ``base`` (empty: the default model) of ``owner`` (a tenant;
    None: shared), written under ``root`` and checked now (ready unless its files are refused);
    returns its row."""
    from django.conf import settings

    from gateway import adapter_validation
    from tenants.models import LoraAdapter

    base = base or settings.LLM_PLATFORM["SERVED_MODEL_NAME"]
    slug = owner.slug if owner is not None else "shared"
    folder = write_adapter(root / slug / base.replace("/", "__") / name, config, **write)
    row = LoraAdapter.objects.create(name=name, base_model=base, owner=owner, folder=str(folder))
    adapter_validation.validate(row.pk)
    row.refresh_from_db()
    return row
