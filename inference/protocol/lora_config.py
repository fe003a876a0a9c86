"""What of a PEFT LoRA adapter the platform serves: the ``adapter_config.json`` fields and the
bounds on its numbers, shared by the adapter's check before it is served
(``tenants.adapter_check``) and the engine's load of it (:mod:`inference.engine.lora`), so that a
config edited after its check is refused at load for the same reasons.

A field of the config is one of

* :data:`CHECKED`: the fields whose values are read and checked (``r``, ``lora_alpha``,
  ``target_modules``, ...);
* :data:`INERT`: the fields that do not change what a loaded adapter computes (its origin, how
  it was initialised or trained, the version of PEFT that wrote it), taken with any value;
* anything else: a PEFT setting that changes what the adapter computes (``layers_to_transform``,
  ``exclude_modules``, ``layer_replication``, ``trainable_token_indices``,
  ``target_parameters``, ``lora_bias``, ...), or one of a later PEFT. Served only while unset:
  ``null``, ``false``, ``0``, an empty string, list or object, as PEFT writes the fields it does
  not use (:func:`unserved_fields`).

The bounds keep every product of a pass finite: an adapter whose weights pass them cannot
overflow bf16 or fp32 into an infinity (and from there a NaN logit) on a model's activations.
A weight or a scale beyond them is refused, not clipped.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

CHECKED = frozenset({"peft_type", "r", "lora_alpha", "target_modules", "use_rslora", "bias",
                     "fan_in_fan_out", "modules_to_save", "use_dora", "rank_pattern",
                     "alpha_pattern"})
INERT = frozenset({"task_type", "base_model_name_or_path", "revision", "inference_mode",
                   "init_lora_weights", "lora_dropout", "peft_version", "auto_mapping",
                   "layers_pattern", "megatron_core", "qalora_group_size", "loftq_config",
                   "eva_config", "corda_config", "lora_ga_config", "runtime_config"})
# Every A and B weight as stored: |w| < 2 ** MAX_WEIGHT_EXPONENT.
MAX_WEIGHT_EXPONENT = 8
MAX_WEIGHT = float(2 ** MAX_WEIGHT_EXPONENT)
# The deltas' scale: lora_alpha / r (lora_alpha / sqrt(r) with use_rslora) at most this.
MAX_SCALE = 256.0


def unserved_fields(config: Mapping[str, Any]) -> list[str]:
    """The fields of ``config`` (a parsed ``adapter_config.json``) that are neither
    :data:`CHECKED` nor :data:`INERT` and are set (anything but ``None``, ``False``, ``0``,
    ``""``, ``[]`` or ``{}``), sorted."""
    return sorted(name for name, value in config.items()
                  if name not in CHECKED and name not in INERT and value not in (None, False)
                  and not (isinstance(value, str | list | dict | int | float) and not value))


def scale(config: Mapping[str, Any], rank: int) -> float:
    """The deltas' scale: ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with ``use_rslora``
    (``lora_alpha`` a positive finite number: checked by the caller)."""
    alpha = float(config.get("lora_alpha", rank))
    return alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
