"""Backpressure: gate 1 at submit, gates 2 and 3 at admission (soft-hold and hard-reject)."""

from __future__ import annotations

import threading

import pytest

from inference.engine.llm_engine import QueueFullError
from inference.engine.request import FinishReason, SamplingParams, TokenEvent
from tests.support.engine import EventLog, make_engine, run_until_idle


def submit(engine, rid, prompt_len, max_tokens, priority=0, tenant="t"):
    return engine.submit(prompt_token_ids=[(i % 200) + 1 for i in range(prompt_len)],
                         sampling=SamplingParams(max_tokens=max_tokens), request_id=rid,
                         priority=priority, tenant=tenant)


def queues(engine):
    snap = engine.debug_snapshot()
    return {name: [r["request_id"] for r in snap[name]] for name in ("pending", "prefilling",
                                                                    "active")}


def test_nothing_is_admitted_past_a_soft_held_request():
    engine = make_engine(active_kv_budget=100, kv_num_blocks=64, max_batch_size=8)
    log = EventLog()
    submit(engine, "big", 40, 40)       # 80 of 100 tokens
    log.add(engine.step())
    submit(engine, "held", 20, 20)      # 80 + 40 > 100: soft-held by gate 2
    submit(engine, "small", 2, 2)       # would fit, but is behind the held request
    for _ in range(3):
        log.add(engine.step())
        assert queues(engine)["pending"] == ["held", "small"]
    stats = engine.stats()
    assert stats["admissions_soft_held"]["2"] >= 3
    assert stats["kv_admit_blocked"] >= 3
    assert stats["active_kv_reserved"] == 80

    run_until_idle(engine, log)
    first_token = [e.request_id for e in log.order if isinstance(e, TokenEvent) and e.seq == 0]
    assert first_token == ["big", "held", "small"]
    assert all(log.final(r).finish_reason is FinishReason.LENGTH for r in ("big", "held", "small"))
    assert engine.stats()["active_kv_reserved"] == 0


def test_a_higher_priority_arrival_may_go_ahead_of_a_soft_held_request():
    engine = make_engine(active_kv_budget=100, kv_num_blocks=64)
    log = EventLog()
    submit(engine, "big", 40, 40)
    log.add(engine.step())
    submit(engine, "held", 20, 20)
    log.add(engine.step())
    submit(engine, "urgent", 5, 5, priority=1)  # sorts ahead of "held" and fits the budget
    log.add(engine.step())
    assert "urgent" not in queues(engine)["pending"]
    assert queues(engine)["pending"] == ["held"]
    run_until_idle(engine, log)
    assert log.final("held").finish_reason is FinishReason.LENGTH


@pytest.mark.parametrize(("prompt_len", "max_tokens", "gate", "code"), [
    (60, 50, 2, "kv_budget_exceeded"),    # over the budget (100), inside the pool (256 tokens)
    (200, 100, 3, "kv_pool_exceeded"),    # over the whole pool
])
def test_a_request_that_can_never_fit_is_hard_rejected_at_once(prompt_len, max_tokens, gate,
                                                               code):
    engine = make_engine(active_kv_budget=100, kv_num_blocks=64, kv_block_size=4,
                         max_batch_size=2)
    log = EventLog()
    submit(engine, "running", 10, 30)
    submit(engine, "running2", 10, 30)       # the batch is full
    submit(engine, "never", prompt_len, max_tokens)
    submit(engine, "behind", 10, 5)
    log.add(engine.step())

    final = log.final("never")
    assert final is not None, "the hard reject must not wait for a batch slot"
    assert final.finish_reason is FinishReason.ERROR
    assert final.error.code == code and final.error.gate == gate
    assert final.error.retryable is False
    assert final.error.details["kv_demand"] == prompt_len + max_tokens
    assert str(prompt_len + max_tokens) in final.error.message
    assert final.usage.completion_tokens == 0
    assert engine.stats()["admissions_hard_rejected"][str(gate)] == 1

    run_until_idle(engine, log)
    assert log.final("behind").finish_reason is FinishReason.LENGTH
    assert len(log.tokens("behind")) == 5


def test_gate_one_refuses_past_max_pending_at_once_with_a_typed_error():
    engine = make_engine(max_pending=3)
    for i in range(3):
        submit(engine, f"r{i}", 4, 4)
    with pytest.raises(QueueFullError) as refused:
        submit(engine, "r3", 4, 4)
    assert refused.value.error.code == "queue_full" and refused.value.error.gate == 1
    assert refused.value.error.retryable
    assert refused.value.error.retryable is True
    assert engine.num_queued() == 3
    engine.step()  # admission frees queue places
    submit(engine, "r4", 4, 4)


def test_gate_one_holds_under_concurrent_submits():
    engine = make_engine(max_pending=10)
    accepted, refused = [], []
    barrier = threading.Barrier(50)

    def client(i):
        barrier.wait()
        try:
            submit(engine, f"c{i}", 4, 4)
            accepted.append(i)
        except QueueFullError:
            refused.append(i)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(accepted) == 10 and len(refused) == 40
    assert engine.num_queued() == 10
    run_until_idle(engine)
    assert engine.num_queued() == 0


def test_gate_three_never_admits_beyond_the_pool():
    # Unit-level: with a validated config gate 2 binds first; gate 3 is the pool's own guard.
    from inference.engine.kv_cache import KVCacheManager
    from inference.engine.request import Request

    kv = KVCacheManager(num_blocks=10, block_size=4)
    first = Request("a", list(range(1, 17)), SamplingParams(max_tokens=16))   # 8 blocks
    second = Request("b", list(range(1, 9)), SamplingParams(max_tokens=8))    # 4 blocks
    kv.admit(first, kv.find_cached_prefix(first))
    match = kv.find_cached_prefix(second)
    assert kv.blocks_needed(second, match) == 4
    assert kv.available_blocks() == 2
