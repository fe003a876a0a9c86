"""Log-probabilities on the reference backend: every prefill mode gives the values of a direct
pass over the same tokens; prompt logprobs cover every position, prefix hit or not; rows that do
not ask cost nothing."""

from __future__ import annotations

import pydantic
import pytest
import torch

import inference.engine.logprobs
from inference.engine.backends.reference import ByteTokenizer, ReferenceBackend
from inference.engine.request import FinalEvent, SamplingParams, TokenEvent
from inference.protocol.events import LOGPROB_FLOOR, decode_event, encode_event
from inference.protocol.messages import Sampling
from tests.support.engine import EventLog, make_engine, run_until_idle

PROMPT = list(b"The lighthouse keeper climbed the spiral stairs at dusk.")


def expected(backend: ReferenceBackend, tokens: list[int], position: int) -> torch.Tensor:
    """``[vocab]`` log-probabilities of the token at ``position`` (a direct pass, in fp32)."""
    return torch.log_softmax(backend.logits_after(tokens[:position]).float(), dim=-1)


def check_entry(entry, want: torch.Tensor, token: int, top_k: int) -> None:
    assert entry.token_id == token
    assert entry.logprob == pytest.approx(max(want[token].item(), LOGPROB_FLOOR), abs=1e-6)
    values = [t.logprob for t in entry.top]
    assert len(values) == top_k and values == sorted(values, reverse=True)
    assert values == pytest.approx(want.topk(top_k).values.tolist(), abs=1e-6)
    for top in entry.top:
        assert top.logprob == pytest.approx(want[top.token_id].item(), abs=1e-6)


@pytest.mark.parametrize("mode", ["mixed_batch", "chunked", "monolithic"])
def test_values_equal_a_direct_pass_in_every_prefill_mode(mode):
    backend = ReferenceBackend()
    engine = make_engine(backend, prefill_mode=mode, prefill_chunk_size=8)
    # Sampled with a temperature, top-k and top-p: the values are still the raw distribution's.
    asks = {"sampled": SamplingParams(max_tokens=6, temperature=0.8, top_k=3, top_p=0.9, seed=5,
                                      logprobs=4, prompt_logprobs=2),
            "greedy": SamplingParams(max_tokens=6, logprobs=0, prompt_logprobs=20),
            "plain": SamplingParams(max_tokens=6)}
    prompts = {"sampled": PROMPT, "greedy": PROMPT[5:], "plain": PROMPT[9:]}
    for rid, params in asks.items():
        engine.submit(prompt_token_ids=prompts[rid], sampling=params, request_id=rid)
    log = EventLog()
    run_until_idle(engine, log)
    for rid in ("sampled", "greedy"):
        params, prompt = asks[rid], prompts[rid]
        events = log.by_request[rid]
        tokens = [e for e in events if isinstance(e, TokenEvent)]
        assert len(tokens) == 6
        first = tokens[0].prompt_logprobs
        assert first is not None and [e.token_id for e in first] == prompt
        assert first[0].logprob is None and first[0].top == ()  # nothing predicts it
        for p in range(1, len(prompt)):
            check_entry(first[p], expected(backend, prompt, p), prompt[p],
                        params.prompt_logprobs)
        assert all(e.prompt_logprobs is None for e in events[1:]), "sent once"
        sequence = prompt + [e.token_id for e in tokens]
        entries = [x for e in events if e.logprobs for x in e.logprobs]
        assert len(entries) == len(tokens)  # each token's, with its text
        for i, (event, entry) in enumerate(zip(tokens, entries, strict=True)):
            check_entry(entry, expected(backend, sequence, len(prompt) + i),
                        event.token_id, params.logprobs)
    plain = log.by_request["plain"]
    assert all(e.logprobs is None and e.prompt_logprobs is None
               for e in plain if isinstance(e, TokenEvent))
    assert log.final("plain").prompt_logprobs is None


class FlagLog(ReferenceBackend):
    """Records, per pass, each chunk's ``all_logits`` and the rows of logits returned."""

    def __init__(self) -> None:
        super().__init__()
        self.chunks: list[tuple[str, bool, int]] = []  # (row, all_logits, tokens)
        self.rows_returned: list[tuple[int, int]] = []  # (rows, chunks + decode rows)

    def prefill_and_decode(self, chunks, rows):
        self.chunks += [(c.row_id, c.all_logits, len(c.token_ids)) for c in chunks]
        logits = super().prefill_and_decode(chunks, rows)
        self.rows_returned.append((logits.shape[0], len(chunks) + len(rows)))
        return logits


def test_rows_that_do_not_ask_cost_nothing(monkeypatch):
    computed = []
    real = inference.engine.logprobs._positions
    monkeypatch.setattr(inference.engine.logprobs, "_positions",
                        lambda *args: computed.append(1) or real(*args))
    backend = FlagLog()
    engine = make_engine(backend)
    for i in range(3):
        engine.submit(prompt_token_ids=PROMPT[i:], sampling=SamplingParams(max_tokens=4))
    run_until_idle(engine)
    assert backend.chunks and not any(asks for _, asks, _ in backend.chunks)
    assert all(got == usual for got, usual in backend.rows_returned)
    assert computed == [], "a log-softmax ran for rows that asked for nothing"
    # One row asking in the same passes: only its chunks ask for every position's logits.
    backend.chunks.clear()
    engine.submit(prompt_token_ids=PROMPT[1:], sampling=SamplingParams(max_tokens=4),
                  request_id="plain")
    engine.submit(prompt_token_ids=PROMPT, request_id="asks",
                  sampling=SamplingParams(max_tokens=4, prompt_logprobs=1))
    run_until_idle(engine)
    asked = {(row, asks) for row, asks, _ in backend.chunks}
    assert asked == {("plain", False), ("asks", True)}
    assert sum(n for row, _, n in backend.chunks if row == "asks") == len(PROMPT)


def test_prompt_logprobs_compute_every_position_even_with_a_cached_prefix():
    backend = ReferenceBackend()
    engine = make_engine(backend)
    log = EventLog()
    engine.submit(prompt_token_ids=PROMPT, sampling=SamplingParams(max_tokens=2),
                  request_id="warm")
    run_until_idle(engine, log)
    assert log.final("warm").usage.cached_prompt_tokens == 0
    engine.submit(prompt_token_ids=PROMPT, request_id="scored",
                  sampling=SamplingParams(max_tokens=2, prompt_logprobs=1))
    run_until_idle(engine, log)
    assert log.final("scored").usage.cached_prompt_tokens == 0
    entries = log.by_request["scored"][0].prompt_logprobs
    assert len(entries) == len(PROMPT)
    for p in range(1, len(PROMPT)):
        check_entry(entries[p], expected(backend, PROMPT, p), PROMPT[p], 1)
    # Its blocks were published: a later request without prompt logprobs gets a hit.
    engine.submit(prompt_token_ids=PROMPT, sampling=SamplingParams(max_tokens=2),
                  request_id="after")
    run_until_idle(engine, log)
    assert log.final("after").usage.cached_prompt_tokens > 0


def test_prompt_logprobs_ride_on_the_final_event_when_no_token_is_streamed():
    backend = ReferenceBackend(eos_every=1)  # the first token is EOS: nothing is streamed
    engine = make_engine(backend)
    log = EventLog()
    engine.submit(prompt_token_ids=PROMPT, request_id="r",
                  sampling=SamplingParams(max_tokens=4, logprobs=2, prompt_logprobs=2))
    run_until_idle(engine, log)
    [final] = log.by_request["r"]
    assert isinstance(final, FinalEvent) and final.finish_reason == "stop"
    assert [e.token_id for e in final.prompt_logprobs] == PROMPT
    check_entry(final.prompt_logprobs[-1], expected(backend, PROMPT, len(PROMPT) - 1),
                PROMPT[-1], 2)


def test_ruled_out_tokens_and_split_characters_travel_as_json():
    backend = ReferenceBackend()
    engine = make_engine(backend)
    log = EventLog()
    # EOS (logit -inf for this backend) inside the prompt, and "é" split over two byte tokens.
    prompt = [*b"caf", *"é".encode(), ByteTokenizer.eos_token_id, *b"ok"]
    engine.submit(prompt_token_ids=prompt, request_id="r",
                  sampling=SamplingParams(max_tokens=2, prompt_logprobs=0))
    run_until_idle(engine, log)
    event = log.by_request["r"][0]
    assert decode_event(encode_event(event)) == event
    entries = event.prompt_logprobs
    assert entries[5].logprob == LOGPROB_FLOOR and entries[5].token == "<eos>"
    assert entries[3].token == "bytes:\\xc3" and entries[3].utf8_bytes() == [0xC3]
    assert entries[4].token == "bytes:\\xa9" and entries[4].utf8_bytes() == [0xA9]
    assert entries[6].token == "o" and entries[6].raw_bytes is None


def test_bounds():
    for name in ("logprobs", "prompt_logprobs"):
        for bad in (-1, 21):
            with pytest.raises(ValueError, match=name):
                SamplingParams(**{name: bad})
            with pytest.raises(pydantic.ValidationError):
                Sampling(**{name: bad})
        assert SamplingParams(**{name: 20}) and Sampling(**{name: 0})


def preempted_or_alone(preempt: bool, hand_out: bool) -> tuple[EventLog, int]:
    """Request "x" (logprobs and prompt logprobs asked), alone or preempted once after 4 tokens
    by a higher tier (continued in its engine, or on another one from its resume state)."""
    engines = [make_engine(max_batch_size=1), make_engine(max_batch_size=1)]
    log = EventLog()
    handed: list = []
    for engine in engines:
        engine.event_sink = lambda events: log.add([e for e in events if e.request_id == "x"])
        if hand_out:
            engine.preempt_sink = handed.extend
    current = engines[0]
    current.submit(prompt_token_ids=PROMPT, request_id="x",
                   sampling=SamplingParams(max_tokens=12, temperature=0.9, seed=7, logprobs=3,
                                           prompt_logprobs=2))
    waiting = preempt
    for _ in range(500):
        if log.final("x") is not None:
            break
        if waiting and len(log.tokens("x")) >= 4:
            waiting = False
            current.submit(prompt_token_ids=[250, 251], request_id="vip", priority=1,
                           sampling=SamplingParams(max_tokens=2), tenant="vip")
        current.step()
        if handed:  # back to the shared queue, taken by the other engine
            current = engines[1] if current is engines[0] else engines[0]
            current.submit(prompt_token_ids=PROMPT, resume=handed.pop())
    for engine in engines:
        run_until_idle(engine)
    return log, sum(e.stats()["preemptions"] for e in engines)


@pytest.mark.parametrize("hand_out", [False, True])
def test_a_preempted_request_gets_the_logprobs_it_would_get_alone(hand_out):
    alone, _ = preempted_or_alone(False, hand_out)
    preempted, preemptions = preempted_or_alone(True, hand_out)
    assert preemptions == 1
    tokens = [e for e in preempted.by_request["x"] if isinstance(e, TokenEvent)]
    assert tokens == [e for e in alone.by_request["x"] if isinstance(e, TokenEvent)]
    assert len(tokens) == 12 and all(e.logprobs is not None for e in tokens)
    assert [e.seq for e in preempted.by_request["x"] if e.prompt_logprobs is not None] == [0]
    assert len(tokens[0].prompt_logprobs) == len(PROMPT)  # the original prompt's
