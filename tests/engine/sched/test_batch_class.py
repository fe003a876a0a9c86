"""The batch service class in one engine (``docs/design.md``, "The batch service class"): its
place after every interactive request in both policies, fair among its own keys; its own
fairness key; its rows preempted in any phase by any interactive request, without the
``MAX_PREEMPTIONS`` bound, answering exactly as alone; no admission deadline but its own
deadline in any phase; and the ITL rule of its admission, on a fixed cost model.
"""

from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from inference.engine.request import (
    BATCH_TIER,
    ErrorCode,
    FinalEvent,
    FinishReason,
    Request,
    ResumeState,
    SamplingParams,
    TokenEvent,
)
from inference.engine.sched.policy import make_policy
from inference.engine.sched.tick_budget import (
    PassCostModel,
    PassShape,
    batch_row_fits,
    plan_batch_prefill,
)
from inference.protocol.messages import RequestMessage
from inference.worker.preparation import submit_args
from tests.engine.sched.test_preemption import Utf8Backend, decoding, rows, step_until
from tests.support.engine import EventLog, make_engine, run_until_idle

PROMPT = [(i * 11) % 200 + 1 for i in range(40)]
SAMPLING = {"max_tokens": 24, "temperature": 1.1, "seed": 3, "stop": ("zq",)}


def request(rid: str, key: str, priority: int = 0, batch: bool = False) -> Request:
    return Request(request_id=rid, prompt_token_ids=[1, 2], sampling=SamplingParams(),
                   tenant=key, fairness_key=key, priority=priority, batch=batch)


@pytest.mark.parametrize("policy", ["fcfs", "vtc"])
def test_every_batch_request_sorts_after_every_interactive_one_whatever_the_tiers(policy):
    order = make_policy(policy, 1.0, 2.0)
    for r in (request("b-high", "a:batch", priority=9, batch=True), request("i-low", "a"),
              request("b-low", "b:batch", batch=True), request("i-mid", "b", priority=3)):
        order.on_request_arrived(r)
    picked = [order.pick_next().request_id for _ in range(4)]
    assert picked[:2] == ["i-mid", "i-low"]  # interactive by tier first
    assert picked[2:] == ["b-high", "b-low"]  # then batch by arrival (its tier counts nothing)


def test_vtc_is_fair_among_the_batch_keys_and_batch_work_leaves_interactive_counters_alone():
    order = make_policy("vtc", 1.0, 2.0)
    for r in (request("a1", "a:batch", batch=True), request("b1", "b:batch", batch=True)):
        order.on_request_arrived(r)
    served = order.pick_next()
    assert served.request_id == "a1"  # a tie: the oldest
    order.on_tokens_processed(served, 100, 50)  # "a:batch" has been served 200
    order.on_request_arrived(request("a2", "a:batch", batch=True))
    assert order.pick_next().request_id == "b1"  # the batch key served least goes first
    assert order.keys["a"].vtc_counter == 0 and order.keys["a:batch"].vtc_counter == 200


def test_a_batch_message_is_charged_to_its_own_fairness_key_in_the_engine():
    message = RequestMessage(request_id="m", tenant="t7", fairness_key="t7", prompt="hello",
                             batch=True, sampling={"max_tokens": 5},
                             queue_deadline_s=0.001, enqueued_at=0)
    assert message.fairness_key == "t7:batch" and message.deadline() is None
    engine = make_engine(scheduling_policy="vtc")
    log = EventLog()
    engine.event_sink = log.add
    engine.submit(**submit_args(message, engine.tokenizer, engine.max_model_len))
    submit(engine, "i", key="t7", max_tokens=5)
    run_until_idle(engine)
    per_key = engine.stats()["per_key"]
    # Its queue deadline (long past) is not its own: it ran to its end.
    assert log.final("m").finish_reason is FinishReason.LENGTH
    assert per_key["t7:batch"]["completion_tokens_served"] == 5
    assert per_key["t7"]["completion_tokens_served"] == 5  # the interactive one's only
    assert per_key["t7"]["prompt_tokens_served"] == 3


def submit(engine, rid, *, key="t", priority=0, batch=False, prompt=None, **sampling):
    spec = {**SAMPLING, **sampling} if batch else {"max_tokens": 3, **sampling}
    return engine.submit(prompt_token_ids=prompt or [250 - len(rid), 251, 252], request_id=rid,
                         tenant=key, fairness_key=key, priority=priority, batch=batch,
                         sampling=SamplingParams(**spec))


def prefilling(engine, rid):
    return rid in rows(engine, "prefilling")


def answer(phase: str | None, hand_out: bool, times: int = 1, **settings):
    """The batch request "x" (tier 5) on an engine of one row, preempted ``times`` times by an
    interactive request of tier 0 while it is in ``phase`` (None: never; decode: after each 4
    tokens more); preempted requests handed between two engines as a worker's shared queue
    does with ``hand_out``. Returns its event log, the engines' stats and the preemptions
    asked."""
    after = [4 * (i + 1) for i in range(times)] if phase == "decode" else []
    return answer_of(PROMPT, SAMPLING, {"prefill": phase == "prefill", "after": after,
                                         "hand_out": hand_out, "eos_every": 0},
                     target_itl_ms=0, **settings)


def answer_of(prompt, sampling, run, **settings):
    """The batch request "x" of ``prompt`` and ``sampling`` on engines of one row: preempted
    by an interactive request of tier 0 once while it prefills (``run["prefill"]``) and once
    at each count of its tokens in ``run["after"]`` while it decodes; handed between two
    engines with ``run["hand_out"]``."""
    def engine_for():
        return make_engine(Utf8Backend(eos_every=run["eos_every"]), max_batch_size=1,
                           **settings)

    engines = [engine_for(), engine_for()]
    log = EventLog()
    handed: list[ResumeState] = []
    for engine in engines:
        engine.event_sink = lambda events: [log.add([e]) for e in events if e.request_id == "x"]
        if run["hand_out"]:
            engine.preempt_sink = handed.extend

    def start(engine):
        engine.submit(prompt_token_ids=prompt, request_id="x", tenant="bulk", priority=5,
                      fairness_key="bulk:batch", batch=True, sampling=SamplingParams(**sampling))

    current = engines[0]
    start(current)
    at_prefill, thresholds = run["prefill"], list(run["after"])
    made = 0
    for tick in range(3000):
        if log.final("x") is not None:
            break
        if at_prefill and prefilling(current, "x"):
            at_prefill = False
            submit(current, f"vip{tick}", key="vip")
            made += 1
        elif thresholds and len(log.tokens("x")) >= thresholds[0] and decoding(current, "x"):
            thresholds.pop(0)
            submit(current, f"vip{tick}", key="vip")
            made += 1
        current.step()
        if handed:  # back to "the shared queue", taken by the other engine
            current = engines[1] if current is engines[0] else engines[0]
            state = handed.pop()
            if state.generated:
                current.submit(prompt_token_ids=prompt, resume=state, batch=True,
                               tenant="bulk", priority=5, fairness_key="bulk:batch")
            else:  # preempted before its first token: its message goes back as it came
                start(current)
    for engine in engines:
        run_until_idle(engine)
        assert engine.stats()["active_kv_reserved"] == 0
        assert engine.stats()["kv_blocks_held"] == 0
    return log, [e.stats() for e in engines], made


@pytest.mark.parametrize("hand_out", [False, True])
@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_an_interactive_request_of_a_lower_tier_preempts_a_batch_row_that_answers_as_alone(
        phase, hand_out):
    alone, _, _ = answer(None, hand_out)
    log, stats, made = answer(phase, hand_out)
    assert made == 1
    assert sum(s["batch_preemptions"] for s in stats) == 1
    assert sum(s["preemptions"] for s in stats) == 1
    if phase == "decode":  # a prefill's full blocks are prefix hits: maybe none again
        assert sum(s["batch_tokens_recomputed"] for s in stats) > 0
    assert log.tokens("x") == alone.tokens("x") and len(alone.tokens("x")) == 24
    assert log.text("x") == alone.text("x")
    final, final_alone = log.final("x"), alone.final("x")
    assert isinstance(final, FinalEvent) and final.finish_reason is final_alone.finish_reason
    assert final.usage == final_alone.usage  # each token billed once
    assert [e.seq for e in log.by_request["x"]] == list(range(final.seq + 1))
    assert all(isinstance(e, TokenEvent) for e in log.by_request["x"][:-1])


def test_a_batch_row_is_preempted_however_often_and_with_preemption_off():
    alone, _, _ = answer(None, hand_out=False)
    log, stats, made = answer("decode", hand_out=False, times=4, max_preemptions=1,
                              preemption=False)
    assert made == 4 and stats[0]["batch_preemptions"] == 4
    assert log.tokens("x") == alone.tokens("x")
    assert log.final("x").usage == alone.final("x").usage


def test_a_batch_head_preempts_nothing_and_an_interactive_head_takes_batch_rows_first():
    engine = make_engine(max_batch_size=2, target_itl_ms=0)
    log = EventLog()
    submit(engine, "low", priority=0, max_tokens=30)
    submit(engine, "bulk", batch=True, priority=9, key="b:batch", max_tokens=30)
    log.add(engine.step())
    step_until(engine, log, lambda: decoding(engine, "low") and decoding(engine, "bulk"))
    submit(engine, "bulk2", batch=True, priority=9, key="c:batch")
    for _ in range(3):
        log.add(engine.step())
    assert engine.stats()["preemptions"] == 0 and "bulk2" in rows(engine, "pending")
    assert engine.stats()["preemptible_rows"] == {"tier": BATCH_TIER, "rows": 1,
                                                  "pending_above": 0}
    submit(engine, "peer", priority=0)  # same tier as "low": only the batch row may go
    log.add(engine.step())
    assert "bulk" in rows(engine, "pending") and "low" in rows(engine, "active")
    assert engine.stats()["batch_preemptions"] == 1
    run_until_idle(engine, log)
    assert all(log.final(r).finish_reason is FinishReason.LENGTH
               for r in ("low", "bulk", "bulk2", "peer"))


def test_gate_3_alone_preempts_batch_rows_for_an_interactive_head(monkeypatch):
    # Gate 3 binds before gate 2 only rarely (section 5): 52 of the pool's free blocks are
    # taken out of sight here, as if promised, so the head (5 blocks) fails gate 3 alone.
    engine = make_engine(max_batch_size=4, kv_num_blocks=64, target_itl_ms=0)
    kv = engine.scheduler.state.kv
    real = kv.available_blocks
    log = EventLog()
    submit(engine, "bulk", batch=True, prompt=[5] * 16, max_tokens=24, key="b:batch")
    step_until(engine, log, lambda: decoding(engine, "bulk"))
    monkeypatch.setattr(kv, "available_blocks", lambda: real() - 52)
    submit(engine, "head", prompt=[7] * 12, max_tokens=8)
    log.add(engine.step())
    stats = engine.stats()
    assert stats["batch_preemptions"] == 1 and stats["admissions_soft_held"]["2"] == 0
    assert "bulk" in rows(engine, "pending") and "head" in rows(engine, "prefilling")
    monkeypatch.setattr(kv, "available_blocks", real)
    run_until_idle(engine, log)
    assert log.final("head").finish_reason is FinishReason.LENGTH
    assert log.final("bulk").finish_reason is FinishReason.LENGTH


def test_gate_3_never_preempts_an_interactive_row_of_a_lower_tier(monkeypatch):
    engine = make_engine(max_batch_size=4, kv_num_blocks=64, target_itl_ms=0)
    kv = engine.scheduler.state.kv
    real = kv.available_blocks
    log = EventLog()
    submit(engine, "low", prompt=[5] * 16, max_tokens=24)
    step_until(engine, log, lambda: decoding(engine, "low"))
    monkeypatch.setattr(kv, "available_blocks", lambda: real() - 52)
    submit(engine, "head", prompt=[7] * 12, max_tokens=8, priority=3)
    log.add(engine.step())
    assert engine.stats()["preemptions"] == 0 and "head" in rows(engine, "pending")


def test_a_batch_request_has_no_queue_deadline_but_ends_at_its_own_in_any_phase():
    engine = make_engine(max_batch_size=1, target_itl_ms=0)
    log = EventLog()
    submit(engine, "busy", max_tokens=400, ignore_eos=True)
    engine.submit(prompt_token_ids=[9, 9], request_id="waits", batch=True, queue_wait_s=0,
                  sampling=SamplingParams(max_tokens=4))
    engine.submit(prompt_token_ids=[8, 8], request_id="late", batch=True, deadline_s=-1,
                  sampling=SamplingParams(max_tokens=4))
    log.add(engine.step())
    late = log.final("late")
    assert late.finish_reason is FinishReason.ERROR
    assert late.error.code is ErrorCode.BATCH_EXPIRED and not late.error.retryable
    assert "waits" in rows(engine, "pending")  # queue_wait_s=0 is no deadline of a batch one
    engine.abort("busy")
    engine.submit(prompt_token_ids=[7, 7], request_id="running", batch=True, deadline_s=0.3,
                  sampling=SamplingParams(max_tokens=400, ignore_eos=True))
    step_until(engine, log, lambda: len(log.tokens("running")) >= 2)
    time.sleep(0.35)
    log.add(engine.step())
    running = log.final("running")
    assert running.error.code is ErrorCode.BATCH_EXPIRED
    assert running.usage.completion_tokens == len(log.tokens("running")) >= 2
    run_until_idle(engine, log)
    assert log.final("waits").finish_reason is FinishReason.LENGTH
    assert engine.stats()["active_kv_reserved"] == 0


class FixedModel(PassCostModel):
    """A cost model that measured passes do not correct: predictions stay as fitted."""

    def observe(self, shape, seconds):
        pass


# 10 ms a pass, 5 ms a decode row, 1 ms a prompt token.
MODEL = FixedModel([0.010, 0.005, 0.0, 0.001, 0.0])


def test_batch_rows_are_admitted_only_within_the_interactive_pass_plus_the_slack():
    # One interactive decode row: 15 ms. 12 ms of slack: 2 batch rows (25 ms), not 3 (30 ms).
    interactive = PassShape(1, 10)
    assert batch_row_fits(interactive, PassShape(1, 10), 1, 10, MODEL, 0.0, 0.012)
    assert not batch_row_fits(interactive, PassShape(2, 20), 1, 10, MODEL, 0.0, 0.012)
    # As a share of the interactive pass: 10 % of 15 ms fits no 5 ms row, 40 % fits one.
    assert not batch_row_fits(interactive, PassShape(), 1, 10, MODEL, 0.1, 0.0)
    assert batch_row_fits(interactive, PassShape(), 1, 10, MODEL, 0.4, 0.0)
    assert batch_row_fits(PassShape(), PassShape(30, 300), 1, 10, MODEL, 0.0, 0.0)  # fills it
    assert batch_row_fits(interactive, PassShape(30, 300), 1, 10, None, 0.0, 0.0)

    engine = make_engine(max_batch_size=8, batch_itl_slack_ms=12, batch_itl_slack_fraction=0)
    engine.scheduler.admission.cost_model = engine.scheduler.mixed.cost_model = MODEL
    log = EventLog()
    submit(engine, "stream", max_tokens=60, ignore_eos=True)
    step_until(engine, log, lambda: decoding(engine, "stream"))
    for i in range(4):
        submit(engine, f"bulk{i}", batch=True, key=f"k{i}:batch", max_tokens=8)
    for _ in range(3):
        log.add(engine.step())
    snapshot = engine.debug_snapshot()
    admitted = [r["request_id"] for r in snapshot["prefilling"] + snapshot["active"]]
    assert sorted(admitted) == ["bulk0", "bulk1", "stream"]
    assert engine.stats()["batch_itl_held"] > 0
    engine.abort("stream")  # no interactive row left: batch fills the machine
    log.add(engine.step())
    log.add(engine.step())
    assert not rows(engine, "pending")
    run_until_idle(engine, log)
    assert all(log.final(f"bulk{i}").finish_reason is FinishReason.LENGTH for i in range(4))


def test_a_batch_prompt_beside_interactive_rows_gets_what_fits_the_slack():
    # The decode rows (1 interactive) cost 15 ms; 12 ms of slack: 12 prompt tokens fit.
    base = PassShape(1, 10)
    ceiling = MODEL.predict(base) + 0.012
    assert plan_batch_prefill([(0, 40)], base, MODEL, ceiling, 32) == [12]
    assert plan_batch_prefill([(0, 40)], base, MODEL, ceiling, 8) == [8]
    assert plan_batch_prefill([(0, 40)], PassShape(4, 40), MODEL, ceiling, 32) == [0]

    engine = make_engine(max_batch_size=4, prefill_chunk_size=32, batch_itl_slack_ms=12,
                         batch_itl_slack_fraction=0)
    engine.scheduler.admission.cost_model = engine.scheduler.mixed.cost_model = MODEL
    log = EventLog()
    submit(engine, "stream", max_tokens=60, ignore_eos=True)
    step_until(engine, log, lambda: decoding(engine, "stream"))
    submit(engine, "bulk", batch=True, key="b:batch", prompt=PROMPT)
    log.add(engine.step())
    last = engine.stats()["tick_budget"]["last_pass"]
    assert last["decode_rows"] == 1 and last["prefill_tokens"] == 12


def test_batch_rows_decoding_when_a_stream_starts_wait_for_what_fits_beside_it():
    # Three batch rows decode alone (25 ms passes). A stream starts decoding: its pass alone is
    # 15 ms, and 40 % of it (6 ms) fits one batch row: the others wait, keeping their blocks.
    engine = make_engine(max_batch_size=8, batch_itl_slack_fraction=0.4)
    engine.scheduler.admission.cost_model = engine.scheduler.mixed.cost_model = MODEL
    log = EventLog()
    for i in range(3):
        submit(engine, f"bulk{i}", batch=True, key=f"k{i}:batch", max_tokens=40, ignore_eos=True)
    step_until(engine, log, lambda: all(decoding(engine, f"bulk{i}") for i in range(3)))
    submit(engine, "stream", max_tokens=12, ignore_eos=True)
    step_until(engine, log, lambda: decoding(engine, "stream"))
    before = {i: len(log.tokens(f"bulk{i}")) for i in range(3)}
    for _ in range(5):
        log.add(engine.step())
        assert engine.stats()["tick_budget"]["last_pass"]["decode_rows"] == 2
    grown = [len(log.tokens(f"bulk{i}")) - before[i] for i in range(3)]
    assert grown == [5, 0, 0]  # the oldest admitted decodes; the others wait
    assert engine.stats()["batch_decode_waits"] >= 10
    run_until_idle(engine, log)
    assert all(log.final(f"bulk{i}").finish_reason is FinishReason.LENGTH for i in range(3))
    assert [len(log.tokens(f"bulk{i}")) for i in range(3)] == [40, 40, 40]


BATCH_REQUESTS = st.fixed_dictionaries({
    "prompt": st.lists(st.integers(1, 255), min_size=1, max_size=30),
    "max_tokens": st.integers(2, 30),
    "temperature": st.sampled_from([0.0, 1.5]),
    "seed": st.integers(0, 2**32),
    "stop": st.sampled_from([(), ("é",), ("€",), ("gh",)]),
    "min_tokens": st.integers(0, 4),
    "ignore_eos": st.booleans(),
})
BATCH_RUNS = st.fixed_dictionaries({
    "eos_every": st.sampled_from([0, 9]),
    "prefill_mode": st.sampled_from(["mixed_batch", "chunked"]),
    "enable_prefix_caching": st.booleans(),
    "hand_out": st.booleans(),
    "prefill": st.booleans(),
    "after": st.lists(st.integers(1, 12), max_size=3, unique=True).map(sorted),
})


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=BATCH_REQUESTS, run=BATCH_RUNS)
def test_a_batch_request_preempted_in_any_phase_answers_exactly_as_alone(spec, run):
    prompt = spec.pop("prompt")
    config = {k: run[k] for k in ("prefill_mode", "enable_prefix_caching")}
    alone, _, _ = answer_of(prompt, spec, {**run, "prefill": False, "after": []}, **config)
    log, stats, made = answer_of(prompt, spec, run, **config)
    event(f"preempted {min(made, 2)}+ times")
    assert sum(s["batch_preemptions"] for s in stats) == made
    assert log.tokens("x") == alone.tokens("x")
    assert log.text("x") == alone.text("x")
    final, final_alone = log.final("x"), alone.final("x")
    assert final.finish_reason is final_alone.finish_reason
    assert final.usage == final_alone.usage
    assert [e.seq for e in log.by_request["x"]] == list(range(final.seq + 1))


def test_batch_passes_stay_short_for_batch_yield_s_after_interactive_work_then_fill():
    # A stream ends; for BATCH_YIELD_S a pass of batch rows alone is held to the ceiling of a
    # one-row interactive pass (15 ms, 40 %: 21 ms), so a request arriving mid-pass waits
    # about one stream's step: two batch rows decode (20 ms), not all four (30 ms), and a
    # batch prompt still gets MIN_PREFILL_TOKENS beside them.
    now = [0.0]
    engine = make_engine(max_batch_size=8, batch_itl_slack_fraction=0.4, batch_yield_s=5)
    engine.scheduler.state.clock = lambda: now[0]
    engine.scheduler.admission.cost_model = engine.scheduler.mixed.cost_model = MODEL
    log = EventLog()
    submit(engine, "stream", max_tokens=3)
    for i in range(4):
        submit(engine, f"bulk{i}", batch=True, key=f"k{i}:batch", max_tokens=40, ignore_eos=True)
    step_until(engine, log, lambda: log.final("stream") is not None)
    now[0] = 4.0  # within the window: at most two batch rows decode a pass
    step_until(engine, log, lambda: all(decoding(engine, f"bulk{i}") for i in range(4)))
    for _ in range(3):
        log.add(engine.step())
        assert engine.stats()["tick_budget"]["last_pass"]["decode_rows"] == 2
    assert engine.stats()["batch_decode_waits"] >= 6
    now[0] = 6.0  # past it: they fill the pass
    log.add(engine.step())
    assert engine.stats()["tick_budget"]["last_pass"]["decode_rows"] == 4
    run_until_idle(engine, log)
    assert [len(log.tokens(f"bulk{i}")) for i in range(4)] == [40] * 4

    # BATCH_YIELD_S=0: batch rows fill the pass as soon as the stream is gone.
    engine = make_engine(max_batch_size=8, batch_itl_slack_fraction=0.4, batch_yield_s=0)
    engine.scheduler.admission.cost_model = engine.scheduler.mixed.cost_model = MODEL
    log = EventLog()
    submit(engine, "stream", max_tokens=3)
    for i in range(4):
        submit(engine, f"bulk{i}", batch=True, key=f"k{i}:batch", max_tokens=40, ignore_eos=True)
    step_until(engine, log, lambda: log.final("stream") is not None)
    step_until(engine, log, lambda: all(decoding(engine, f"bulk{i}") for i in range(4)))
    log.add(engine.step())
    assert engine.stats()["tick_budget"]["last_pass"]["decode_rows"] == 4
