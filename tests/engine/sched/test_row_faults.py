"""One request's fault ends that request only; a failed forward pass ends its rows once each.

A hostile tenant controls its sampling parameters and, through its prompt, the model's numbers
and the text its tokens decode to. None of that may end another tenant's request or change a
single token of it: each test runs a faulty row beside neighbours and compares every neighbour
with the same request run alone.
"""

from __future__ import annotations

import pytest

from inference.engine.backends.reference import ByteTokenizer, ReferenceBackend
from inference.engine.request import FinalEvent, FinishReason, SamplingParams
from tests.support.engine import EventLog, make_engine, run_until_idle

NEIGHBOURS = {
    "greedy": ("a calm neighbour", SamplingParams(max_tokens=12)),
    "sampled": ("a sampled neighbour", SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95,
                                                       top_k=20, seed=7)),
    "stops": ("one with stop strings", SamplingParams(max_tokens=12, stop=("zz", "q!"))),
}
POISON = "poison"
# Text an error message shows a client must be ours, not an exception's.
FOREIGN_TEXT = ("probability tensor", "Traceback", "boom", "RuntimeError", "multinomial")


def alone(prompt: str, sampling: SamplingParams) -> tuple[list[int], str]:
    """The tokens and text of one request alone in a fresh engine."""
    engine, log = make_engine(), EventLog()
    engine.submit(prompt=prompt, request_id="alone", sampling=sampling)
    run_until_idle(engine, log)
    assert log.final("alone").finish_reason is not FinishReason.ERROR
    return log.tokens("alone"), log.text("alone")


def submit_neighbours(engine) -> None:
    for rid, (prompt, sampling) in NEIGHBOURS.items():
        engine.submit(prompt=prompt, request_id=rid, sampling=sampling)


def assert_neighbours_untouched(log: EventLog) -> None:
    for rid, (prompt, sampling) in NEIGHBOURS.items():
        final = log.final(rid)
        assert final is not None and final.finish_reason is not FinishReason.ERROR, (rid, final)
        assert (log.tokens(rid), log.text(rid)) == alone(prompt, sampling), rid


def assert_clean_engine_error(final: FinalEvent | None) -> None:
    assert final is not None and final.finish_reason is FinishReason.ERROR
    assert final.error is not None and final.error.code == "engine_error"
    assert final.error.message and not any(t in final.error.message for t in FOREIGN_TEXT)
    assert final.error.details.get("phase"), final.error


def assert_all_released(engine) -> None:
    stats = engine.stats()
    assert stats["active_kv_reserved"] == 0
    assert stats["kv_blocks_held"] == 0 and stats["kv_blocks_reserved"] == 0
    assert stats["num_active"] == stats["num_prefilling"] == stats["num_pending"] == 0


# -- the model's numbers for one row --------------------------------------------------------------


class BadLogitsBackend(ReferenceBackend):
    """Reference logits, except that one row's become ``value`` from its ``after``-th token on.

    ``value`` "nan" or "inf" fills the whole row; "-inf" masks every token (nothing left to pick).
    """

    def __init__(self, row_id: str, value: float, after: int):
        super().__init__()
        self.row_id, self.value, self.after = row_id, value, after
        self.prompt_len: dict[str, int] = {}

    def prefill(self, chunks):
        logits = super().prefill(chunks)
        for i, chunk in enumerate(chunks):
            self.prompt_len[chunk.row_id] = chunk.start_pos + len(chunk.token_ids)
            if chunk.row_id == self.row_id and self.after == 0:
                logits[i] = self.value
        return logits

    def decode(self, rows):
        logits = super().decode(rows)
        for i, row in enumerate(rows):
            generated = row.position + 1 - self.prompt_len[row.row_id]
            if row.row_id == self.row_id and generated >= self.after:
                logits[i] = self.value
        return logits


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("after", [0, 3])
@pytest.mark.parametrize("poison_sampling", [
    SamplingParams(max_tokens=10), SamplingParams(max_tokens=10, temperature=0.8, seed=1)],
    ids=["greedy", "sampled"])
def test_non_finite_logits_for_one_row_end_that_row_only(value, after, poison_sampling):
    engine, log = make_engine(BadLogitsBackend(POISON, value, after)), EventLog()
    submit_neighbours(engine)
    engine.submit(prompt="the hostile prompt", request_id=POISON, sampling=poison_sampling)
    run_until_idle(engine, log)
    final = log.final(POISON)
    assert_clean_engine_error(final)
    assert final.error.details["phase"] == "sampling"
    assert final.error.details["max_logit"] == str(value)
    assert len(log.tokens(POISON)) == after == final.usage.completion_tokens
    assert_neighbours_untouched(log)
    assert_all_released(engine)
    assert engine.stats()["requests_finished"]["error"] == 1


# -- the text of one row --------------------------------------------------------------------------

BAD_TOKEN = 0xE2  # the first byte of a three-byte character: held back until the character ends


class FragileTokenizer(ByteTokenizer):
    """Decoding fails for ``BAD_TOKEN`` (always, or only once ``armed``)."""

    def __init__(self, only_when_armed: bool):
        super().__init__()
        self.armed = not only_when_armed

    def decode(self, token_ids):
        if self.armed and BAD_TOKEN in token_ids:
            raise RuntimeError("boom: the tokenizer choked")
        return super().decode(token_ids)


class BadTokenBackend(ReferenceBackend):
    """The row ``row_id`` decodes ``BAD_TOKEN`` at every decode step; the others as usual."""

    def __init__(self, row_id: str, only_when_armed: bool = False):
        super().__init__()
        self.row_id = row_id
        self.tokenizer = FragileTokenizer(only_when_armed)

    def decode(self, rows):
        logits = super().decode(rows)
        for i, row in enumerate(rows):
            if row.row_id == self.row_id:
                logits[i] = float("-inf")
                logits[i, BAD_TOKEN] = 10.0
        return logits


def test_a_token_whose_text_fails_ends_that_row_only_and_is_not_counted():
    engine, log = make_engine(BadTokenBackend(POISON)), EventLog()
    submit_neighbours(engine)
    engine.submit(prompt="the hostile prompt", request_id=POISON,
                  sampling=SamplingParams(max_tokens=10, stop=("xyz",)))
    run_until_idle(engine, log)
    final = log.final(POISON)
    assert_clean_engine_error(final)
    assert final.error.details["phase"] == "detokenize"
    assert final.error.details["token_id"] == BAD_TOKEN
    assert len(log.tokens(POISON)) == 1 == final.usage.completion_tokens  # the first token only
    assert_neighbours_untouched(log)
    assert_all_released(engine)


@pytest.mark.parametrize("end", ["length", "abort"])
def test_held_back_text_that_fails_to_flush_ends_that_row_only(end):
    backend = BadTokenBackend(POISON, only_when_armed=True)
    # Chunked: the final event comes a tick after the last token, leaving time to arm.
    engine, log = make_engine(backend, prefill_mode="chunked"), EventLog()
    submit_neighbours(engine)
    engine.submit(prompt="the hostile prompt", request_id=POISON,
                  sampling=SamplingParams(max_tokens=3 if end == "length" else 10))
    while len(log.tokens(POISON)) < 3:  # the first token, then two held-back partial bytes
        log.add(engine.step())
    assert log.text(POISON) and log.by_request[POISON][-1].text == ""
    backend.tokenizer.armed = True  # releasing the held text now fails
    if end == "abort":
        engine.abort(POISON)
    run_until_idle(engine, log)
    final = log.final(POISON)
    if end == "abort":  # the client left; it still gets exactly one final event
        assert final.finish_reason is FinishReason.ABORT and final.text == ""
    else:
        assert_clean_engine_error(final)
        assert final.error.details["phase"] == "flush"
    backend.tokenizer.armed = False
    assert_neighbours_untouched(log)
    assert_all_released(engine)


# -- a whole forward pass -------------------------------------------------------------------------


class BrokenPassBackend(ReferenceBackend):
    """The ``fail_at``-th forward pass of ``phase`` raises (or returns too few rows)."""

    def __init__(self, phase: str, fail_at: int, short: bool = False):
        super().__init__()
        self.phase, self.fail_at, self.short = phase, fail_at, short
        self.calls = {"prefill": 0, "decode": 0}
        self.failed_rows: list[str] = []

    def _maybe_fail(self, phase: str, row_ids: list[str], logits_of):
        self.calls[phase] += 1
        if phase == self.phase and self.calls[phase] == self.fail_at:
            self.failed_rows = row_ids
            if self.short:
                return logits_of()[:-1]
            raise RuntimeError("boom: CUDA error: an illegal memory access was encountered")
        return logits_of()

    def prefill(self, chunks):
        return self._maybe_fail("prefill", [c.row_id for c in chunks],
                                lambda: super(BrokenPassBackend, self).prefill(chunks))

    def decode(self, rows):
        return self._maybe_fail("decode", [r.row_id for r in rows],
                                lambda: super(BrokenPassBackend, self).decode(rows))


@pytest.mark.parametrize("phase,fail_at,short", [
    ("decode", 3, False), ("decode", 2, True), ("prefill", 1, False), ("prefill", 2, True)])
def test_a_failed_forward_pass_ends_its_rows_once_and_the_engine_keeps_serving(
        phase, fail_at, short):
    backend = BrokenPassBackend(phase, fail_at, short)
    # Chunked: prefill and decode are separate passes (a mixed pass: tests/engine/test_mixed_batch).
    engine = make_engine(backend, prefill_chunk_size=4, prefill_mode="chunked")
    log = EventLog()  # checks: nothing after a final event, seq without gaps
    prompts = {"p1": "first prompt here", "p2": "second one", "p3": "third prompt, longer still"}
    for rid, prompt in prompts.items():
        engine.submit(prompt=prompt, request_id=rid, sampling=SamplingParams(max_tokens=8))
    run_until_idle(engine, log)
    assert backend.failed_rows, "the pass never failed"
    for rid in prompts:
        finals = [e for e in log.by_request[rid] if isinstance(e, FinalEvent)]
        assert len(finals) == 1, rid
        if rid in backend.failed_rows:
            assert_clean_engine_error(finals[0])
            assert finals[0].error.details == {"phase": phase, "rows": len(backend.failed_rows)}
        else:
            assert finals[0].finish_reason is FinishReason.LENGTH
    assert_all_released(engine)
    engine.submit(prompt="next", request_id="next", sampling=SamplingParams(max_tokens=6))
    run_until_idle(engine, log)
    assert log.final("next").finish_reason is FinishReason.LENGTH
    assert (log.tokens("next"), log.text("next")) == alone("next", SamplingParams(max_tokens=6))
    assert_all_released(engine)


def test_the_worker_thread_keeps_serving_everyone_beside_hostile_sampling():
    """The reported case end to end: the engine's own thread, hostile values among others."""
    engine = make_engine()
    engine.start()
    try:
        hostile = [SamplingParams(max_tokens=1, temperature=1e-40),
                   SamplingParams(max_tokens=5, temperature=1.0, top_p=1e-300),
                   SamplingParams(max_tokens=5, temperature=1e-40, top_p=1e-300),
                   SamplingParams(max_tokens=5, temperature=1e300, top_k=10**9, seed=3)]
        handles = [engine.submit(prompt=f"hostile {i}", sampling=s) for i, s in enumerate(hostile)]
        handles += [engine.submit(prompt=prompt, sampling=sampling)
                    for prompt, sampling in NEIGHBOURS.values()]
        for handle in handles:
            _text, tokens, final = handle.result(timeout=30)
            assert final.finish_reason in (FinishReason.LENGTH, FinishReason.STOP), final
            assert tokens and all(0 <= t < ByteTokenizer.vocab_size for t in tokens)
    finally:
        engine.shutdown()

