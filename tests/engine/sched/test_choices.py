"""A request of ``n`` > 1 choices on the reference backend: one prefill, a fork into ``n`` rows
(shared full prompt blocks, a copied partial block), one ``seq`` counter, one final event.

Each choice ``i`` of a seeded request is exactly the one-choice request seeded with
``choice_seed(seed, i)`` (choice 0: the seed itself): the reference backend's logits depend on
every token it reads back through the row's block table, so a choice whose copied block were
wrong would differ. Also: stop strings, logprobs, structured outputs per choice; an abort ends
every choice with one final event; a choice that fails ends alone; the prompt is computed once;
VTC charges every choice; the reservation and every block come back; a forked request is
preempted as a whole and goes on (in its engine or another) exactly as if never interrupted;
more choices than rows is refused.
"""

from __future__ import annotations

import json

import pytest

from inference.engine.backends.reference import ReferenceBackend
from inference.engine.llm_engine import InvalidRequestError
from inference.engine.request import FinalEvent, FinishReason, SamplingParams, TokenEvent
from inference.engine.sched.choices import choice_seed
from inference.protocol.events import ChoiceEnd
from inference.protocol.structured import StructuredOutput
from tests.support.engine import EventLog, make_engine, run_until_idle

PROMPT = list(range(1, 11))  # 10 tokens: two full blocks of 4 and a partial one
MODES = ["monolithic", "chunked", "mixed_batch"]


def choices_of(log: EventLog, rid: str) -> tuple[list[list[int]], list[str], FinalEvent]:
    """Each choice's tokens and text (its events' and its end's), and the final event."""
    return split_choices(log.by_request[rid])


def split_choices(events: list) -> tuple[list[list[int]], list[str], FinalEvent]:
    """The same, of one request's events in order (the last its final event)."""
    final = events[-1]
    assert isinstance(final, FinalEvent)
    n = max(len(final.choices), 1)
    tokens: list[list[int]] = [[] for _ in range(n)]
    texts = [""] * n
    for event in events[:-1]:
        assert isinstance(event, TokenEvent)
        tokens[event.index].append(event.token_id)
        texts[event.index] += event.text
    ends = final.choices or (ChoiceEnd(index=0, finish_reason=final.finish_reason,
                                       text=final.text),)
    for end in ends:
        texts[end.index] += end.text
    return tokens, texts, final


def run(sampling: SamplingParams, mode: str = "chunked", prompt=PROMPT, **settings):
    engine = make_engine(prefill_mode=mode, **settings)
    log = EventLog()  # checks one gap-free seq per request
    engine.submit(prompt_token_ids=prompt, request_id="x", sampling=sampling)
    run_until_idle(engine, log)
    return engine, choices_of(log, "x")


def assert_released(engine) -> None:
    stats = engine.stats()
    assert stats["active_kv_reserved"] == 0
    assert stats["kv_blocks_held"] == 0
    assert stats["kv_blocks_reserved"] == 0
    assert stats["num_active"] == stats["num_prefilling"] == stats["num_pending"] == 0
    assert all(v["in_flight"] == 0 for v in stats["per_key"].values())
    assert not engine.backend.rows


@pytest.mark.parametrize("mode", MODES)
def test_each_seeded_choice_is_the_one_choice_request_of_its_seed(mode):
    sampling = SamplingParams(max_tokens=12, temperature=8.0, seed=42, n=4)
    engine, (tokens, texts, final) = run(sampling, mode)
    again = run(sampling, mode)[1]
    assert (tokens, texts) == again[:2], "each choice equals itself when the request runs again"
    for i in range(4):
        alone = SamplingParams(max_tokens=12, temperature=8.0, seed=choice_seed(42, i))
        single_tokens, single_texts, single = run(alone, mode)[1]
        assert tokens[i] == single_tokens[0]
        assert texts[i] == single_texts[0]
        assert final.choices[i].finish_reason is single.finish_reason
    assert choice_seed(42, 0) == 42  # choice 0 is the request with n = 1 and the same seed
    assert len({tuple(t) for t in tokens}) == 4, "the choices draw independently"
    assert [c.index for c in final.choices] == [0, 1, 2, 3]
    assert final.finish_reason is final.choices[0].finish_reason is FinishReason.LENGTH
    assert final.usage.prompt_tokens == len(PROMPT)
    assert final.usage.completion_tokens == 4 * 12
    assert all(c.completion_tokens == 12 for c in final.choices)
    assert_released(engine)


def test_unseeded_choices_draw_independently():
    sampling = SamplingParams(max_tokens=12, temperature=8.0, n=3)
    tokens = run(sampling)[1][0]
    assert len({tuple(t) for t in tokens}) == 3


@pytest.mark.parametrize("prompt_len", [8, 10])  # on a block boundary, and inside a block
def test_the_prompt_is_computed_once_for_four_choices(prompt_len):
    engine, (tokens, _, final) = run(SamplingParams(max_tokens=5, temperature=8.0, seed=1, n=4),
                                     prompt=PROMPT[:prompt_len])
    stats = engine.stats()
    assert stats["prompt_tokens_computed"] == prompt_len
    assert stats["prefix_queried_tokens"] == prompt_len  # one prefix-cache lookup
    snap = engine.debug_snapshot()
    assert snap["forked_requests"] == 1 and snap["forked_choices"] == 4
    assert stats["tokens_generated"] == 20
    # The partial prompt block is copied for each choice after the first; a full one is shared.
    assert engine.backend.block_copies == (3 if prompt_len % 4 else 0)
    assert stats["requests_finished"]["length"] == 1  # one request
    # VTC: the prompt once, every choice's tokens
    key = stats["per_key"]["default"]
    assert key["prompt_tokens_served"] == prompt_len
    assert key["completion_tokens_served"] == 20 == final.usage.completion_tokens
    assert_released(engine)


def test_the_reservation_counts_every_choice():
    engine = make_engine(kv_block_size=4, prefill_chunk_size=4)
    engine.submit(prompt_token_ids=PROMPT, request_id="x",
                  sampling=SamplingParams(max_tokens=6, n=3))
    engine.step()  # admitted: one chunk of the prompt computed
    snap = engine.debug_snapshot()
    (row,) = snap["prefilling"]
    assert row["reserved_kv_tokens"] == 10 + 3 * 6 == snap["active_kv_reserved"]
    # choice 0's ceil(16 / 4) blocks, and per other choice its growth past the 2 full blocks
    assert row["reserved_blocks"] + len(row["blocks"]) == 4 + 2 * (4 - 2)
    while not snap["active"]:
        engine.step()
        snap = engine.debug_snapshot()
    assert [r["reserved_kv_tokens"] for r in snap["active"]] == [16, 6, 6]
    assert snap["active_kv_reserved"] == 28
    full = snap["active"][0]["blocks"][:2]
    assert all(r["blocks"][:2] == full for r in snap["active"]), "full blocks are shared"
    assert len({r["blocks"][2] for r in snap["active"]}) == 3, "the partial block is copied"
    run_until_idle(engine)
    assert_released(engine)


def test_more_choices_than_rows_is_refused_naming_n():
    engine = make_engine(max_batch_size=4)
    with pytest.raises(InvalidRequestError) as refused:
        engine.submit(prompt_token_ids=PROMPT, sampling=SamplingParams(n=5))
    assert refused.value.error.code == "invalid_request"
    assert refused.value.error.details["param"] == "n"
    with pytest.raises(ValueError, match="n must be >= 1"):
        SamplingParams(n=0)


def test_a_request_of_n_choices_waits_for_n_free_rows():
    engine = make_engine(max_batch_size=3)
    log = EventLog()
    engine.submit(prompt_token_ids=PROMPT, request_id="one", sampling=SamplingParams(
        max_tokens=20))
    engine.submit(prompt_token_ids=PROMPT, request_id="many", sampling=SamplingParams(
        max_tokens=4, n=3))
    for _ in range(4):
        log.add(engine.step())
        snap = engine.debug_snapshot()
        assert sum(r["n"] for r in snap["prefilling"]) + len(snap["active"]) <= 3
        assert [r["request_id"] for r in snap["pending"]] == ["many"]
    run_until_idle(engine, log)
    assert len(log.final("many").choices) == 3
    assert_released(engine)


def test_stop_strings_end_each_choice_on_its_own():
    sampling = SamplingParams(max_tokens=24, temperature=8.0, seed=7, n=3)
    tokens, texts, _ = run(sampling)[1]
    stop = texts[1][6:8]  # a string choice 1 writes
    engine, (_, stopped, final) = run(SamplingParams(
        max_tokens=24, temperature=8.0, seed=7, n=3, stop=(stop,)))
    for i, (text, end) in enumerate(zip(texts, final.choices, strict=True)):
        at = text.find(stop)
        if at >= 0:
            assert stopped[i] == text[:at] and end.finish_reason is FinishReason.STOP, i
        else:
            assert stopped[i] == text and end.finish_reason is FinishReason.LENGTH, i
    assert final.choices[1].finish_reason is FinishReason.STOP
    assert final.finish_reason is final.choices[0].finish_reason
    assert_released(engine)


def test_logprobs_per_choice_and_prompt_logprobs_once():
    sampling = SamplingParams(max_tokens=6, temperature=8.0, seed=3, n=2, logprobs=2,
                              prompt_logprobs=1)
    engine = make_engine()
    log = EventLog()
    engine.submit(prompt_token_ids=PROMPT, request_id="x", sampling=sampling)
    run_until_idle(engine, log)
    events = log.by_request["x"]
    final = events[-1]
    prompt_entries = [e for e in events if e.prompt_logprobs is not None]
    assert len(prompt_entries) == 1 and prompt_entries[0].index == 0
    assert len(prompt_entries[0].prompt_logprobs) == len(PROMPT)
    for i in range(2):
        mine = [e for e in events[:-1] if e.index == i]
        entries = [p for e in mine for p in (e.logprobs or ())]
        entries += list(final.choices[i].logprobs or ())
        assert [p.token_id for p in entries] == [e.token_id for e in mine]
        assert all(len(p.top) == 2 for p in entries)
    assert_released(engine)


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "pick": {"enum": ["red", "green", "blue"]}},
          "required": ["ok", "pick"], "additionalProperties": False}


@pytest.mark.parametrize("mode", ["chunked", "mixed_batch"])
def test_a_json_schema_holds_for_every_choice(mode):
    schema = SCHEMA
    sampling = SamplingParams(max_tokens=60, temperature=2.0, seed=11, n=4,
                              structured=StructuredOutput(kind="json_schema",
                                                          spec=json.dumps(schema)))
    engine = make_engine(prefill_mode=mode, max_model_len=512)
    log = EventLog()
    engine.submit(prompt_token_ids=PROMPT, request_id="x", sampling=sampling)
    run_until_idle(engine, log)
    _, texts, final = choices_of(log, "x")
    for text, end in zip(texts, final.choices, strict=True):
        assert end.finish_reason is FinishReason.STOP, end
        value = json.loads(text)
        assert set(value) == {"ok", "pick"} and isinstance(value["ok"], bool)
        assert value["pick"] in ("red", "green", "blue")
    structured = engine.stats()["structured"]
    assert structured["constrained_requests"] == 1 == structured["compile_cache_misses"]
    assert_released(engine)


@pytest.mark.parametrize("mode", MODES)
def test_an_abort_ends_every_choice_with_one_final_event(mode):
    engine = make_engine(prefill_mode=mode)
    log = EventLog()
    engine.submit(prompt_token_ids=PROMPT, request_id="x",
                  sampling=SamplingParams(max_tokens=50, temperature=8.0, seed=2, n=3))
    while sum(isinstance(e, TokenEvent) for e in log.by_request["x"]) < 7:
        log.add(engine.step())
    engine.abort("x")
    run_until_idle(engine, log)
    events = log.by_request["x"]
    finals = [e for e in events if isinstance(e, FinalEvent)]
    assert len(finals) == 1 and finals[0] is events[-1]
    final = finals[0]
    assert final.finish_reason is FinishReason.ABORT and final.error is None
    assert [c.finish_reason for c in final.choices] == [FinishReason.ABORT] * 3
    per_choice = [sum(1 for e in events[:-1] if e.index == i) for i in range(3)]
    assert [c.completion_tokens for c in final.choices] == per_choice
    assert final.usage.completion_tokens == sum(per_choice) == len(events) - 1
    assert final.usage.prompt_tokens == len(PROMPT)
    assert engine.stats()["requests_finished"]["abort"] == 1
    assert_released(engine)


def test_an_abort_before_the_fork_ends_every_choice():
    engine = make_engine()
    engine.submit(prompt_token_ids=PROMPT, request_id="x", sampling=SamplingParams(n=3))
    engine.abort("x")
    log = EventLog()
    run_until_idle(engine, log)
    (final,) = log.by_request["x"]
    assert final.finish_reason is FinishReason.ABORT
    assert [(c.index, c.finish_reason) for c in final.choices] == [
        (i, FinishReason.ABORT) for i in range(3)]
    assert final.usage.completion_tokens == 0
    assert_released(engine)


class NaNChoice(ReferenceBackend):
    """Hands NaN logits to row ``x#1`` (choice 1 of ``x``) from its third token on."""

    def decode(self, rows):
        logits = super().decode(rows)
        for i, row in enumerate(rows):
            if row.row_id == "x#1" and row.position >= len(PROMPT) + 2:
                logits[i] = float("nan")
        return logits


def test_a_choice_that_fails_ends_alone():
    engine = make_engine(NaNChoice())
    log = EventLog()
    engine.submit(prompt_token_ids=PROMPT, request_id="x",
                  sampling=SamplingParams(max_tokens=8, temperature=8.0, seed=4, n=3))
    run_until_idle(engine, log)
    tokens, _, final = choices_of(log, "x")
    assert final.choices[1].finish_reason is FinishReason.ERROR
    assert final.choices[1].error.details["reason"] == "nan_logits"
    assert [len(t) for t in tokens] == [8, 3, 8]
    assert final.finish_reason is FinishReason.LENGTH and final.error is None
    assert final.usage.completion_tokens == 19
    assert_released(engine)


class NoCopy(ReferenceBackend):
    """A backend whose block copy fails."""

    def copy_block(self, source, target):
        raise RuntimeError("injected: no copy")


def test_a_choice_whose_block_copy_fails_ends_alone():
    engine = make_engine(NoCopy())
    log = EventLog()
    engine.submit(prompt_token_ids=PROMPT, request_id="x",
                  sampling=SamplingParams(max_tokens=5, n=3))
    run_until_idle(engine, log)
    tokens, _, final = choices_of(log, "x")
    assert [c.finish_reason for c in final.choices] == [
        FinishReason.LENGTH, FinishReason.ERROR, FinishReason.ERROR]
    assert final.choices[1].error.details["phase"] == "fork"
    assert [len(t) for t in tokens] == [5, 0, 0] and final.usage.completion_tokens == 5
    assert_released(engine)


LOW = SamplingParams(max_tokens=12, temperature=8.0, seed=21, n=3)


def low_alone(sampling: SamplingParams = LOW, mode: str = "chunked"):
    """The low-tier request's choices on an engine where nothing preempts it."""
    return run(sampling, mode, max_batch_size=3)[1]


def preempt_low(engine, log: EventLog, sampling: SamplingParams = LOW, tokens: int = 9,
                rows: int = 3) -> None:
    """Run the low-tier request until ``tokens`` of its token events and ``rows`` rows left,
    then submit a higher tier's request that needs its rows."""
    engine.submit(prompt_token_ids=PROMPT, request_id="low", priority=0, sampling=sampling)
    while (sum(isinstance(e, TokenEvent) for e in log.by_request["low"]) < tokens
           or len(engine.debug_snapshot()["active"]) != rows):
        log.add(engine.step())
    assert engine.scheduler.preemptible_rows() == {"tier": 0, "rows": rows,
                                                   "pending_above": 0}
    engine.submit(prompt_token_ids=PROMPT[:6], request_id="high", priority=2,
                  sampling=SamplingParams(max_tokens=4, n=4 - rows))  # needs a row of low's


@pytest.mark.parametrize("mode", MODES)
def test_a_forked_request_is_preempted_whole_and_goes_on_as_if_never_interrupted(mode):
    tokens, texts, alone = low_alone(mode=mode)
    engine = make_engine(prefill_mode=mode, max_batch_size=3, preemption=True,
                         max_preemptions=2)
    log = EventLog()  # one gap-free seq for the request, across its preemption
    preempt_low(engine, log)
    run_until_idle(engine, log)
    assert engine.stats()["preemptions"] == 1
    after, after_texts, final = choices_of(log, "low")
    assert (after, after_texts) == (tokens, texts), "no token lost, repeated or redrawn"
    assert final.choices == alone.choices
    assert final.usage == alone.usage
    assert sum(isinstance(e, FinalEvent) for e in log.by_request["low"]) == 1
    high_end = log.order.index(log.final("high"))
    assert high_end < log.order.index(final), "the higher tier ran in the rows it freed"
    assert engine.stats()["preempted_tokens_recomputed"] > 0
    assert_released(engine)


def test_a_choice_that_ended_before_the_preemption_keeps_its_end():
    """Choice 1 stops at a stop string before the preemption: it gets no row back, its end is
    kept, and the other choices go on."""
    tokens, texts, _ = low_alone()
    stop = texts[1][2:4]
    stopped = SamplingParams(**{**LOW.__dict__, "stop": (stop,)})
    tokens, texts, alone = low_alone(stopped)
    assert alone.choices[1].finish_reason is FinishReason.STOP
    assert [c.finish_reason for c in alone.choices].count(FinishReason.LENGTH) == 2
    engine = make_engine(max_batch_size=3, preemption=True, max_preemptions=2)
    log = EventLog()
    preempt_low(engine, log, stopped, tokens=len(tokens[1]) * 3, rows=2)
    log.add(engine.step())  # preempted: it waits again, for its two live choices
    (waiting,) = engine.debug_snapshot()["pending"]
    assert waiting["request_id"] == "low" and waiting["n"] == 2 and waiting["preemptions"] == 1
    run_until_idle(engine, log)
    assert engine.stats()["preemptions"] == 1
    after, after_texts, final = choices_of(log, "low")
    assert (after, after_texts) == (tokens, texts)
    assert final.choices == alone.choices and final.usage == alone.usage
    assert_released(engine)


def test_a_forked_request_goes_on_in_another_engine_from_its_resume_state():
    tokens, texts, alone = low_alone()
    first = make_engine(max_batch_size=3, preemption=True, max_preemptions=2)
    handed: list = []
    first.preempt_sink = handed.extend
    log = EventLog()
    preempt_low(first, log)
    run_until_idle(first, log)
    (state,) = handed
    assert [c.index for c in state.choices] == [0, 1, 2] and state.generated == ()
    assert all(c.generator is None and c.detokenizer is None for c in state.choices)
    assert state.completion_tokens == sum(isinstance(e, TokenEvent)
                                          for e in log.by_request["low"])
    second = make_engine(max_batch_size=3)
    second.submit(prompt_token_ids=PROMPT, request_id="low", priority=0, resume=state)
    run_until_idle(second, log)
    after, after_texts, final = choices_of(log, "low")
    assert (after, after_texts) == (tokens, texts)
    assert final.choices == alone.choices and final.usage == alone.usage
    assert_released(first)
    assert_released(second)


@pytest.mark.parametrize("another_engine", [False, True])
def test_a_preempted_json_schema_request_goes_on_with_each_choice_s_grammar(another_engine):
    """Each choice's grammar goes on where it stopped: live within the engine, replayed from
    its tokens (the one grammar compiled again) in another."""
    sampling = SamplingParams(max_tokens=60, temperature=2.0, seed=11, n=3, logprobs=1,
                              structured=StructuredOutput(kind="json_schema",
                                                          spec=json.dumps(SCHEMA)))
    engine = make_engine(max_batch_size=3, max_model_len=512)
    log = EventLog()
    engine.submit(prompt_token_ids=PROMPT, request_id="low", sampling=sampling)
    run_until_idle(engine, log)
    _, texts, alone = choices_of(log, "low")
    assert all(c.finish_reason is FinishReason.STOP for c in alone.choices)
    first = make_engine(max_batch_size=3, max_model_len=512, preemption=True)
    handed: list = []
    if another_engine:
        first.preempt_sink = handed.extend
    log = EventLog()
    preempt_low(first, log, sampling, tokens=6)
    run_until_idle(first, log)
    assert first.stats()["preemptions"] == 1
    if another_engine:
        second = make_engine(max_batch_size=3, max_model_len=512)
        second.submit(prompt_token_ids=PROMPT, request_id="low", resume=handed[0])
        run_until_idle(second, log)
        assert_released(second)
    _, after, final = choices_of(log, "low")
    assert after == texts
    assert [c.finish_reason for c in final.choices] == [c.finish_reason for c in alone.choices]
    for text in after:
        assert json.loads(text)["pick"] in ("red", "green", "blue")
    assert_released(first)


def test_an_abort_while_preempted_ends_every_choice_once():
    engine = make_engine(max_batch_size=3, preemption=True, max_preemptions=2)
    log = EventLog()
    preempt_low(engine, log)
    log.add(engine.step())  # preempted: the low-tier request waits again in pending
    assert [r["request_id"] for r in engine.debug_snapshot()["pending"]] == ["low"]
    streamed = sum(isinstance(e, TokenEvent) for e in log.by_request["low"])
    engine.abort("low")
    run_until_idle(engine, log)
    final = log.final("low")
    assert final.finish_reason is FinishReason.ABORT
    assert [c.finish_reason for c in final.choices] == [FinishReason.ABORT] * 3
    assert final.usage.completion_tokens == streamed
    assert sum(c.completion_tokens for c in final.choices) == streamed
    assert_released(engine)


def test_the_events_of_one_choice_serialize_as_before():
    """``index`` 0 and empty ``choices`` stay out of the JSON: one choice's events are as they
    were before ``n``."""
    token = TokenEvent(request_id="a", seq=0, token_id=1, text="x")
    assert "index" not in token.model_dump_json()
    assert TokenEvent.from_json(token.model_dump_json()) == token
    assert '"index":2' in token.model_copy(update={"index": 2}).model_dump_json()
    final = FinalEvent(request_id="a", finish_reason="stop")
    assert "choices" not in final.model_dump_json()
    many = final.model_copy(update={"choices": (ChoiceEnd(index=0, finish_reason="stop"),)})
    assert FinalEvent.from_json(many.model_dump_json()) == many
