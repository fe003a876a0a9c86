"""The greedy reference of ``peft``'s merged model through plain ``transformers`` (the adapters
themselves: :mod:`benchmarks.harness.adapters`)."""

from __future__ import annotations

import torch

from tests.support.greedy import Run


@torch.inference_mode()
def greedy_reference(model: torch.nn.Module, prompt: list[int], max_tokens: int) -> Run:
    """``max_tokens`` greedy tokens of ``model`` after ``prompt`` (no end-of-sequence stop), with
    the top-2 logit gap behind each (the tie rule of :mod:`tests.support.greedy`)."""
    ids = torch.tensor([prompt])
    out = model(ids, use_cache=True)
    past, tokens, gaps = out.past_key_values, [], []
    logits = out.logits[0, -1].float()
    for _ in range(max_tokens):
        top = torch.topk(logits, 2).values
        gaps.append(float(top[0] - top[1]))
        token = int(logits.argmax())
        tokens.append(token)
        out = model(torch.tensor([[token]]), past_key_values=past, use_cache=True)
        past, logits = out.past_key_values, out.logits[0, -1].float()
    return Run(tokens, gaps, "", None)  # type: ignore[arg-type]
