"""LoRA adapters made with ``peft`` on a local model (never downloaded): for the LoRA benchmark
and the tests (``tests/engine/test_model_lora.py``), and ``peft``'s merged model as their
reference."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from inference.engine.request import AdapterSpec

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(model_folder: Path, out: Path, *, rank: int, seed: int,
                 targets: list[str] | None = None, alpha: float | None = None,
                 name: str = "") -> AdapterSpec:
    """Save a PEFT LoRA adapter of ``rank`` over the model in ``model_folder`` to ``out``, its
    weights non-zero (``init_lora_weights=False``, then B drawn from ``seed``) so that it changes
    the model's answers; returns its :class:`AdapterSpec`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else 2 * rank,
                        target_modules=targets or TARGETS, init_lora_weights=False,
                        lora_dropout=0.0, task_type="CAUSAL_LM")
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name_, param in model.named_parameters():
            if "lora_B" in name_:
                param.normal_(0.0, 0.1)
    model.save_pretrained(out, safe_serialization=True)
    weights = out / "adapter_model.safetensors"
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()
    return AdapterSpec(name=name or f"base:{out.name}", path=str(out), digest=digest, rank=rank)


def merged_model(model_folder: Path, adapter: Path | None) -> torch.nn.Module:
    """The base model in fp32 with ``adapter`` merged into its weights (``peft``'s
    ``merge_and_unload``), or the bare model."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.float32)
    if adapter is None:
        return base.eval()
    return PeftModel.from_pretrained(base, adapter).merge_and_unload().eval()
