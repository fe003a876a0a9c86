"""One OS thread for all of an engine's tensor work: loading, calibration, ticks.

Why one thread: torch's CPU build runs its parallel regions on GNU OpenMP (libgomp), and so do
the native kernels. libgomp keeps a pool of worker threads for every OS thread that starts a
parallel region, and once the process holds more such threads than it has CPUs it stops
spinning between regions: each region then waits for its workers to be woken from a futex.
A forward pass of short matmuls runs hundreds of regions, so a model loaded on one thread and
run on another (two pools) is much slower than one loaded and run on the same thread. Measured
on a 2-core CPU, bf16 default model, a decode pass of 8 rows: 13.6 ms on the loading thread,
19.5 ms on a second thread; a packed ``[8, 576] x [576, 1536]`` product 22 us against 50 us.
A pool is freed when its thread exits, so :meth:`ComputeThread.close` ends the thread.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
# At interpreter exit, how long the running jobs get to return (seconds): a torch operation still
# running on a daemon thread while the process tears libtorch down aborts the process
# ("terminate called without an active exception").
EXIT_WAIT_S = 10.0
_threads: weakref.WeakSet[ComputeThread] = weakref.WeakSet()


@atexit.register
def _stop_at_exit() -> None:
    """Ask every compute thread's running job to stop, and wait for them (bounded)."""
    threads = list(_threads)
    for compute in threads:
        if compute.stop_running is not None:
            compute.stop_running()
        compute.close(0)
    deadline = time.monotonic() + EXIT_WAIT_S
    for compute in threads:
        compute.thread.join(max(0.0, deadline - time.monotonic()))


class ComputeThread:
    """A daemon thread that runs the callables it is given, one at a time, in order.

    It starts with the creating thread's ``torch.get_num_threads()`` (a new OS thread would
    otherwise start from OpenMP's default, every logical CPU).

    Args:
        name: the thread's name (in logs and profilers).
    """

    def __init__(self, name: str):
        import torch

        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], list, threading.Event] | None] = (
            queue.SimpleQueue())
        self._closed = False
        self._lock = threading.Lock()  # a job is never queued behind the end mark
        # Asks the long-running job (a tick loop) to return; called at interpreter exit.
        self.stop_running: Callable[[], None] | None = None
        self.thread = threading.Thread(target=self._serve, args=(torch.get_num_threads(),),
                                       name=name, daemon=True)
        self.thread.start()
        _threads.add(self)

    def _serve(self, threads: int) -> None:
        import torch

        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, box, done = job
            try:
                box.append((True, fn()))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                box.append((False, exc))
            done.set()

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the thread and return its result (or raise its exception).

        Runs it in place when called from the thread itself, or once the thread is closed.
        """
        if threading.current_thread() is self.thread:
            return fn()
        box: list = []
        done = threading.Event()
        with self._lock:
            if self._closed:
                return fn()
            self._jobs.put((fn, box, done))
        done.wait()
        ok, value = box[0]
        if ok:
            return value
        raise value

    def submit(self, fn: Callable[[], Any],
               stop: Callable[[], None] | None = None) -> threading.Event:
        """Queue ``fn`` without waiting; the returned event is set when it has returned (its
        exceptions are dropped: ``fn`` handles its own). ``stop`` asks a long-running ``fn``
        to return; it is called at interpreter exit."""
        if stop is not None:
            self.stop_running = stop
        done = threading.Event()
        with self._lock:
            if self._closed:
                raise RuntimeError("the compute thread is closed")
            self._jobs.put((fn, [], done))
        return done

    def close(self, timeout: float | None = None) -> None:
        """End the thread after the callables queued so far (its OpenMP pool goes with it);
        later :meth:`call` run in place."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._jobs.put(None)
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout)
