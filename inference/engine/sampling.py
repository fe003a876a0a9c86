"""Token sampling per request: greedy, temperature, top-k, top-p, seeds, min_tokens.

Each sampled request owns a ``torch.Generator`` and draws exactly one sample per generated
token, so a seeded request's output does not depend on which other requests share its batch.

A row's own numbers can only fail that row: :func:`sample` returns an :class:`ErrorInfo` in
place of a token for a row whose logits are not usable (NaN, +inf, or no token left with a
finite logit) or whose draw failed, and goes on with the other rows. Every valid
:class:`SamplingParams` gives a valid token: a temperature below
:data:`inference.engine.request.SAMPLING_EPS` is greedy, the logits are shifted by the row's maximum
before dividing by the temperature (so a tiny temperature cannot overflow to inf/NaN), a
temperature beyond float32's range acts as float32's largest value (the uniform limit), and
top-p always keeps the most likely token (a tiny ``top_p`` rounds to 0 in float32).

A constrained row (structured outputs) has its logits masked to the tokens its grammar allows
before the greedy pick or the draw (:func:`_apply_grammars`); the other rows are untouched.

A row that asked for ``logprobs`` gets its token's entry from the raw logits, before the
temperature, top-k, top-p, the ``min_tokens`` EOS mask and the grammar's mask (vLLM's default,
``logprobs_mode=raw_logprobs``) (:func:`inference.engine.logprobs.record_sampled`).
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Sequence

import torch

from inference.engine.logprobs import record_sampled
from inference.engine.request import ErrorCode, ErrorInfo, Request

log = logging.getLogger(__name__)

# The largest temperature applied as given; a larger one is float32's ``inf`` once in a tensor,
# and ``-inf / inf`` (a masked logit) is NaN.
MAX_TEMPERATURE = float(torch.finfo(torch.float32).max)


# torch's CPU generator (MT19937) keeps only the low 32 bits of a seed: 5 and 2**32 + 5 would
# draw alike. A seed in [0, 2**32) is used as is; any other is hashed to 32 bits, so that seeds
# spread over the whole range a request may give (SEED_RANGE) do not repeat one another's draws.
GENERATOR_SEEDS = 2**32


def generator_seed(seed: int) -> int:
    """The seed given to ``torch.Generator.manual_seed`` for a request's ``seed`` (see
    :data:`GENERATOR_SEEDS`)."""
    if 0 <= seed < GENERATOR_SEEDS:
        return seed
    digest = hashlib.sha256(f"seed:{seed}".encode()).digest()
    return int.from_bytes(digest[:4], "big")


def _generator_for(request: Request) -> torch.Generator:
    if request.sampler_state is None:
        gen = torch.Generator(device="cpu")
        if request.sampling.seed is not None:
            gen.manual_seed(generator_seed(request.sampling.seed))
        else:
            gen.seed()
        request.sampler_state = gen
    return request.sampler_state


def sample(logits: torch.Tensor, requests: Sequence[Request],
           eos_token_ids: frozenset[int]) -> list[int | ErrorInfo]:
    """Pick the next token of each row; a row that cannot be sampled gets its error instead.

    The greedy tokens come from one batched ``argmax``; the per-row check reads the logit it
    picked (argmax propagates NaN, so that value is finite exactly when the row has no NaN, no
    +inf, and at least one token not masked with -inf). Sampled rows are scaled and normalised
    together and drawn one by one, each with its own generator.

    Args:
        logits: ``[len(requests), vocab]`` next-token logits (any float dtype, any device);
            ``-inf`` marks a token that may not be chosen.
        requests: the rows, in the same order; their sampling params and output so far are read.
        eos_token_ids: masked out for rows that have fewer than ``min_tokens`` outputs.

    Returns:
        One entry per row: its token id, or an :class:`ErrorInfo` (code ``engine_error``, the
        numbers at fault in ``details``) for that row alone. Never raises for one row's values.
        A row that asked for ``logprobs`` keeps its token's entry (``request.logprobs``).
    """
    logits = raw = logits.float().cpu()
    if eos_token_ids:
        early = [i for i, r in enumerate(requests)
                 if len(r.output_token_ids) < r.sampling.min_tokens]
        if early:
            logits = logits.clone()
            rows = torch.tensor(early).unsqueeze(1)
            logits[rows, torch.tensor(sorted(eos_token_ids))] = float("-inf")
    grammar_errors: dict[int, ErrorInfo] = {}
    if any(r.grammar is not None for r in requests):
        logits = _apply_grammars(logits.clone() if logits is raw else logits, requests,
                                 grammar_errors)
    best = logits.argmax(dim=-1)  # greedy rows are done in this one op
    row_max = logits.gather(1, best.unsqueeze(1))  # [batch, 1]
    out: list[int | ErrorInfo] = list(best.tolist())
    for i, value in enumerate(row_max.flatten().tolist()):
        if i in grammar_errors:
            out[i] = grammar_errors[i]
        elif not math.isfinite(value):
            out[i] = _unusable_logits(requests[i], value)
    sampled = [i for i, r in enumerate(requests)
               if not r.sampling.greedy and isinstance(out[i], int)]
    if sampled:
        _sample_rows(logits, row_max, requests, sampled, out)
    if any(r.logprobs is not None for r in requests):
        record_sampled(raw, requests, out)
    return out


def _apply_grammars(logits: torch.Tensor, requests: Sequence[Request],
                    errors: dict[int, ErrorInfo]) -> torch.Tensor:
    """Mask each constrained row of ``logits`` (``[batch, vocab]``, changed in place) to the
    tokens its grammar allows (:meth:`inference.engine.structured.RowGrammar.allowed`); a row
    whose grammar failed or allows nothing gets its error in ``errors`` instead."""
    width = logits.shape[1]
    for i, request in enumerate(requests):
        if request.grammar is None:
            continue
        allowed = request.grammar.allowed()
        if isinstance(allowed, ErrorInfo):
            errors[i] = allowed
            continue
        n = min(width, allowed.shape[0])
        logits[i, :n].masked_fill_(~allowed[:n], float("-inf"))
        if width > n:
            logits[i, n:] = float("-inf")
    return logits


def _sample_rows(logits: torch.Tensor, row_max: torch.Tensor, requests: Sequence[Request],
                 rows: list[int], out: list[int | ErrorInfo]) -> None:
    """Draw the sampled ``rows`` (indices into ``logits [batch, vocab]``) into ``out``.

    ``row_max``: ``[batch, 1]``, each row's (finite) largest logit.

    Each row's logits are shifted so that its maximum is exactly 0 before dividing by its
    temperature: every scaled value is then <= 0 or -inf, never +inf or NaN, and the top token
    keeps probability >= 1/vocab, so the draw always has mass to choose from.
    """
    index = torch.tensor(rows)
    temps = torch.tensor([[min(requests[i].sampling.temperature, MAX_TEMPERATURE)]
                          for i in rows])
    scaled = (logits[index] - row_max[index]).div_(temps)
    vocab = scaled.shape[-1]
    for j, i in enumerate(rows):
        top_k = requests[i].sampling.top_k
        if 0 < top_k < vocab:  # the kth value is <= 0 = the maximum, so the top token stays
            kth = torch.topk(scaled[j], top_k).values[-1]
            scaled[j].masked_fill_(scaled[j] < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    for j, i in enumerate(rows):
        request = requests[i]
        row = probs[j]
        if request.sampling.top_p < 1.0:
            row = _top_p(row, request.sampling.top_p)
        try:
            out[i] = int(torch.multinomial(row, 1, generator=_generator_for(request)))
        except Exception:  # one row's draw must not end the batch
            log.exception("sampling failed for %s", request.request_id)
            out[i] = _row_error(request, "sampling_failed",
                                "could not sample the next token for this request")


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero all but the smallest set of most likely tokens whose mass reaches ``top_p``.

    ``probs``: ``[vocab]``, normalised. The most likely token always stays, whatever ``top_p``
    (a value below float32's smallest number compares as 0).
    """
    sorted_probs, order = torch.sort(probs, descending=True)
    cumulative = torch.cumsum(sorted_probs, dim=-1)
    drop = cumulative - sorted_probs >= top_p
    drop[0] = False
    sorted_probs.masked_fill_(drop, 0.0)
    return torch.zeros_like(probs).scatter_(0, order, sorted_probs)


def _unusable_logits(request: Request, max_logit: float) -> ErrorInfo:
    if math.isnan(max_logit):
        reason, what = "nan_logits", "were not numbers (NaN)"
    elif max_logit > 0:
        reason, what = "infinite_logits", "were infinite"
    else:
        reason, what = "no_allowed_token", "were all -inf: no token could be chosen"
    log.warning("request %s: next-token logits %s (max %s)", request.request_id, what, max_logit)
    return _row_error(request, reason,
                      f"the model's next-token scores for this request {what}",
                      max_logit=str(max_logit))


def _row_error(request: Request, reason: str, message: str, **numbers: object) -> ErrorInfo:
    params = request.sampling
    return ErrorInfo(
        code=ErrorCode.ENGINE_ERROR, message=f"{message}; only this request was ended",
        retryable=True,
        details={"phase": "sampling", "reason": reason, **numbers,
                 "temperature": params.temperature, "top_p": params.top_p,
                 "top_k": params.top_k, "min_tokens": params.min_tokens,
                 "output_tokens": len(request.output_token_ids)})
