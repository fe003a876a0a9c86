"""Log-probabilities on the real model in fp32 equal a direct transformers forward pass over the
same tokens: prompt positions (across prefill chunks, with a cached prefix on offer) and
generated tokens, while rows that ask nothing share the passes."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from inference.engine.backends.hf import TransformersBackend
from inference.engine.config import EngineConfig
from inference.engine.llm_engine import LLMEngine
from inference.engine.request import Event, FinalEvent, SamplingParams, TokenEvent

pytestmark = pytest.mark.model

TOLERANCE = 1e-3


def direct_logprobs(backend: TransformersBackend, ids: list[int]) -> torch.Tensor:
    """``[len(ids), vocab]`` fp32 log-softmax of transformers' own forward pass: row ``p``
    predicts token ``p + 1``."""
    with torch.inference_mode():
        logits = backend.hf_model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def check(entry, want: torch.Tensor, token: int, top_k: int, where: str) -> None:
    """``entry`` (one position) against the direct pass's ``want [vocab]``."""
    assert entry.token_id == token, where
    assert abs(entry.logprob - want[token].item()) < TOLERANCE, where
    values = [t.logprob for t in entry.top]
    assert len(values) == top_k and values == sorted(values, reverse=True), where
    # The top list's values are the direct pass's best values (its ids may differ only where
    # two tokens' values are within the tolerance), and each is its token's value.
    best = want.topk(top_k).values.tolist()
    assert max(abs(a - b) for a, b in zip(values, best, strict=True)) < TOLERANCE, where
    for t in entry.top:
        assert abs(t.logprob - want[t.token_id].item()) < TOLERANCE, where


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]
        ) -> dict[str, list[Event]]:
    events: dict[str, list[Event]] = defaultdict(list)
    for rid, (prompt, params) in requests.items():
        engine.submit(prompt_token_ids=prompt, sampling=params, request_id=rid)
    for _ in range(1000):
        if not engine.has_work():
            break
        for event in engine.step():
            events[event.request_id].append(event)
    assert not engine.has_work()
    return events


def test_logprobs_equal_a_direct_transformers_forward_pass(backend, corpus_ids, chat_prompt):
    # Mixed passes of 32 prompt tokens at most (no ITL target: no start-up calibration).
    engine = LLMEngine(EngineConfig(kv_num_blocks=128, kv_block_size=16, max_batch_size=8,
                                    prefill_chunk_size=32, target_itl_ms=0, max_pending=100),
                       backend)
    scored = corpus_ids[:45]
    # Its full blocks are cached first: the request asking for prompt logprobs must not use them.
    warm = run(engine, {"warm": (scored, SamplingParams(max_tokens=1))})
    assert isinstance(warm["warm"][-1], FinalEvent)
    asks = {
        "scored": (scored, SamplingParams(max_tokens=5, logprobs=5, prompt_logprobs=5)),
        "top20": (corpus_ids[300:330], SamplingParams(max_tokens=5, logprobs=20)),
        "plain": (chat_prompt, SamplingParams(max_tokens=5)),
    }
    events = run(engine, asks)
    assert events["scored"][-1].usage.cached_prompt_tokens == 0
    assert all(e.logprobs is None for e in events["plain"] if isinstance(e, TokenEvent))
    for rid in ("scored", "top20"):
        prompt, params = asks[rid]
        tokens = [e for e in events[rid] if isinstance(e, TokenEvent)]
        output = [e.token_id for e in tokens]
        assert len(output) == 5, rid
        want = direct_logprobs(backend, prompt + output)
        # Each token's entry comes with its text (a split character's: with its last byte).
        generated = [x for e in events[rid] if e.logprobs for x in e.logprobs]
        assert len(generated) == len(output), rid
        for i, entry in enumerate(generated):
            check(entry, want[len(prompt) - 1 + i], output[i], params.logprobs,
                  f"{rid}: generated token {i}")
        entries = tokens[0].prompt_logprobs
        if params.prompt_logprobs is None:
            assert entries is None
            continue
        assert [e.token_id for e in entries] == prompt and entries[0].logprob is None
        for p in range(1, len(prompt)):
            check(entries[p], want[p - 1], prompt[p], params.prompt_logprobs,
                  f"{rid}: prompt token {p}")
        # Each token's bytes, joined, are the prompt's text.
        joined = b"".join(bytes(e.utf8_bytes()) for e in entries).decode("utf-8")
        assert joined == backend.tokenizer.decode(prompt, skip_special_tokens=False)
