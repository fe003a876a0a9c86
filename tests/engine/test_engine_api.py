"""The thread-safe engine API: submit, abort and stats from other threads while ticks run."""

from __future__ import annotations

import threading
import time

import pytest

from inference.engine.backends.reference import ReferenceBackend
from inference.engine.llm_engine import EngineStoppedError, InvalidRequestError
from inference.engine.request import FinalEvent, FinishReason, SamplingParams, TokenEvent
from tests.support.engine import EventLog, make_engine, run_until_idle


class GatedBackend(ReferenceBackend):
    """Blocks inside decode until released, to show the API never waits behind a tick."""

    def __init__(self):
        super().__init__()
        self.in_decode = threading.Event()
        self.release = threading.Event()

    def decode(self, rows):
        self.in_decode.set()
        assert self.release.wait(10), "the test never released the tick"
        return super().decode(rows)


def call_in_thread(fn):
    """Run ``fn`` on another thread; fail if it does not return while the tick is blocked."""
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("value", fn()))
    thread.start()
    thread.join(5)
    assert not thread.is_alive(), f"{fn} waited for the tick"
    return result.get("value")


def test_submit_abort_and_stats_never_wait_for_a_tick():
    backend = GatedBackend()
    engine = make_engine(backend, prefill_mode="chunked")  # the first tick has a decode pass
    engine.start()
    first = engine.submit(prompt="hello", sampling=SamplingParams(max_tokens=50))
    assert backend.in_decode.wait(5)
    # The worker thread is now inside a tick, holding the backend.
    stats = call_in_thread(engine.stats)
    assert stats["tick_count"] == 0  # the snapshot published before this (first) tick
    second = call_in_thread(lambda: engine.submit(prompt="world",
                                                  sampling=SamplingParams(max_tokens=3)))
    call_in_thread(lambda: engine.abort(first.request_id))
    backend.release.set()
    _, _, final = first.result(timeout=10)
    assert final.finish_reason is FinishReason.ABORT
    _, tokens, final = second.result(timeout=10)
    assert final.finish_reason is FinishReason.LENGTH and len(tokens) == 3
    engine.shutdown()


@pytest.mark.parametrize("phase", ["pending", "prefilling", "active"])
def test_abort_in_any_phase_frees_the_reservation_and_ends_with_one_final_event(phase):
    engine = make_engine(prefill_chunk_size=4, active_kv_budget=300, kv_num_blocks=256)
    log = EventLog()
    engine.submit(prompt_token_ids=[1] * 40, request_id="blocker",
                  sampling=SamplingParams(max_tokens=200 if phase == "pending" else 5))
    engine.submit(prompt_token_ids=[2] * 40, request_id="victim",
                  sampling=SamplingParams(max_tokens=50))
    for _ in range(30):
        log.add(engine.step())
        snap = engine.debug_snapshot()
        if "victim" in [r["request_id"] for r in snap[phase]]:
            break
    else:
        pytest.fail(f"victim never reached {phase}")
    computed = next(r for r in snap[phase] if r["request_id"] == "victim")["num_computed_tokens"]
    reserved_before = engine.stats()["active_kv_reserved"]
    engine.abort("victim")
    log.add(engine.step())
    final = log.final("victim")
    assert final is not None and final.finish_reason is FinishReason.ABORT
    # Billed for the prompt tokens computed before the stop: none while pending, part of the
    # prompt while prefilling, all of it once it decodes.
    expected_prompt = {"pending": 0, "prefilling": computed, "active": 40}[phase]
    assert final.usage.prompt_tokens == expected_prompt
    if phase == "prefilling":
        assert 0 < computed < 40
    if phase != "pending":
        assert engine.stats()["active_kv_reserved"] <= reserved_before - 90
    run_until_idle(engine, log)
    assert engine.stats()["active_kv_reserved"] == 0
    assert engine.stats()["kv_blocks_held"] == 0
    assert [e for e in log.by_request["victim"] if isinstance(e, FinalEvent)] == [final]


def test_concurrent_clients_each_receive_exactly_their_own_tokens_in_order():
    engine = make_engine(max_batch_size=4)
    engine.start()
    prompts = {f"c{i}": f"client number {i} says hi" for i in range(12)}
    expected = {}
    solo = make_engine()
    for rid, prompt in prompts.items():
        h = solo.submit(prompt=prompt, request_id=rid, sampling=SamplingParams(max_tokens=20))
        run_until_idle(solo)
        expected[rid] = h.result(timeout=1)[1]
    results = {}

    def client(rid):
        handle = engine.submit(prompt=prompts[rid], request_id=rid,
                               sampling=SamplingParams(max_tokens=20))
        seqs, tokens = [], []
        for event in handle.events(timeout=10):
            assert event.request_id == rid
            seqs.append(event.seq)
            if isinstance(event, TokenEvent):
                tokens.append(event.token_id)
        results[rid] = (seqs, tokens)

    threads = [threading.Thread(target=client, args=(rid,)) for rid in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    engine.shutdown()
    for rid in prompts:
        seqs, tokens = results[rid]
        assert seqs == list(range(21))
        assert tokens == expected[rid]


def test_a_prompt_beyond_the_context_is_refused_with_both_numbers():
    engine = make_engine(backend=ReferenceBackend(max_model_len=100))
    with pytest.raises(InvalidRequestError) as refused:
        engine.submit(prompt_token_ids=[1] * 90, sampling=SamplingParams(max_tokens=20))
    error = refused.value.error
    assert error.code == "context_length_exceeded" and not error.retryable
    assert "90" in error.message and "100" in error.message
    with pytest.raises(InvalidRequestError):
        engine.submit(prompt="", sampling=SamplingParams(max_tokens=2))


def test_shutdown_hands_back_pending_requests_and_fails_in_flight_ones():
    engine = make_engine(max_batch_size=1)
    running = engine.submit(prompt_token_ids=[1, 2, 3], request_id="running",
                            sampling=SamplingParams(max_tokens=100))
    engine.submit(prompt_token_ids=[4, 5, 6], request_id="waiting",
                  sampling=SamplingParams(max_tokens=100))
    engine.step()
    withdrawn = engine.shutdown()
    assert [r.request_id for r in withdrawn] == ["waiting"]
    _, _, final = running.result(timeout=1)
    assert final.finish_reason is FinishReason.ERROR
    assert final.error.code == "worker_shutdown" and final.error.retryable
    with pytest.raises(EngineStoppedError):
        engine.submit(prompt="late", sampling=SamplingParams(max_tokens=1))
    assert engine.stats()["active_kv_reserved"] == 0


class FailingBackend(ReferenceBackend):
    def decode(self, rows):
        if any(r.row_id == "poison" for r in rows):
            raise RuntimeError("boom")
        return super().decode(rows)


def test_a_backend_failure_ends_the_affected_rows_and_the_engine_keeps_serving():
    engine = make_engine(FailingBackend())
    log = EventLog()
    engine.submit(prompt="x", request_id="poison", sampling=SamplingParams(max_tokens=5))
    run_until_idle(engine, log)
    assert log.final("poison").error.code == "engine_error"
    engine.submit(prompt="y", request_id="fine", sampling=SamplingParams(max_tokens=5))
    run_until_idle(engine, log)
    assert log.final("fine").finish_reason is FinishReason.LENGTH
    assert engine.stats()["active_kv_reserved"] == 0


def test_a_request_waiting_past_the_queue_deadline_ends_with_a_clear_error():
    engine = make_engine(max_batch_size=1)
    log = EventLog()
    engine.submit(prompt_token_ids=[1], request_id="slow", sampling=SamplingParams(max_tokens=400),
                  queue_wait_s=0.05)
    engine.submit(prompt_token_ids=[2], request_id="late", sampling=SamplingParams(max_tokens=2),
                  queue_wait_s=0.05)
    engine.submit(prompt_token_ids=[3], request_id="patient", sampling=SamplingParams(max_tokens=2))
    log.add(engine.step())
    import time

    time.sleep(0.1)
    log.add(engine.step())
    final = log.final("late")
    assert final.error.code == "queue_timeout" and final.error.retryable
    assert log.final("patient") is None, "a request without a deadline keeps waiting"
    assert log.final("slow") is None, "an admitted request is past its admission deadline"
    engine.abort("slow")
    run_until_idle(engine, log)
    assert log.final("patient").finish_reason is FinishReason.LENGTH


def test_stats_report_the_documented_fields():
    engine = make_engine(scheduling_policy="vtc")
    engine.submit(prompt="abc", tenant="acme", sampling=SamplingParams(max_tokens=3))
    run_until_idle(engine)
    stats = engine.stats()
    for field in ("kv_pressure", "active_kv_reserved", "kv_admit_blocked", "num_pending",
                  "num_prefilling", "num_active", "tick_count", "tokens_generated",
                  "admissions_soft_held", "admissions_hard_rejected", "kv_blocks_free",
                  "kv_blocks_evictable", "kv_blocks_held", "prefix_hit_rate"):
        assert field in stats
    assert stats["tokens_generated"] == 3
    acme = stats["per_key"]["acme"]
    assert acme["tokens_served"] == 3 + 3 and acme["in_flight"] == 0
    assert acme["vtc_counter"] == pytest.approx(3 * 1.0 + 3 * 2.0)


def test_a_first_token_reaches_its_client_before_the_ticks_decode_step():
    # A long decode step (many rows, a slow model) must not delay a new request's first token:
    # it is delivered as soon as the prefill that produced it ends.
    backend = GatedBackend()
    sunk: list[list] = []
    engine = make_engine(backend, prefill_chunk_size=64, prefill_mode="chunked")
    engine.event_sink = sunk.append
    engine.start()
    handle = engine.submit(prompt="hello there", sampling=SamplingParams(max_tokens=5))
    assert backend.in_decode.wait(5)
    # The tick that promoted the row is now blocked in its decode step.
    first = next(handle.events(timeout=5))
    assert isinstance(first, TokenEvent) and first.seq == 0
    assert [type(e) for batch in sunk for e in batch] == [TokenEvent]
    backend.release.set()
    _, rest, final = handle.result(timeout=10)  # the events after the one read above
    assert final.finish_reason is FinishReason.LENGTH and len([first, *rest]) == 5
    engine.shutdown()


def test_uptime_grows_while_the_engine_is_idle():
    # The snapshot is built after each tick; an idle engine runs none, but its uptime goes on.
    engine = make_engine()
    engine.start()
    try:
        first = engine.stats()["uptime_s"]
        time.sleep(0.3)
        assert engine.stats()["uptime_s"] >= first + 0.25
    finally:
        engine.shutdown()
