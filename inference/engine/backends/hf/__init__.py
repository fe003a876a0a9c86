"""A real model behind the scheduler: a Hugging Face causal LM run over a paged KV block pool.

The weights come from ``transformers``, the tokenizer from :mod:`inference.tokenization` (the one
the web tier counts tokens with); the forward pass is our own (in the manner
of nano-vllm), over the model's modules: embedding, per layer an RMSNorm, fused q/k/v projection,
rotary embedding, paged attention, output projection, RMSNorm, gated MLP; final norm and LM head.

Modules: :mod:`.loading` (device, dtype, config and
weights, fused per-layer weights), :mod:`.batch` (a pass's index tensors and attention groups),
:mod:`.attention` (native paged and gathered attention), :mod:`.forward` (the forward pass) and
:mod:`.backend` (:class:`TransformersBackend`: KV pool, prefill and decode). How paged attention
reads the pool is told in :mod:`.attention`, which architectures are supported in :mod:`.loading`.
"""

from inference.engine.backends.hf.backend import TransformersBackend
from inference.engine.backends.hf.loading import (
    SUPPORTED_MODEL_TYPES,
    UNSUPPORTED_ROPE_TYPES,
    resolve_device,
    resolve_dtype,
)

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "UNSUPPORTED_ROPE_TYPES",
    "TransformersBackend",
    "resolve_device",
    "resolve_dtype",
]
