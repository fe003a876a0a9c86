"""``PREFILL_MODE=mixed_batch`` on the reference backend: one forward pass per tick, the first-token
rule of its order, ITL-targeted prompt budgets, faults in the shared pass.

The reference backend derives each next token from every token it reads back through the row's
block table, so equal outputs mean the KV writes and block tables were right.
"""

from __future__ import annotations

import pytest

from inference.engine.backends.reference import ReferenceBackend
from inference.engine.request import FinalEvent, FinishReason, SamplingParams, TokenEvent
from inference.engine.sched.tick_budget import PassCostModel, PassShape
from tests.support.engine import EventLog, make_engine, run_until_idle

PROMPT = [(i * 13) % 251 + 1 for i in range(203)]


class PassLog(ReferenceBackend):
    """Records every pass: ``(kind, [(row, start, tokens) of chunks], decode rows)``."""

    def __init__(self, fail_at: int = 0, **kwargs):
        super().__init__(**kwargs)
        self.passes: list[tuple[str, list[tuple[str, int, int]], int]] = []
        self.fail_at = fail_at
        self.failed_rows: list[str] = []

    def prefill_and_decode(self, chunks, rows):
        self.passes.append(("mixed", [(c.row_id, c.start_pos, len(c.token_ids)) for c in chunks],
                            len(rows)))
        if self.fail_at and len(self.passes) == self.fail_at:
            self.failed_rows = [c.row_id for c in chunks] + [r.row_id for r in rows]
            raise RuntimeError("boom: the mixed pass failed")
        return super().prefill_and_decode(chunks, rows)

    def prefill(self, chunks):
        if not self.passes or self.passes[-1][0] != "mixed":
            self.passes.append(("prefill", [], 0))
        return super().prefill(chunks)


def test_the_default_mode_is_mixed_batch_and_the_stats_show_its_budget():
    engine = make_engine()
    stats = engine.stats()
    assert stats["prefill_mode"] == "mixed_batch"
    budget = stats["tick_budget"]
    assert budget["target_itl_ms"] == 500.0 and budget["prefill_token_cap"] == 8
    assert budget["cost_model"]["c0"] == 0  # the reference backend's passes cost nothing


@pytest.mark.parametrize("cap", [1, 7, 64, 203, 204])
def test_mixed_equals_chunked_equals_monolithic_while_other_rows_decode(cap):
    def run(mode: str) -> dict[str, list[int]]:
        engine, log = make_engine(prefill_mode=mode, prefill_chunk_size=cap, max_batch_size=8,
                                  kv_num_blocks=1024), EventLog()
        for i in range(3):  # rows decoding while the long prompt is prefilled
            engine.submit(prompt_token_ids=[i + 1] * 5, request_id=f"short{i}",
                          sampling=SamplingParams(max_tokens=60))
        log.add(engine.step())
        engine.submit(prompt_token_ids=PROMPT, request_id="long",
                      sampling=SamplingParams(max_tokens=12))
        engine.submit(prompt_token_ids=PROMPT[:37], request_id="mid",
                      sampling=SamplingParams(max_tokens=12))
        run_until_idle(engine, log)
        return {rid: log.tokens(rid) for rid in ("short0", "short1", "short2", "long", "mid")}

    mixed = run("mixed_batch")
    assert mixed == run("chunked") == run("monolithic")
    assert all(len(tokens) in (12, 60) for tokens in mixed.values())


def test_each_tick_is_one_forward_pass_with_every_decode_row_and_at_most_the_cap():
    backend = PassLog()
    engine, log = make_engine(backend, prefill_chunk_size=16, max_batch_size=8), EventLog()
    for i in range(3):
        engine.submit(prompt_token_ids=[i + 1] * 5, request_id=f"s{i}",
                      sampling=SamplingParams(max_tokens=80))
    log.add(engine.step())
    engine.submit(prompt_token_ids=PROMPT, request_id="long", sampling=SamplingParams(max_tokens=3))
    ticks = 0
    while log.final("long") is None:
        before, calls = len(backend.passes), backend.forward_calls
        log.add(engine.step())
        ticks += 1
        assert len(backend.passes) == before + 1 and backend.forward_calls == calls + 1
        kind, chunks, decode_rows = backend.passes[-1]
        assert kind == "mixed" and sum(n for _, _, n in chunks) <= 16
        # Every stream decodes in every tick, whatever the prompt's progress.
        assert decode_rows >= 3 or log.final("s0") is not None
    # 203 prompt tokens at 16 a tick: 13 ticks to its first token, then 2 more tokens.
    assert ticks == 13 + 2


def test_a_row_whose_final_chunk_is_in_the_pass_streams_its_first_token_in_that_tick():
    engine = make_engine(prefill_chunk_size=64)
    engine.submit(prompt_token_ids=[1, 2, 3, 4, 5], request_id="one",
                  sampling=SamplingParams(max_tokens=1))
    events = engine.step()
    # First token and, since it is the last one, the final event: both in this tick.
    assert [type(e) for e in events] == [TokenEvent, FinalEvent]
    assert events[1].finish_reason is FinishReason.LENGTH

    engine.submit(prompt_token_ids=[1, 2, 3, 4, 5], request_id="two",
                  sampling=SamplingParams(max_tokens=5))
    events = engine.step()
    # Promoted by this tick's pass: its first token now; it decodes from the next tick on.
    assert [e.seq for e in events] == [0]
    assert [e.seq for e in engine.step()] == [1]


def test_a_tight_target_shrinks_the_prompt_share_only_while_streams_run():
    backend = PassLog()
    engine = make_engine(backend, prefill_chunk_size=64, max_batch_size=8, kv_num_blocks=1024)
    # 1 ms a pass plus 1 ms per prompt token; a 20 ms target leaves 19 tokens beside a stream.
    engine.scheduler.mixed.cost_model = PassCostModel([1e-3, 0.0, 0.0, 1e-3, 0.0])
    engine.scheduler.mixed.target_itl_s = 0.020
    engine.submit(prompt_token_ids=PROMPT, request_id="alone",
                  sampling=SamplingParams(max_tokens=40))
    engine.step()
    assert backend.passes[-1][1] == [("alone", 0, 64)]  # no stream: the whole cap
    while not engine.debug_snapshot()["active"]:
        engine.step()
    engine.submit(prompt_token_ids=[p + 1 for p in PROMPT], request_id="second",
                  sampling=SamplingParams(max_tokens=2))
    model = engine.scheduler.cost_model
    correction = model.correction  # the passes so far moved it (they took no time)
    engine.step()
    kind, chunks, decode_rows = backend.passes[-1]
    # The most tokens whose predicted pass fits 20 ms: 19 at the fitted cost, more if the
    # measured passes ran faster than predicted.
    expected = int((0.020 / correction - 1e-3) / 1e-3 + 1e-9)
    assert decode_rows == 1 and chunks == [("second", 0, expected)] and expected >= 19
    assert engine.stats()["tick_budget"]["last_pass"]["prefill_tokens"] == expected


def test_the_cost_model_follows_a_slower_backend_than_it_was_fitted_on():
    model = PassCostModel([0.01, 0.0, 0.0, 0.001, 0.0])
    shape = PassShape(prefill_tokens=100)
    for _ in range(30):
        model.observe(shape, 2 * model.raw(shape))  # the machine is twice as slow now
    assert model.predict(shape) == pytest.approx(2 * model.raw(shape), rel=0.01)


def test_a_failed_mixed_pass_ends_each_of_its_rows_once_and_the_engine_keeps_serving():
    backend = PassLog(fail_at=3)
    engine, log = make_engine(backend, prefill_chunk_size=4), EventLog()
    prompts = {"p1": "first prompt here", "p2": "second one", "p3": "third, longer"}
    for rid, prompt in prompts.items():
        engine.submit(prompt=prompt, request_id=rid, sampling=SamplingParams(max_tokens=8))
    run_until_idle(engine, log)
    assert backend.failed_rows
    for rid in ("p1", "p2", "p3"):
        finals = [e for e in log.by_request[rid] if isinstance(e, FinalEvent)]
        assert len(finals) == 1
        if rid in backend.failed_rows:
            assert finals[0].finish_reason is FinishReason.ERROR
            assert finals[0].error.details == {"phase": "mixed", "rows": len(backend.failed_rows)}
        else:
            assert finals[0].finish_reason is FinishReason.LENGTH
    snap = engine.debug_snapshot()
    assert snap["active_kv_reserved"] == 0 and not snap["active"] and not snap["prefilling"]
    engine.submit(prompt="next", request_id="next", sampling=SamplingParams(max_tokens=6))
    run_until_idle(engine, log)
    assert log.final("next").finish_reason is FinishReason.LENGTH


@pytest.mark.parametrize("phase", ["prefilling", "active"])
def test_an_abort_between_mixed_ticks_frees_everything_and_ends_once(phase):
    engine, log = make_engine(prefill_chunk_size=4, active_kv_budget=300), EventLog()
    engine.submit(prompt_token_ids=PROMPT[:40], request_id="x",
                  sampling=SamplingParams(max_tokens=50))
    engine.submit(prompt_token_ids=[7] * 3, request_id="other",
                  sampling=SamplingParams(max_tokens=30))
    while not any(r["request_id"] == "x" for r in engine.debug_snapshot()[phase]):
        log.add(engine.step())
    engine.abort("x")
    run_until_idle(engine, log)
    assert log.final("x").finish_reason is FinishReason.ABORT
    assert log.final("other").finish_reason is FinishReason.LENGTH
    assert len(log.tokens("other")) == 30
    assert engine.debug_snapshot()["active_kv_reserved"] == 0
