"""The batch service class in the shared queue (``docs/design.md``, "The batch service class"):
after every interactive request whatever the tiers, fair among batch keys, out of gate 1, never
taken for a preemption, expired at its own deadline; and across workers, a batch row preempted
by an interactive request of a lower tier goes back to the queue and answers as alone.

Real Redis on a private prefix; in-process workers on the reference backend.
"""

from __future__ import annotations

import time
import uuid

from inference.engine.config import EngineConfig
from inference.engine.llm_engine import LLMEngine
from inference.engine.request import BATCH_TIER, SamplingParams
from inference.protocol.events import ErrorCode, FinalEvent, FinishReason
from inference.protocol.keys import EVENTS_TTL_S
from inference.protocol.messages import RequestMessage
from inference.worker.fair_queue import FairQueue
from tests.support.e2e import wait_for
from tests.support.engine import run_until_idle
from tests.worker.test_preemption import stream, tokens_streamed, workers  # noqa: F401


def ended(rclient, keys, request_id: str) -> bool:
    """Whether the request's final event is in its stream."""
    events = stream(rclient, keys, request_id)
    return bool(events) and isinstance(events[-1][1], FinalEvent)


def left_to_its_step(worker, rclient, keys, request_id: str) -> bool:
    """A batch line's end: its usage entry waits in the ledger for its batch's step (the worker
    sends it no usage task)."""
    return (rclient.hexists(keys.usage_pending, request_id)
            and all(u.request_id != request_id for u in worker.usage))

PROMPT = "a batch line's prompt"
SAMPLING = {"max_tokens": 60, "temperature": 1.3, "seed": 7, "stop": ["zq"], "ignore_eos": True}


def message(tenant: str, priority: int = 0, batch: bool = False, prompt: str = "hi",
            **fields) -> RequestMessage:
    return RequestMessage(request_id=uuid.uuid4().hex, tenant=tenant, fairness_key=tenant,
                          priority=priority, prompt=prompt, batch=batch, **fields)


def ids(taken) -> list[str]:
    return [q.request_id for q in taken]


def test_the_shared_order_puts_every_batch_request_after_every_interactive_one(rclient, keys):
    queue = FairQueue(rclient, keys, "w", "vtc")
    b_high = message("a", 9, batch=True)
    i_low = message("a", 0)
    b_low = message("b", 0, batch=True)
    i_mid = message("b", 3)
    for m in (b_high, i_low, b_low, i_mid):
        queue.enqueue(m)
    assert b_high.fairness_key == "a:batch"
    assert ids(queue.take(4)) == [i_mid.request_id, i_low.request_id, b_high.request_id,
                                  b_low.request_id]


def test_batch_keys_are_fair_among_themselves_and_never_charge_the_interactive_key(
        rclient, keys):
    queue = FairQueue(rclient, keys, "w", "vtc")
    a1, a2, b1 = message("a", batch=True), message("a", batch=True), message("b", batch=True)
    for m in (a1, a2, b1):
        queue.enqueue(m)
    assert ids(queue.take(1)) == [a1.request_id]
    queue.charge({"a:batch": 500.0})
    assert ids(queue.take(1)) == [b1.request_id]  # the batch key served least
    counters = {k.decode(): float(v) for k, v in rclient.hgetall(keys.fq("counter")).items()}
    assert counters["a:batch"] == 500.0 and counters.get("a", 0.0) == 0.0


def test_gate_1_does_not_count_waiting_batch_requests(rclient, keys):
    queue = FairQueue(rclient, keys, "w", "fcfs")
    for _ in range(3):
        queue.enqueue(message("a", batch=True))
    assert queue.gate1() == 0
    interactive = message("a")
    queue.enqueue(interactive)
    assert queue.gate1() == 1
    assert ids(queue.take(1)) == [interactive.request_id]
    assert queue.gate1() == 1  # held by the worker until its engine admits it
    queue.release_held(1)
    assert queue.gate1() == 0 and rclient.hlen(keys.fq("wait")) == 3
    taken = queue.take(3)  # batch ones: never held
    assert queue.gate1() == 0 and all(q.batch for q in taken)
    assert queue.requeue({q.request_id: q.take for q in taken}) == 3
    assert queue.gate1() == 0 and not int(rclient.hget(keys.fq("held"), "w") or 0)


def test_a_take_for_preemption_never_takes_a_batch_request(rclient, keys):
    queue = FairQueue(rclient, keys, "w", "fcfs")
    bulk = message("a", 9, batch=True)
    queue.enqueue(bulk)
    assert queue.take(2, above=BATCH_TIER) == []
    low = message("a", 0)
    queue.enqueue(low)
    assert ids(queue.take(2, above=BATCH_TIER)) == [low.request_id]  # any tier may preempt
    assert ids(queue.take(2)) == [bulk.request_id]


def test_a_batch_request_has_no_queue_deadline_but_expires_at_its_own(rclient, keys):
    queue = FairQueue(rclient, keys, "w", "fcfs")
    now = time.time()
    kept = message("a", batch=True, queue_deadline_s=1, enqueued_at=now - 60,
                   batch_deadline_at=now + 600)
    late = message("b", batch=True, batch_deadline_at=now - 1)
    for m in (kept, late):
        queue.enqueue(m)
    assert queue.expire(EVENTS_TTL_S) == [late.request_id]
    final = stream(rclient, keys, late.request_id)[-1][1]
    assert isinstance(final, FinalEvent) and final.finish_reason is FinishReason.ERROR
    assert final.error.code is ErrorCode.BATCH_EXPIRED and not final.error.retryable
    assert ids(queue.take(2)) == [kept.request_id]


def answer_alone() -> tuple[str, int, FinalEvent]:
    engine = LLMEngine(EngineConfig(backend="reference", max_model_len=256, max_batch_size=1))
    handle = engine.submit(prompt=PROMPT, sampling=SamplingParams(
        **{**SAMPLING, "stop": tuple(SAMPLING["stop"])}), batch=True)
    run_until_idle(engine)
    text, tokens, final = handle.result(timeout=1)
    return text, len(tokens), final


def test_a_batch_row_preempted_by_a_lower_tier_goes_back_to_the_queue_and_answers_as_alone(
        workers, rclient, keys):  # noqa: F811 - the fixture
    queue = FairQueue(rclient, keys, "tool", "vtc")
    first = workers("first")
    bulk = message("bulk", 9, batch=True, prompt=PROMPT, sampling=SAMPLING,
                   batch_deadline_at=time.time() + 120)
    queue.enqueue(bulk)
    assert wait_for(lambda: tokens_streamed(rclient, keys, bulk.request_id) >= 5)
    vip = message("vip", 0, prompt="urgent", sampling={"max_tokens": 30, "ignore_eos": True})
    queue.enqueue(vip)  # tier 0, below the batch request's 9: it preempts it all the same
    assert wait_for(lambda: ended(rclient, keys, bulk.request_id), timeout_s=20)
    assert [u.request_id for u in first.usage] == [vip.request_id]
    assert left_to_its_step(first, rclient, keys, bulk.request_id)

    events = stream(rclient, keys, bulk.request_id)
    final_id, final = events[-1]
    text, n_tokens, alone = answer_alone()
    assert isinstance(final, FinalEvent) and final.finish_reason is alone.finish_reason
    assert [e.seq for _, e in events] == list(range(len(events)))  # no gap, no repeat
    assert "".join(e.text for _, e in events) == text
    assert final.usage.completion_tokens == n_tokens > 5
    assert stream(rclient, keys, vip.request_id)[0][0] < final_id
    stats = first.engine.stats()
    assert stats["preemptions"] == stats["batch_preemptions"] == 1
    assert stats["batch_tokens_recomputed"] > 0
    assert rclient.hlen(keys.fq("wait")) == 0 and not rclient.hgetall(keys.fq("inflight"))


def test_a_batch_row_preempted_while_it_prefills_starts_again_from_its_message(
        workers, rclient, keys):  # noqa: F811 - the fixture
    queue = FairQueue(rclient, keys, "tool", "vtc")
    first = workers("first", max_model_len=512, prefill_chunk_size=4)
    prompt = "".join(chr(97 + i % 26) for i in range(400))  # 100 chunks of 4 tokens
    sampling = {"max_tokens": 20, "temperature": 1.3, "seed": 11, "ignore_eos": True}
    bulk = message("bulk", 3, batch=True, prompt=prompt, sampling=sampling)
    queue.enqueue(bulk)
    assert wait_for(lambda: first.engine.stats()["num_prefilling"] == 1)
    vip = message("vip", 0, prompt="urgent", sampling={"max_tokens": 4, "ignore_eos": True})
    queue.enqueue(vip)
    assert wait_for(lambda: first.engine.stats()["batch_preemptions"] == 1)
    assert tokens_streamed(rclient, keys, bulk.request_id) == 0  # nothing streamed yet
    assert wait_for(lambda: ended(rclient, keys, bulk.request_id), timeout_s=30)

    engine = LLMEngine(EngineConfig(backend="reference", max_model_len=512, max_batch_size=1))
    handle = engine.submit(prompt=prompt, sampling=SamplingParams(**sampling), batch=True)
    run_until_idle(engine)
    text, tokens, alone = handle.result(timeout=1)
    events = stream(rclient, keys, bulk.request_id)
    final = events[-1][1]
    assert isinstance(final, FinalEvent) and final.finish_reason is alone.finish_reason
    assert [e.seq for _, e in events] == list(range(len(events)))
    assert "".join(e.text for _, e in events) == text
    assert final.usage.completion_tokens == len(tokens) == 20
    assert final.usage.prompt_tokens == 400
    assert stream(rclient, keys, vip.request_id)[-1][0] < events[-1][0]  # the vip ended first
    assert [u.request_id for u in first.usage] == [vip.request_id]
    assert left_to_its_step(first, rclient, keys, bulk.request_id)
    assert rclient.hlen(keys.fq("wait")) == 0 and not rclient.hgetall(keys.fq("inflight"))


def test_batch_lines_held_back_in_an_engine_leave_its_free_rows_to_interactive_requests(
        workers, rclient, keys):  # noqa: F811 - the fixture
    from tests.engine.sched.test_batch_class import FixedModel

    queue = FairQueue(rclient, keys, "tool", "vtc")
    first = workers("first", max_batch_size=4, batch_itl_slack_ms=1)
    # 10 ms a pass and 5 a row: beside an interactive row no batch row fits 1 ms of slack.
    first.engine.scheduler.admission.cost_model = FixedModel([0.010, 0.005, 0.0, 0.0, 0.0])
    stream_a = message("a", prompt="first", sampling={"max_tokens": 200, "ignore_eos": True})
    queue.enqueue(stream_a)
    assert wait_for(lambda: tokens_streamed(rclient, keys, stream_a.request_id) >= 2)
    lines = [message(f"b{i}", batch=True, sampling={"max_tokens": 3}) for i in range(3)]
    for line in lines:
        queue.enqueue(line)
    assert wait_for(lambda: first.engine.stats()["num_pending_batch"] == 3)
    assert first.engine.stats()["batch_itl_held"] > 0
    stream_b = message("b", prompt="second", sampling={"max_tokens": 3, "ignore_eos": True})
    queue.enqueue(stream_b)  # the engine's room is taken by the 3 lines: it is taken anyway
    assert wait_for(lambda: any(u.request_id == stream_b.request_id for u in first.usage))
    assert tokens_streamed(rclient, keys, stream_a.request_id) < 200  # while "a" still runs
    assert all(tokens_streamed(rclient, keys, m.request_id) == 0 for m in lines)
    assert queue.gate1() == 0  # the lines it took and holds back count in gate 1 neither
    # The lines after "a".
    assert wait_for(lambda: all(ended(rclient, keys, m.request_id) for m in lines), timeout_s=30)
    assert stream(rclient, keys, stream_a.request_id)[-1][0] < min(
        stream(rclient, keys, m.request_id)[-1][0] for m in lines)
    assert {u.request_id for u in first.usage} == {stream_a.request_id, stream_b.request_id}


def test_a_batch_message_reaches_the_engine_with_its_own_deadline_and_no_queue_one():
    from inference.worker.preparation import queue_timeout, submit_args
    from tests.support.engine import make_engine

    engine = make_engine()
    now = time.time()
    line = message("a", batch=True, queue_deadline_s=5, batch_deadline_at=now + 100)
    kwargs = submit_args(line, engine.tokenizer, engine.max_model_len)
    assert kwargs["batch"] is True and kwargs["queue_wait_s"] is None
    assert 99 < kwargs["deadline_s"] <= 100
    assert queue_timeout(line, now + 50) is None  # its queue_deadline_s counts for nothing
    expired = queue_timeout(line, now + 101)
    assert expired is not None and expired.code is ErrorCode.BATCH_EXPIRED
    interactive = submit_args(message("a", queue_deadline_s=5), engine.tokenizer, 512)
    assert interactive["batch"] is False and interactive["deadline_s"] is None
    assert 4 < interactive["queue_wait_s"] <= 5


def test_a_take_adds_batch_requests_only_once_no_interactive_one_waits(rclient, keys):
    queue = FairQueue(rclient, keys, "w", "vtc")
    first, second = message("a"), message("b")
    lines = [message("c", batch=True) for _ in range(5)]
    for m in (first, second, *lines):
        queue.enqueue(m)
    # One interactive request and up to 3 batch ones more: the order's next is interactive.
    assert ids(queue.take(1, batch_extra=3)) == [first.request_id]
    assert ids(queue.take(1, batch_extra=3)) == [second.request_id, *ids_of(lines[:3])]
    # With room for interactive requests only (above the batch tier), still the extra lines.
    assert ids(queue.take(2, BATCH_TIER, batch_extra=1)) == ids_of(lines[3:4])
    assert queue.gate1() == 2  # the two interactive ones taken; no batch line counts


def ids_of(messages) -> list[str]:
    return [m.request_id for m in messages]


def test_a_worker_holds_a_batch_of_lines_beyond_its_free_rows_and_interactive_ones_first(
        rclient, keys):
    from inference.worker.bridge import WorkerBridge

    engine = LLMEngine(EngineConfig(backend="reference", max_model_len=256, max_batch_size=2,
                                    max_pending=32))
    submitted: list[str] = []
    submit = engine.submit

    def record(**kwargs):
        submitted.append(kwargs["request_id"])
        return submit(**kwargs)

    engine.submit = record  # the engine never ticks: what it was given waits in it
    try:
        bridge = WorkerBridge(engine, rclient, keys, "w-batch", prefetch=1, batch_prefetch=4)
        queue = FairQueue(rclient, keys, "tool", "vtc")
        interactive = [message("a"), message("b")]
        lines = [message(f"line{i}", batch=True) for i in range(10)]
        for m in (*lines, *interactive):
            queue.enqueue(m)
        # 2 free rows and 1 more interactive (prefetch), or 2 and 4 more batch lines: both
        # interactive requests first, then batch lines up to 2 + 4 in all.
        assert bridge.poll() == 6
        assert submitted[:2] == ids_of(interactive)
        assert len(set(submitted[2:]) & set(ids_of(lines))) == 4
        assert bridge.poll() == 0  # the batch's worth is held: the other lines stay queued
        assert queue.gate1() == 2
    finally:
        engine.shutdown(1)


def test_every_end_of_a_batch_line_names_it_in_its_batch_s_ended_set(rclient, keys):
    queue = FairQueue(rclient, keys, "w", "fcfs")
    done = message("a", batch=True, meta={"batch_id": "batch_1"})
    other = message("b", batch=True, meta={"batch_id": "batch_2"})
    chat = message("a", meta={"batch_id": "batch_1"})  # interactive: in no batch's set
    late = message("a", batch=True, meta={"batch_id": "batch_1"},
                   batch_deadline_at=time.time() - 1)
    for m in (done, other, chat, late):
        queue.enqueue(m)
    assert queue.expire(EVENTS_TTL_S) == [late.request_id]  # ended where it waited
    taken = {q.request_id: q.take for q in queue.take(3)}
    assert set(taken) == {done.request_id, other.request_id, chat.request_id}
    assert queue.write_events([(FinalEvent(request_id=i, finish_reason=FinishReason.LENGTH), t)
                               for i, t in taken.items()], EVENTS_TTL_S) == set()

    def members(batch_id: str) -> set[str]:
        return {m.decode() for m in rclient.smembers(keys.fq("batch_ended", batch_id))}

    assert members("batch_1") == {done.request_id, late.request_id}
    assert members("batch_2") == {other.request_id}
    assert 0 < rclient.ttl(keys.fq("batch_ended", "batch_1")) <= EVENTS_TTL_S
