"""Hostile sampling values on the real model: valid tokens, greedy where the rule says so.

A temperature of 1e-40 divides the model's logits (tens) into float32 infinities, and a top_p of
1e-300 is 0 in float32: both used to fail the whole batch. They must give the greedy tokens
(temperature below ``SAMPLING_EPS``; top-p keeps at least the top token), a huge temperature must
sample valid tokens, and a neighbour in the same batch must get its own greedy tokens.
"""

from __future__ import annotations

import dataclasses

import pytest

from inference.engine.request import FinalEvent, FinishReason, SamplingParams, TokenEvent
from tests.support.greedy import Run, assert_same_greedy, make_engine, run_alone

pytestmark = [pytest.mark.model, pytest.mark.slow]

MAX_TOKENS = 12
HOSTILE = {
    "tiny_temperature": SamplingParams(max_tokens=MAX_TOKENS, temperature=1e-40),
    "tiny_top_p": SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, top_p=1e-300, seed=1),
    "both": SamplingParams(max_tokens=MAX_TOKENS, temperature=1e-40, top_p=1e-300),
    "one_token": SamplingParams(max_tokens=1, temperature=1e-40, top_p=1e-300),
}


def run_together(backend, requests: dict[str, tuple[list[int], SamplingParams]]
                 ) -> dict[str, tuple[list[int], FinalEvent]]:
    """Submit every request at once, tick until idle; tokens and final event of each."""
    engine, _ = make_engine(backend)
    for rid, (prompt, sampling) in requests.items():
        engine.submit(prompt_token_ids=prompt, sampling=sampling, request_id=rid)
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    finals: dict[str, FinalEvent] = {}
    for _ in range(1000):
        if not engine.has_work():
            break
        for event in engine.step():
            if isinstance(event, TokenEvent):
                tokens[event.request_id].append(event.token_id)
            else:
                finals[event.request_id] = event
    assert not engine.has_work()
    return {rid: (tokens[rid], finals[rid]) for rid in requests}


def first(run: Run, n: int) -> Run:
    return dataclasses.replace(run, tokens=run.tokens[:n], gaps=run.gaps[:n])


def test_tiny_temperature_and_top_p_give_the_greedy_tokens_beside_a_neighbour(
        backend, chat_prompt, corpus_ids):
    neighbour_prompt = corpus_ids[:40]
    greedy = run_alone(backend, chat_prompt, SamplingParams(max_tokens=MAX_TOKENS))
    neighbour = run_alone(backend, neighbour_prompt, SamplingParams(max_tokens=MAX_TOKENS))
    requests = {rid: (chat_prompt, sampling) for rid, sampling in HOSTILE.items()}
    requests["huge_temperature"] = (chat_prompt, SamplingParams(
        max_tokens=MAX_TOKENS, temperature=1e300, top_k=10**9, seed=2))
    requests["neighbour"] = (neighbour_prompt, SamplingParams(max_tokens=MAX_TOKENS))
    got = run_together(backend, requests)
    for rid, (tokens, final) in got.items():
        assert final.finish_reason in (FinishReason.LENGTH, FinishReason.STOP), (rid, final)
        assert tokens and all(0 <= t < backend.vocab_size for t in tokens), rid
    for rid, sampling in HOSTILE.items():
        assert_same_greedy(first(greedy, sampling.max_tokens), got[rid][0], rid)
    assert_same_greedy(neighbour, got["neighbour"][0], "neighbour")
