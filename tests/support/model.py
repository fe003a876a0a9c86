"""Fixtures of the real-model tests: one loaded backend per session, and real-text prompts
(the tests that use them are marked ``model``)."""

from __future__ import annotations

import pytest
import torch

from inference.engine.backends.hf import TransformersBackend
from inference.engine.model_store import resolve_model_path

# Varied English prose, so the model's next-token choices are mostly confident (unlike random
# token ids, whose logits are flat and full of near-ties).
PASSAGES = [
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a can of "
    "oil and a cloth to polish the great lens. Ships passing the rocky headland relied on the "
    "beam to find the narrow channel into the harbour.",
    "Photosynthesis converts light energy into chemical energy. Plants absorb carbon dioxide "
    "through tiny pores in their leaves and water through their roots, and with sunlight they "
    "produce glucose and release oxygen into the air.",
    "In 1869 the first transcontinental railroad in the United States was completed when the "
    "Central Pacific and Union Pacific lines met at Promontory Summit in Utah, cutting the "
    "journey across the country from months to about a week.",
    "To bake a simple loaf of bread, mix flour, water, yeast and salt, knead the dough until it "
    "is smooth, let it rise for an hour, shape it, let it rise again and bake it in a hot oven "
    "until the crust is golden brown.",
    "The Python programming language emphasises readability. Its standard library includes "
    "modules for working with files, dates, regular expressions, networking and data formats "
    "such as JSON and CSV.",
]


@pytest.fixture(scope="session")
def backend() -> TransformersBackend:
    """The default model on CPU in fp32 (the KV pool is re-allocated by each engine)."""
    torch.manual_seed(0)
    return TransformersBackend.from_pretrained(resolve_model_path(""), device="cpu",
                                               dtype="float32")


@pytest.fixture(scope="session")
def corpus_ids(backend: TransformersBackend) -> list[int]:
    """About 1,200 token ids of real text, to slice prompts of exact lengths from."""
    text = " ".join(f"Chapter {i + 1}. {p}" for i, p in enumerate(PASSAGES * 5))
    ids = backend.tokenizer.encode(text)
    assert len(ids) > 1100
    return ids


@pytest.fixture(scope="session")
def chat_prompt(backend: TransformersBackend) -> list[int]:
    """A short chat prompt rendered with the model's own template."""
    return backend.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name three uses of copper and explain one of them."}])
