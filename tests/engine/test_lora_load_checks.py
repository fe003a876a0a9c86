"""What the engine refuses when it loads an adapter (``build_adapter``, on the compute thread):
the refusals of the adapter's check before it was served, again, so that a config or weights
edited after the check are never served as edited (the weights' digest covers the weights
file; these cover the config's settings and every number)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save

from inference.engine.lora import AdapterError, AdapterFiles, ModelShape, build_adapter

SHAPE = ModelShape.of(2, 64, 128, 4, 2, 16)
RANK = 4


def files(config: dict | None = None, scale_b: float = 0.01) -> AdapterFiles:
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(2):
        for module in ("q_proj", "v_proj"):
            fan_in, fan_out = SHAPE.features[module]
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(RANK, fan_in, generator=gen) * 0.01
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, RANK, generator=gen) * scale_b
    base = {"peft_type": "LORA", "r": RANK, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"],
            "task_type": "CAUSAL_LM", "lora_dropout": 0.05, "layers_to_transform": None,
            "exclude_modules": None, "lora_bias": False, "init_lora_weights": True}
    return AdapterFiles(digest="d" * 64, config={**base, **(config or {})}, weights=save(tensors))


def test_an_adapter_as_checked_loads():
    weights = build_adapter(files(), SHAPE, torch.float32, 64)
    assert weights.rank == RANK and weights.layers[0]["qkv"] is not None


@pytest.mark.parametrize(("edit", "reason"), [
    ({"layers_to_transform": [0]}, "sets layers_to_transform, which change what the adapter"),
    ({"exclude_modules": ["q_proj"]}, "sets exclude_modules"),
    ({"lora_bias": True, "layer_replication": [[0, 1]]}, "sets layer_replication, lora_bias"),
    ({"target_modules": ["q_proj"]}, "adapts v_proj, which target_modules does not name"),
    ({"lora_alpha": 1e308}, r"scales the deltas by 2\.5e\+307, over 256"),
    ({"lora_alpha": float("inf")}, "lora_alpha must be a positive number"),
])
def test_a_config_edited_after_its_check_is_refused(edit, reason):
    with pytest.raises(AdapterError, match=reason):
        build_adapter(files(edit), SHAPE, torch.float32, 64)


def test_weights_that_would_overflow_the_activations_are_refused():
    build_adapter(files(scale_b=50.0), SHAPE, torch.float32, 64)  # large, within the bound
    with pytest.raises(AdapterError, match="holds a value of 256 or more in magnitude"):
        build_adapter(files(scale_b=1e30), SHAPE, torch.bfloat16, 64)
