"""What an interactive arrival waits for beside batch work (``docs/design.md``, "The batch
service class"): a pass of batch rows alone gives way to it (it waits a layer of that pass, not
the whole pass; the stopped pass counts for nothing, and the batch rows answer exactly as if it
had never run), and the pass that computes its prompt carries no batch row."""

from __future__ import annotations

import threading

from inference.engine.backends.reference import ReferenceBackend
from inference.engine.request import FinalEvent, TokenEvent
from tests.engine.sched.test_batch_class import MODEL, submit
from tests.engine.sched.test_preemption import decoding, step_until
from tests.support.engine import EventLog, make_engine, run_until_idle

PASS_S = 30.0  # a pass that would hold the test far past its timeout if it did not give way


def bulk(engine, n: int = 2) -> None:
    for i in range(n):
        submit(engine, f"bulk{i}", batch=True, key=f"k{i}:batch", max_tokens=6, ignore_eos=True)


def step_in_thread(engine):
    out: list = []
    thread = threading.Thread(target=lambda: out.append(engine.step()), daemon=True)
    thread.start()
    return thread, out


def batch_tokens_alone() -> dict[str, list[int]]:
    engine = make_engine(batch_yield_s=0)
    log = EventLog()
    bulk(engine)
    run_until_idle(engine, log)
    return {f"bulk{i}": log.tokens(f"bulk{i}") for i in range(2)}


def test_a_batch_pass_stops_for_an_interactive_arrival_and_its_rows_answer_as_alone():
    backend = ReferenceBackend()
    engine = make_engine(backend, batch_yield_s=0)
    log = EventLog()
    bulk(engine)
    log.add(engine.step())  # the batch rows' prompts: they decode from the next pass
    backend.step_delay_s = PASS_S
    thread, out = step_in_thread(engine)
    submit(engine, "stream", max_tokens=3)  # arrives while the batch pass runs
    thread.join(timeout=10)
    assert not thread.is_alive(), "the batch pass did not give way"
    backend.step_delay_s = 0.0
    assert out == [[]]  # the stopped pass: no token, no event
    assert engine.stats()["batch_passes_yielded"] == 1
    log.add(engine.step())  # the next tick admits the arrival and prefills it
    assert any(isinstance(e, TokenEvent) and e.request_id == "stream" for e in log.order)
    run_until_idle(engine, log)
    assert isinstance(log.final("stream"), FinalEvent)
    assert {f"bulk{i}": log.tokens(f"bulk{i}") for i in range(2)} == batch_tokens_alone()


def test_a_pass_holding_an_interactive_row_runs_whole_and_a_batch_arrival_stops_nothing():
    backend = ReferenceBackend()
    engine = make_engine(backend, batch_yield_s=0)
    log = EventLog()
    bulk(engine)
    submit(engine, "stream", max_tokens=8)
    log.add(engine.step())
    backend.step_delay_s = 0.5
    thread, out = step_in_thread(engine)  # the stream decodes in this pass
    submit(engine, "late", max_tokens=3)
    thread.join(timeout=10)
    backend.step_delay_s = 0.0
    log.add(out[0])
    assert engine.stats()["batch_passes_yielded"] == 0
    assert any(isinstance(e, TokenEvent) and e.request_id == "stream" for e in out[0])
    run_until_idle(engine, log)
    assert all(isinstance(log.final(r), FinalEvent) for r in ("stream", "late", "bulk0", "bulk1"))


def test_a_batch_arrival_does_not_stop_a_batch_pass():
    backend = ReferenceBackend()
    engine = make_engine(backend, batch_yield_s=0)
    log = EventLog()
    bulk(engine)
    log.add(engine.step())
    backend.step_delay_s = 0.5
    thread, out = step_in_thread(engine)
    submit(engine, "bulk9", batch=True, key="k9:batch", max_tokens=6, ignore_eos=True)
    thread.join(timeout=10)
    backend.step_delay_s = 0.0
    assert engine.stats()["batch_passes_yielded"] == 0
    assert any(isinstance(e, TokenEvent) for e in out[0])  # the pass ran: its rows decoded


def test_a_pass_that_computes_an_interactive_prompt_carries_no_batch_row():
    # Two batch rows decode, and a third batch prompt waits, while a stream's prompt arrives:
    # the pass of that prompt holds it alone (no batch decode row, no batch prompt token),
    # whatever the cost model allows beside it; the batch goes on in the next passes.
    engine = make_engine(max_batch_size=8, batch_yield_s=5, batch_itl_slack_fraction=10.0)
    engine.scheduler.admission.cost_model = engine.scheduler.mixed.cost_model = MODEL
    log = EventLog()
    bulk(engine)
    step_until(engine, log, lambda: all(decoding(engine, f"bulk{i}") for i in range(2)))
    submit(engine, "bulk2", batch=True, key="k2:batch", max_tokens=6, ignore_eos=True,
           prompt=list(range(1, 40)))
    submit(engine, "stream", max_tokens=3, prompt=[7, 8, 9])
    log.add(engine.step())
    assert engine.stats()["tick_budget"]["last_pass"] == {
        **engine.stats()["tick_budget"]["last_pass"], "decode_rows": 0, "prefill_tokens": 3}
    assert any(isinstance(e, TokenEvent) and e.request_id == "stream" for e in log.order)
    log.add(engine.step())  # the stream decodes: batch rows may join within the slack again
    assert engine.stats()["tick_budget"]["last_pass"]["decode_rows"] > 1
    run_until_idle(engine, log)
    assert all(isinstance(log.final(r), FinalEvent) for r in ("stream", "bulk0", "bulk1", "bulk2"))


def test_the_pass_after_one_that_gave_way_runs_whole():
    # However often arrivals come, batch work moves: a batch pass that follows one that gave
    # way is not stopped.
    backend = ReferenceBackend()
    engine = make_engine(backend, batch_yield_s=0)
    log = EventLog()
    bulk(engine)
    log.add(engine.step())
    engine.scheduler.mixed._gave_way = True  # as after a pass that gave way
    backend.step_delay_s = 0.3
    thread, out = step_in_thread(engine)
    submit(engine, "stream", max_tokens=3)
    thread.join(timeout=10)
    backend.step_delay_s = 0.0
    assert engine.stats()["batch_passes_yielded"] == 0
    assert any(isinstance(e, TokenEvent) for e in out[0])


def test_a_stream_of_interactive_prompt_passes_lets_batch_rows_in_now_and_then():
    # A long interactive prompt computed over many passes: every PROMPT_PASSES_WITHOUT_BATCH
    # passes, one carries the batch rows again (within the ceiling), so they never starve.
    from inference.engine.sched.mixed_tick import PROMPT_PASSES_WITHOUT_BATCH

    engine = make_engine(max_batch_size=8, batch_yield_s=5, batch_itl_slack_fraction=10.0,
                         target_itl_ms=0.001)
    engine.scheduler.admission.cost_model = engine.scheduler.mixed.cost_model = MODEL
    log = EventLog()
    bulk(engine)
    step_until(engine, log, lambda: all(decoding(engine, f"bulk{i}") for i in range(2)))
    submit(engine, "long", max_tokens=2, prompt=[(i % 90) + 5 for i in range(200)])
    rows_per_pass = []
    while not any(isinstance(e, TokenEvent) and e.request_id == "long" for e in log.order):
        log.add(engine.step())
        rows_per_pass.append(engine.stats()["tick_budget"]["last_pass"]["decode_rows"])
    assert len(rows_per_pass) > PROMPT_PASSES_WITHOUT_BATCH + 1
    assert rows_per_pass[:PROMPT_PASSES_WITHOUT_BATCH] == [0] * PROMPT_PASSES_WITHOUT_BATCH
    assert rows_per_pass[PROMPT_PASSES_WITHOUT_BATCH] > 0
