"""Priority preemption: which rows a higher tier preempts, when it may not, and that a preempted
request's client gets exactly the answer it would have got alone (tokens, text, events, usage).
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inference.engine.backends.reference import ReferenceBackend
from inference.engine.request import (
    FinalEvent,
    FinishReason,
    ResumeState,
    SamplingParams,
    TokenEvent,
)
from tests.support.engine import EventLog, make_engine, run_until_idle


class Utf8Backend(ReferenceBackend):
    """The reference backend with some letters swapped for UTF-8 bytes (the two bytes of "é",
    the three of "€"): its answers hold characters split across tokens and stray bytes, so the
    text deltas hold bytes back across a preemption."""

    SWAP = {ord("a"): 0xC3, ord("b"): 0xA9, ord("c"): 0xE2, ord("d"): 0x82, ord("e"): 0xAC}

    def _logits(self, block_table, length):
        logits = super()._logits(block_table, length)
        out = logits.clone()
        for letter, byte in self.SWAP.items():
            out[byte], out[letter] = logits[letter], logits[byte]
        return out


def submit(engine, rid, prompt_len=8, max_tokens=20, priority=0, tenant="t", **sampling):
    return engine.submit(prompt_token_ids=[(i * 7 + len(rid)) % 200 + 1 for i in range(prompt_len)],
                         sampling=SamplingParams(max_tokens=max_tokens, **sampling),
                         request_id=rid, priority=priority, tenant=tenant)


def rows(engine, queue):
    return {r["request_id"]: r for r in engine.debug_snapshot()[queue]}


def step_until(engine, log, condition, limit=500):
    for _ in range(limit):
        if condition():
            return
        log.add(engine.step())
    raise AssertionError("the condition never held")


def decoding(engine, rid):
    row = rows(engine, "active").get(rid)
    return row is not None and not row["stopped"]


def test_a_higher_tier_preempts_the_lowest_tier_most_recently_admitted_row():
    engine = make_engine(max_batch_size=3)
    log = EventLog()
    for rid, priority in (("low-old", 0), ("mid", 1), ("low-new", 0)):
        submit(engine, rid, priority=priority)
        log.add(engine.step())
    step_until(engine, log, lambda: all(decoding(engine, r) for r in ("low-old", "mid", "low-new")))
    submit(engine, "vip", priority=2, max_tokens=3)
    log.add(engine.step())

    assert list(rows(engine, "pending")) == ["low-new"]  # back in the queue, nothing lost
    assert "vip" in log.by_request  # admitted and prefilled in the same tick
    assert set(rows(engine, "active")) >= {"low-old", "mid"}
    stats = engine.stats()
    assert stats["preemptions"] == 1 and stats["num_pending"] == 1
    assert stats["active_kv_reserved"] == sum(
        r["prompt_len"] + r["max_tokens"]
        for r in engine.debug_snapshot()["prefilling"] + engine.debug_snapshot()["active"])
    run_until_idle(engine, log)
    for rid in ("low-old", "mid", "low-new", "vip"):
        assert log.final(rid).finish_reason is FinishReason.LENGTH
    assert len(log.tokens("low-new")) == 20
    assert engine.stats()["active_kv_reserved"] == 0


def full_of_low_rows(**settings):
    engine = make_engine(max_batch_size=2, **settings)
    log = EventLog()
    submit(engine, "a", priority=0, max_tokens=30)
    submit(engine, "b", priority=1, max_tokens=30)
    step_until(engine, log, lambda: decoding(engine, "a") and decoding(engine, "b"))
    return engine, log


def test_a_request_waits_for_room_unless_its_tier_is_higher_than_a_running_row():
    engine, log = full_of_low_rows()
    submit(engine, "peer", priority=0, max_tokens=2)  # the lowest tier: no row below it
    for _ in range(5):
        log.add(engine.step())
    assert engine.stats()["preemptions"] == 0
    assert "peer" in rows(engine, "pending")
    run_until_idle(engine, log)
    first_of = {e.request_id: i for i, e in enumerate(log.order) if e.seq == 0}
    assert first_of["peer"] > min(log.order.index(log.final(r)) for r in ("a", "b"))


def test_preemption_switched_off_leaves_every_running_row_alone():
    engine, log = full_of_low_rows(preemption=False)
    submit(engine, "vip", priority=5, max_tokens=2)
    run_until_idle(engine, log)
    assert engine.stats()["preemptions"] == 0
    first_vip = next(i for i, e in enumerate(log.order) if e.request_id == "vip")
    assert first_vip > min(log.order.index(log.final("a")), log.order.index(log.final("b")))


def test_a_request_is_preempted_at_most_max_preemptions_times():
    engine = make_engine(max_batch_size=1, max_preemptions=2)
    log = EventLog()
    submit(engine, "batch", priority=0, max_tokens=40)
    for n in range(4):
        step_until(engine, log, lambda: decoding(engine, "batch"))
        submit(engine, f"vip{n}", priority=1, max_tokens=2)
        log.add(engine.step())
    run_until_idle(engine, log)
    assert engine.stats()["preemptions"] == 2
    # The third and fourth vip waited for the batch request, which was not preempted again.
    assert log.order.index(log.final("batch")) < next(
        i for i, e in enumerate(log.order) if e.request_id == "vip2")
    assert log.tokens("batch") == solo_tokens(max_tokens=40)


def solo_tokens(**spec):
    engine = make_engine(max_batch_size=1)
    log = EventLog()
    submit(engine, "batch", **spec)
    run_until_idle(engine, log)
    return log.tokens("batch")


def test_a_higher_tier_without_budget_preempts_and_one_that_cannot_fit_preempts_nothing():
    # Gate 2: 100 tokens. "high" (tier 2) holds 60, "low" (tier 0) 30; rows are free.
    engine = make_engine(max_batch_size=8, active_kv_budget=100, kv_num_blocks=64)
    log = EventLog()
    submit(engine, "high", prompt_len=30, max_tokens=30, priority=2)
    submit(engine, "low", prompt_len=10, max_tokens=20, priority=0)
    step_until(engine, log, lambda: decoding(engine, "high") and decoding(engine, "low"))
    submit(engine, "too-big", prompt_len=20, max_tokens=31, priority=1)  # 60 + 51 > 100
    log.add(engine.step())
    assert engine.stats()["preemptions"] == 0 and decoding(engine, "low")
    engine.abort("too-big")
    submit(engine, "fits", prompt_len=10, max_tokens=20, priority=1)  # 60 + 30 + 30 > 100
    log.add(engine.step())
    assert engine.stats()["preemptions"] == 1
    assert "low" in rows(engine, "pending") and "fits" not in rows(engine, "pending")
    run_until_idle(engine, log)
    assert log.final("low").finish_reason is FinishReason.LENGTH


def test_vtc_charges_nobody_for_the_recomputation():
    def service(preempt: bool) -> tuple[float, dict]:
        engine = make_engine(max_batch_size=1, scheduling_policy="vtc",
                             enable_prefix_caching=False)  # every recomputed token computed
        log = EventLog()
        submit(engine, "batch", prompt_len=24, max_tokens=20, tenant="bulk")
        if preempt:
            step_until(engine, log, lambda: len(log.tokens("batch")) >= 9)
            submit(engine, "vip", priority=1, max_tokens=2, tenant="vip")
        run_until_idle(engine, log)
        stats = engine.stats()
        return stats["per_key"]["bulk"]["weighted_service"], stats

    alone, _ = service(False)
    preempted, stats = service(True)
    assert stats["preemptions"] == 1
    assert stats["preempted_tokens_recomputed"] == 24 + 9  # the prompt and 9 tokens again
    assert stats["prompt_tokens_computed"] == 24 + (24 + 9) + 8  # and the vip's prompt
    assert preempted == alone == 24 * 1 + 20 * 2


# -- a preempted request's answer equals the same request's answer alone ------------------------

REQUESTS = st.fixed_dictionaries({
    "prompt": st.lists(st.integers(1, 255), min_size=1, max_size=20),
    "max_tokens": st.integers(2, 30),
    "temperature": st.sampled_from([0.0, 1.5]),
    "seed": st.integers(0, 2**32),
    "stop": st.sampled_from([(), ("é",), ("€",), ("gh",), ("x", "é€")]),
    "min_tokens": st.integers(0, 4),
    "ignore_eos": st.booleans(),
})
RUNS = st.fixed_dictionaries({
    "eos_every": st.sampled_from([0, 9]),
    "prefill_mode": st.sampled_from(["mixed_batch", "chunked", "monolithic"]),
    "enable_prefix_caching": st.booleans(),
    "hand_out": st.booleans(),  # continued on another engine from its resume state
    "after": st.lists(st.integers(1, 12), min_size=1, max_size=3, unique=True).map(sorted),
})


def answer(spec, run, preempt: bool):
    """Run ``spec`` (alone, or preempted after each count of tokens of ``run["after"]``);
    return its event log and the preemptions made."""
    def engine_for():
        settings = {k: run[k] for k in ("prefill_mode", "enable_prefix_caching")}
        return make_engine(Utf8Backend(eos_every=run["eos_every"]), max_batch_size=1,
                           max_preemptions=3, **settings)

    engines = [engine_for(), engine_for()]
    log = EventLog()
    handed: list[ResumeState] = []
    for engine in engines:
        engine.event_sink = lambda events: [log.add([e]) for e in events if e.request_id == "x"]
        if run["hand_out"]:
            engine.preempt_sink = handed.extend
    sampling = {k: spec[k] for k in ("max_tokens", "temperature", "seed", "stop",
                                     "min_tokens", "ignore_eos")}
    current = engines[0]
    current.submit(prompt_token_ids=spec["prompt"], request_id="x",
                   sampling=SamplingParams(**sampling))
    thresholds = list(run["after"]) if preempt else []
    made = 0
    for tick in range(2000):
        if log.final("x") is not None:
            break
        if thresholds and len(log.tokens("x")) >= thresholds[0] and decoding(current, "x"):
            thresholds.pop(0)
            current.submit(prompt_token_ids=[250, 251, 252], request_id=f"vip{tick}",
                           priority=1, sampling=SamplingParams(max_tokens=2), tenant="vip")
            made += 1
        current.step()
        if handed:  # back to "the shared queue", taken by the other engine
            current = engines[1] if current is engines[0] else engines[0]
            current.submit(prompt_token_ids=spec["prompt"], resume=handed.pop())
    for engine in engines:
        run_until_idle(engine)
        assert engine.stats()["active_kv_reserved"] == 0
    return log, sum(e.stats()["preemptions"] for e in engines), made


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=REQUESTS, run=RUNS)
def test_a_preempted_request_answers_exactly_as_it_would_alone(spec, run):
    alone, _, _ = answer(spec, run, preempt=False)
    preempted, preemptions, asked = answer(spec, run, preempt=True)
    assert preemptions == asked  # every vip found the request decoding and preempted it
    assert preempted.tokens("x") == alone.tokens("x")
    assert preempted.text("x") == alone.text("x")  # no text lost, repeated or split
    final, final_alone = preempted.final("x"), alone.final("x")
    assert isinstance(final, FinalEvent)
    assert final.finish_reason is final_alone.finish_reason
    assert final.usage == final_alone.usage  # each token billed once
    assert final.seq == final_alone.seq  # one event stream, numbered without a gap
    assert "ttft_s" in final.timings
    assert [e.seq for e in preempted.by_request["x"]] == list(range(final.seq + 1))
    assert all(isinstance(e, TokenEvent) for e in preempted.by_request["x"][:-1])
