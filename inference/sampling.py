"""Token sampling per request: greedy, temperature, top-k, top-p, seeds, min_tokens.

Each sampled request owns a ``torch.Generator`` and draws exactly one sample per generated
token, so a seeded request's output does not depend on which other requests share its batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from inference.request import Request


def _generator_for(request: Request) -> torch.Generator:
    if request.sampler_state is None:
        gen = torch.Generator(device="cpu")
        if request.sampling.seed is not None:
            gen.manual_seed(request.sampling.seed)
        else:
            gen.seed()
        request.sampler_state = gen
    return request.sampler_state


def sample(logits: torch.Tensor, requests: Sequence[Request],
           eos_token_ids: frozenset[int]) -> list[int]:
    """Pick the next token of each row.

    Args:
        logits: ``[len(requests), vocab]`` next-token logits (any float dtype, any device).
        requests: the rows, in the same order; their sampling params and output so far are read.
        eos_token_ids: masked out for rows that have fewer than ``min_tokens`` outputs.

    Returns:
        One token id per row.
    """
    logits = logits.float().cpu()
    if eos_token_ids:
        early = [i for i, r in enumerate(requests)
                 if len(r.output_token_ids) < r.sampling.min_tokens]
        if early:
            logits = logits.clone()
            rows = torch.tensor(early).unsqueeze(1)
            logits[rows, torch.tensor(sorted(eos_token_ids))] = float("-inf")
    out = logits.argmax(dim=-1).tolist()  # greedy rows are done in one op
    for i, request in enumerate(requests):
        params = request.sampling
        if params.greedy:
            continue
        row = logits[i] / params.temperature
        if 0 < params.top_k < row.numel():
            kth = torch.topk(row, params.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if params.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            cumulative = torch.cumsum(sorted_probs, dim=-1)
            # Keep the smallest set whose mass reaches top_p (the first token always stays).
            drop = cumulative - sorted_probs >= params.top_p
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        out[i] = int(torch.multinomial(probs, 1, generator=_generator_for(request)))
    return out
