"""An engine does all its tensor work on one OS thread (``inference.engine.compute_thread``).

Why it matters: with the model loaded on one thread and run on another, torch's OpenMP runtime
keeps two worker pools and stops spinning between parallel regions, and a decode pass gets
about 40 % slower on a 2-core CPU (``benchmarks/serving/overhead.py``, ``docs/engine.md``).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from inference.engine.backends.reference import ReferenceBackend
from inference.engine.compute_thread import ComputeThread
from inference.engine.config import EngineConfig
from inference.engine.llm_engine import LLMEngine
from inference.engine.request import FinalEvent, SamplingParams


@pytest.fixture
def backend_threads(monkeypatch) -> list[tuple[str, int]]:
    """(method, thread id) of every call into the reference backend's model work."""
    seen: list[tuple[str, int]] = []
    for name in ("__init__", "prefill", "decode", "prefill_and_decode"):
        original = getattr(ReferenceBackend, name)

        def spy(self, *args, _original=original, _name=name, **kwargs):
            seen.append((_name, threading.get_ident()))
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(ReferenceBackend, name, spy)
    return seen


def finish(engine: LLMEngine, handle, driven: bool) -> list:
    if driven:
        while not any(isinstance(e, FinalEvent) for e in engine.step()):
            pass
    return list(handle.events(timeout=10))


@pytest.mark.parametrize("driven", [True, False], ids=["step", "start"])
def test_an_engine_loading_its_backend_loads_and_ticks_on_one_thread_not_the_callers(
        backend_threads, driven):
    engine = LLMEngine(EngineConfig(backend="reference"))
    if not driven:
        engine.start()
    handle = engine.submit(prompt_token_ids=[5, 6, 7], sampling=SamplingParams(max_tokens=4))
    events = finish(engine, handle, driven)
    assert events[-1].finish_reason == "length" and len(events) == 5
    compute = engine._compute.thread
    engine.shutdown()
    names = {name for name, _ in backend_threads}
    assert "__init__" in names and names - {"__init__"}, backend_threads
    assert {ident for _, ident in backend_threads} == {compute.ident}
    assert compute.ident != threading.get_ident()
    assert not compute.is_alive()  # shutdown ended it (and its OpenMP pool)


def test_an_engine_given_a_backend_steps_on_the_callers_thread(backend_threads):
    engine = LLMEngine(EngineConfig(backend="reference"), ReferenceBackend())
    handle = engine.submit(prompt_token_ids=[5, 6, 7], sampling=SamplingParams(max_tokens=3))
    finish(engine, handle, driven=True)
    assert {ident for _, ident in backend_threads} == {threading.get_ident()}


def test_a_backend_that_fails_to_load_raises_in_the_caller_and_leaves_no_thread(monkeypatch):
    before = set(threading.enumerate())

    def broken(*args, **kwargs):
        raise RuntimeError("no such model")

    monkeypatch.setattr(ReferenceBackend, "__init__", broken)
    with pytest.raises(RuntimeError, match="no such model"):
        LLMEngine(EngineConfig(backend="reference"))
    for thread in set(threading.enumerate()) - before:
        thread.join(5)
        assert not thread.is_alive(), thread.name


def test_the_compute_thread_returns_results_raises_errors_and_runs_in_place_once_closed():
    compute = ComputeThread("test-compute")
    assert compute.call(threading.get_ident) == compute.thread.ident != threading.get_ident()
    with pytest.raises(ZeroDivisionError):
        compute.call(lambda: 1 / 0)
    order: list[int] = []
    compute.submit(lambda: order.append(1))
    assert compute.call(lambda: order.append(2) or order) == [1, 2]  # in order
    compute.close(timeout=5)
    assert not compute.thread.is_alive()
    assert compute.call(threading.get_ident) == threading.get_ident()
    with pytest.raises(RuntimeError, match="closed"):
        compute.submit(lambda: None)


@pytest.mark.parametrize("own_backend", [True, False], ids=["loaded", "given"])
def test_shutdown_waits_for_a_tick_that_outlasts_its_timeout_and_ends_each_request_once(
        caplog, own_backend):
    config = EngineConfig(backend="reference", reference_step_delay_s=0.5)
    engine = LLMEngine(config) if own_backend else LLMEngine(
        config, ReferenceBackend(step_delay_s=0.5))
    handles = [engine.submit(prompt_token_ids=[5, 6, 7], sampling=SamplingParams(max_tokens=50))
               for _ in range(3)]
    engine.start()
    time.sleep(0.2)  # the first tick (all three admitted) is in its pass: 0.5 s
    assert engine.shutdown(timeout=0.05) == []
    for handle in handles:
        finals = [e for e in handle.events(timeout=5) if isinstance(e, FinalEvent)]
        assert [f.error.code for f in finals] == ["worker_shutdown"]
    assert "tick failed" not in caplog.text and "outlasted" in caplog.text
    snapshot = engine.debug_snapshot()
    assert not snapshot["active"] and not snapshot["prefilling"] and not snapshot["pending"]
    assert snapshot["kv_blocks_held"] == 0 and snapshot["active_kv_reserved"] == 0


def test_withdrawing_when_no_tick_comes_in_time_calls_the_withdrawal_off():
    engine = LLMEngine(EngineConfig(backend="reference", reference_step_delay_s=0.5,
                                    max_batch_size=1))
    first = engine.submit(prompt_token_ids=[5, 6], sampling=SamplingParams(max_tokens=3))
    second = engine.submit(prompt_token_ids=[5, 7], sampling=SamplingParams(max_tokens=3))
    engine.start()
    time.sleep(0.2)  # the first tick runs for 0.5 s; the second request waits in pending
    assert engine.withdraw_pending(timeout=0.05) == []
    # Called off, not lost: the waiting request is still the engine's and is served.
    assert list(second.events(timeout=10))[-1].finish_reason == "length"
    assert list(first.events(timeout=10))[-1].finish_reason == "length"
    engine.shutdown()


def test_at_exit_the_running_job_is_asked_to_stop_and_returns_before_the_interpreter_goes():
    """A tick still running while the interpreter tears libtorch down aborts the process
    ("terminate called without an active exception"): the running job is asked to stop and
    waited for first."""
    script = (
        "import threading, time\n"
        "from inference.engine.compute_thread import ComputeThread\n"
        "stop = threading.Event()\n"
        "def loop():\n"
        "    while not stop.is_set():\n"
        "        time.sleep(0.01)\n"
        "    time.sleep(0.2)  # the tick in progress\n"
        "    print('loop returned', flush=True)\n"
        "ComputeThread('t').submit(loop, stop=stop.set)\n"
        "time.sleep(0.1)\n"
        "print('exiting', flush=True)\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).parents[2],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["exiting", "loop returned"]
