"""Background work at a lower CPU priority than the engine and the web tier.

:func:`run_niced` runs a job on a thread of its own whose nice value is raised, and waits for
it. On Linux a nice value belongs to a thread (``setpriority(PRIO_PROCESS, tid)``), so the
Celery process's other tasks (the dead-worker sweep, usage records) keep their priority, and the
thread lives on for the next job (its database connection with it).

Why: on a machine whose cores the engine's compute threads fill, a burst of Celery work (a batch's
validation, about 0.1 ms of CPU per line; its feeding and collecting, about 2 ms per line) takes a
core from the engine for as long as it runs, and every pass in flight, interactive requests'
included, takes that much longer. The kernel's scheduler (CFS) weighs a thread at nice 10 at 110
against 1,024 at nice 0 (``sched_prio_to_weight`` in the Linux scheduler): the job gets about a
tenth of a core the engine wants and all of one it leaves idle, so it takes longer in wall time
and the engine's passes barely move. A job that must stay bounded in wall time bounds itself
(the batch step's ``until``).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from django.db import close_old_connections

log = logging.getLogger(__name__)

T = TypeVar("T")

# The highest nice value (the lowest priority) a thread can have.
MAX_NICE = 19

_lock = threading.Lock()
# One thread per process and nice value, made in the process that uses it (a forked child
# inherits its parent's executor but not its thread): {(pid, nice): executor}.
_executors: dict[tuple[int, int], ThreadPoolExecutor] = {}


def run_niced(job: Callable[[], T], nice: int) -> T:
    """Run ``job()`` on this process's thread of nice value ``nice`` (added to the caller's,
    at most :data:`MAX_NICE`) and return what it returns; ``nice`` <= 0: here, as it is.

    The job gets the thread's own database connections, closed before and after it when
    unusable or past ``CONN_MAX_AGE``, as Celery does around a task. Where the nice value cannot
    be set (not Linux), the thread runs at the caller's priority (logged once).

    Raises:
        whatever ``job`` raises.
    """
    if nice <= 0:
        return job()
    return _executor(min(nice, MAX_NICE)).submit(_run, job).result()


def _run(job: Callable[[], T]) -> T:
    close_old_connections()
    try:
        return job()
    finally:
        close_old_connections()


def _executor(nice: int) -> ThreadPoolExecutor:
    key = (os.getpid(), nice)
    with _lock:
        executor = _executors.get(key)
        if executor is None:
            base = os.getpriority(os.PRIO_PROCESS, 0)  # the calling thread's (Linux)
            executor = _executors[key] = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix=f"niced{nice}",
                initializer=_lower_priority, initargs=(min(base + nice, MAX_NICE),))
        return executor


def _lower_priority(value: int) -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), value)
    except OSError as exc:
        log.warning("background work runs at normal priority: nice %d refused (%s)", value, exc)
