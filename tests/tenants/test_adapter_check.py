"""A LoRA adapter's folder checked before it is served (``tenants.adapter_check``): a valid
adapter's facts, and each refusal with its reason. No database, no torch."""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct

import numpy as np
import pytest

from tenants.adapter_check import AdapterFacts, all_finite, all_within, check_adapter
from tests.support.adapters import (
    adapter_config,
    lora_tensors,
    raw_safetensors,
    safetensors_bytes,
    tensor_name,
    write_adapter,
)

MAX_RANK = 64
MAX_BYTES = 64 << 20


@pytest.fixture
def root(tmp_path):
    root = (tmp_path / "root").resolve()
    root.mkdir()
    return root


def check(folder, config, root, **limits):
    return check_adapter(folder, config, root=root, **{"max_rank": MAX_RANK,
                                                      "max_bytes": MAX_BYTES, **limits})


def refusal(folder, config, root, **limits) -> str:
    with pytest.raises(ValueError) as caught:
        check(folder, config, root, **limits)
    return str(caught.value)


def test_a_valid_adapter_gives_its_rank_targets_digest_and_size(root, base_config):
    folder = write_adapter(root / "t" / "good", rank=8, modules=("v_proj", "q_proj"))
    facts = check(folder, base_config, root)
    weights = (folder / "adapter_model.safetensors").read_bytes()
    size = len(weights) + (folder / "adapter_config.json").stat().st_size
    assert facts == AdapterFacts(8, ("q_proj", "v_proj"), hashlib.sha256(weights).hexdigest(),
                                 size)


def test_every_projection_of_every_layer_in_half_precision_is_valid(root, base_config):
    modules = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    tensors = lora_tensors(base_config, rank=8, modules=modules, dtype=np.float16,
                           layers=range(base_config["num_hidden_layers"]))
    folder = write_adapter(root / "all", adapter_config(8, modules), tensors=tensors)
    assert check(folder, base_config, root).targets == modules


def test_a_bf16_adapter_is_valid(root, base_config):
    f32 = lora_tensors(base_config)
    bf16 = {name: ("BF16", a.shape, (a.view(np.uint32) >> 16).astype("<u2").tobytes())
            for name, a in f32.items()}
    folder = write_adapter(root / "bf16", weights=raw_safetensors(bf16))
    assert check(folder, base_config, root).rank == 4


def test_a_rank_over_max_lora_rank_is_refused(root, base_config):
    folder = write_adapter(root / "big", rank=16)
    assert "r=16 is not an integer from 1 to 8 (MAX_LORA_RANK)" in refusal(
        folder, base_config, root, max_rank=8)


def test_a_pickle_beside_the_safetensors_file_is_refused(root, base_config):
    folder = write_adapter(root / "pickled")
    (folder / "adapter_model.bin").write_bytes(b"\x80\x04\x95" + b"\x00" * 64)
    assert "adapter_model.bin: pickle files" in refusal(folder, base_config, root)


def test_a_file_that_is_not_safetensors_is_refused(root, base_config):
    folder = write_adapter(root / "pickle-inside", weights=b"\x80\x04\x95" + b"\x00" * 100)
    assert "adapter_model.safetensors is not a safetensors file" in refusal(
        folder, base_config, root)
    folder = write_adapter(root / "text", weights=struct.pack("<Q", 4) + b"nope")
    assert "its header is not JSON" in refusal(folder, base_config, root)


def test_a_wrong_shape_is_refused(root, base_config):
    tensors = lora_tensors(base_config)
    name = tensor_name(0, "v_proj", "B")
    tensors[name] = np.zeros((base_config["hidden_size"], 4), np.float32)  # v_proj is kv-sized
    folder = write_adapter(root / "shape", tensors=tensors)
    kv = base_config["num_key_value_heads"] * base_config["head_dim"]
    assert f"'{name}' has shape [576, 4]; the base model's v_proj with r=4 needs [{kv}, 4]" in (
        refusal(folder, base_config, root))


def test_an_embedding_tensor_is_refused_as_resized_embeddings(root, base_config):
    tensors = lora_tensors(base_config)
    tensors["base_model.model.model.embed_tokens.weight"] = np.zeros((8, 576), np.float32)
    folder = write_adapter(root / "embed", tensors=tensors)
    assert "resized embeddings" in refusal(folder, base_config, root)
    tensors = lora_tensors(base_config)
    tensors["base_model.model.lm_head.weight"] = np.zeros((8, 576), np.float32)
    folder = write_adapter(root / "head", tensors=tensors)
    assert "resized embeddings or a trained lm_head" in refusal(folder, base_config, root)


def test_a_lora_a_without_its_b_is_refused(root, base_config):
    tensors = lora_tensors(base_config)
    del tensors[tensor_name(1, "q_proj", "B")]
    folder = write_adapter(root / "half", tensors=tensors)
    assert "layer 1's q_proj has no lora_B weight" in refusal(folder, base_config, root)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_value_that_is_not_finite_is_refused(root, base_config, bad):
    tensors = lora_tensors(base_config)
    name = tensor_name(1, "v_proj", "A")
    tensors[name][2, 7] = bad
    folder = write_adapter(root / "nan", tensors=tensors)
    assert f"tensor '{name}' holds a value that is not finite" in refusal(
        folder, base_config, root)


def test_a_tensor_range_beyond_the_file_is_refused(root, base_config):
    weights = safetensors_bytes(lora_tensors(base_config))
    folder = write_adapter(root / "cut", weights=weights[:-16])
    assert "beyond the end of the file" in refusal(folder, base_config, root)
    # A header that says more bytes than its shape holds.
    length = int.from_bytes(weights[:8], "little")
    header = json.loads(weights[8:8 + length])
    name = sorted(k for k in header if k != "__metadata__")[0]
    header[name]["data_offsets"][1] += 4
    text = json.dumps(header).encode()
    folder = write_adapter(root / "long", weights=struct.pack("<Q", len(text)) + text
                           + weights[8 + length:])
    assert f"tensor '{name}' has a data range of" in refusal(folder, base_config, root)


def test_an_unsupported_dtype_is_refused(root, base_config):
    f32 = lora_tensors(base_config)
    f64 = {n: ("F64", a.shape, a.astype("<f8").tobytes()) for n, a in f32.items()}
    folder = write_adapter(root / "f64", weights=raw_safetensors(f64))
    assert "has dtype 'F64'; only F32, F16 and BF16" in refusal(folder, base_config, root)


@pytest.mark.parametrize(("fields", "reason"), [
    ({"use_dora": True}, "DoRA (use_dora) is not supported"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save (['lm_head']) is not supported"),
    ({"target_modules": ["q_proj", "v_proj", "embed_tokens"]},
     "target_modules names embed_tokens; only q_proj"),
    ({"target_modules": ".*proj"}, "target_modules is a string ('.*proj'), which PEFT reads "
                                   "as a regex: not supported"),
    ({"peft_type": "IA3"}, "peft_type is 'IA3'; only LoRA"),
    ({"lora_alpha": 0}, "lora_alpha=0 is not a positive number"),
    ({"r": 0}, "r=0 is not an integer from 1 to 64"),
    ({"rank_pattern": {"q_proj": 8}}, "rank_pattern (per-module ranks or alphas)"),
    # settings that change what PEFT computes: served only while unset
    ({"layers_to_transform": [0]}, "layers_to_transform=[0]: not served"),
    ({"exclude_modules": ["q_proj"]}, "exclude_modules=['q_proj']: not served"),
    ({"layer_replication": [[0, 4], [2, 5]]}, "layer_replication=[[0, 4], [2, 5]]: not served"),
    ({"trainable_token_indices": [5, 6]}, "trainable_token_indices=[5, 6]: not served"),
    ({"lora_bias": True}, "lora_bias=True: not served"),
    ({"a_setting_of_a_later_peft": "on"}, "a_setting_of_a_later_peft='on': not served"),
    # a scale that overflows the activations
    ({"lora_alpha": 1e308}, "lora_alpha=1e+308 over r=4 scales the deltas by 2.5e+307, over 256"),
    ({"lora_alpha": 400, "r": 2, "use_rslora": True},
     "lora_alpha=400 over r=2 scales the deltas by 282.843, over 256"),
])
def test_a_config_the_engine_cannot_apply_is_refused(root, base_config, fields, reason):
    folder = write_adapter(root / "config", adapter_config(**fields),
                           tensors=lora_tensors(base_config))
    assert reason in refusal(folder, base_config, root)


def test_a_tensor_of_a_module_its_config_does_not_name_is_refused(root, base_config):
    folder = write_adapter(root / "more", adapter_config(modules=("q_proj",)),
                           tensors=lora_tensors(base_config))
    assert "adapts v_proj, which target_modules does not name" in refusal(
        folder, base_config, root)


def test_a_layer_past_the_base_models_is_refused(root, base_config):
    layers = base_config["num_hidden_layers"]
    folder = write_adapter(root / "deep", tensors=lora_tensors(base_config, layers=[layers]))
    assert f"is of layer {layers}; the base model has {layers} layers" in refusal(
        folder, base_config, root)


def test_files_over_the_limit_are_refused(root, base_config):
    folder = write_adapter(root / "heavy")
    assert "over the limit of 1000 (MAX_ADAPTER_BYTES)" in refusal(
        folder, base_config, root, max_bytes=1000)


def test_a_folder_outside_the_root_or_a_symlink_out_of_it_is_refused(root, tmp_path,
                                                                      base_config):
    outside = write_adapter(tmp_path / "outside")
    assert "is not under ADAPTER_ROOT" in refusal(outside, base_config, root)
    (root / "link").symlink_to(outside)  # a folder link inside the root, to outside it
    assert "is not under ADAPTER_ROOT" in refusal(root / "link", base_config, root)
    inside = write_adapter(root / "inside")
    os.remove(inside / "adapter_model.safetensors")
    (inside / "adapter_model.safetensors").symlink_to(outside / "adapter_model.safetensors")
    assert "adapter_model.safetensors is not under ADAPTER_ROOT" in refusal(
        inside, base_config, root)


def test_a_missing_file_is_refused(root, base_config):
    folder = write_adapter(root / "bare")
    os.remove(folder / "adapter_config.json")
    assert "the folder has no adapter_config.json" in refusal(folder, base_config, root)


@pytest.mark.parametrize("dtype", ["F32", "F16", "BF16"])
def test_all_finite_reads_the_bit_patterns_of_each_dtype(dtype):
    values = np.array([0.0, -0.0, 1.5, -2.25, 1e-30, 6e4, 3e38 if dtype != "F16" else 6e4],
                      np.float32)

    def encoded(array):
        if dtype == "F32":
            return array.astype("<f4").tobytes()
        if dtype == "F16":
            return array.astype("<f2").tobytes()
        return (array.astype(np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()

    assert all_finite(encoded(values), dtype)
    assert all_finite(b"", dtype)
    for bad in (math.nan, math.inf, -math.inf):
        for at in (0, 3, len(values) - 1):
            spoiled = values.copy()
            spoiled[at] = bad
            assert not all_finite(encoded(spoiled), dtype), (bad, at)


def test_a_config_as_peft_writes_it_with_every_field_at_its_default_is_valid(root, base_config):
    from peft import LoraConfig

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                        task_type="CAUSAL_LM").to_dict()
    config["peft_type"], config["target_modules"] = "LORA", ["q_proj", "v_proj"]
    folder = write_adapter(root / "peft", json.loads(json.dumps(config, default=str)),
                           tensors=lora_tensors(base_config))
    assert check(folder, base_config, root).rank == 4


def test_a_weight_that_would_overflow_the_activations_is_refused(root, base_config):
    tensors = lora_tensors(base_config)
    name = tensor_name(0, "q_proj", "B")
    tensors[name][3, 1] = 255.0  # below the bound: valid
    assert check(write_adapter(root / "ok", tensors=tensors), base_config, root).rank == 4
    tensors[name][3, 1] = -1e30
    assert (f"tensor '{name}' holds a value of 256 or more in magnitude"
            in refusal(write_adapter(root / "big", tensors=tensors), base_config, root))


@pytest.mark.parametrize("dtype", ["F32", "F16", "BF16"])
def test_all_within_reads_the_magnitude_from_the_bit_patterns(dtype):
    def encoded(values):
        array = np.array(values, np.float32)
        if dtype == "F32":
            return array.astype("<f4").tobytes()
        if dtype == "F16":
            return array.astype("<f2").tobytes()
        return (array.view(np.uint32) >> 16).astype("<u2").tobytes()

    inside = [0.0, -0.0, 1e-30, 0.5, -3.0, 128.0, 255.0, -255.0]
    assert all_within(encoded(inside), dtype) and all_within(b"", dtype)
    for bad in (256.0, -256.0, 300.0, 6e4, math.inf, math.nan):
        for at in (0, 4, len(inside) - 1):
            spoiled = list(inside)
            spoiled[at] = bad
            assert not all_within(encoded(spoiled), dtype), (bad, at)
