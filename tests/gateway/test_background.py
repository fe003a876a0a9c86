"""Background work runs below the engine's and the web tier's CPU priority
(:mod:`gateway.background`), on a thread of its own, and the Batch API's step runs there."""

from __future__ import annotations

import os
import threading

import pytest

from api import batch_runner, tasks
from gateway.background import MAX_NICE, run_niced


def nice_here() -> int:
    return os.getpriority(os.PRIO_PROCESS, 0)  # the calling thread's (Linux)


def test_a_job_runs_at_the_raised_nice_value_and_its_caller_keeps_its_own():
    base = nice_here()
    seen = run_niced(lambda: (nice_here(), threading.get_native_id()), 5)
    assert seen[0] == min(base + 5, MAX_NICE)
    assert seen[1] != threading.get_native_id()
    assert nice_here() == base
    again = run_niced(lambda: threading.get_native_id(), 5)
    assert again == seen[1]  # the same thread, kept for the next job


def test_a_job_s_error_reaches_its_caller_and_the_thread_serves_the_next():
    def broken() -> None:
        raise ValueError("no")

    with pytest.raises(ValueError, match="no"):
        run_niced(broken, 3)
    assert run_niced(lambda: 42, 3) == 42


def test_nice_zero_runs_the_job_in_place():
    assert run_niced(threading.get_native_id, 0) == threading.get_native_id()


def test_the_batch_step_runs_at_the_batch_step_nice_value(settings, monkeypatch):
    settings.LLM_PLATFORM = {**settings.LLM_PLATFORM, "BATCH_STEP_NICE": 7}
    monkeypatch.setattr(batch_runner, "advance_all", nice_here)
    assert tasks.advance_batches() == min(nice_here() + 7, MAX_NICE)
