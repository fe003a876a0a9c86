"""The thread-safe engine: submit, abort and stats from any thread; one worker thread ticks.

Submit, abort and stats never wait behind a tick: submissions and aborts go into an inbox that
the worker drains at the start of each tick, and a stats snapshot is published after each tick.
An engine that loads its own backend does all its tensor work (loading, calibration, ticks,
:meth:`LLMEngine.step`) on one thread of its own (:mod:`inference.engine.compute_thread`).

Example::

    engine = LLMEngine(EngineConfig(backend="reference")); engine.start()
    handle = engine.submit(prompt="Hello", sampling=SamplingParams(max_tokens=8))
    text, token_ids, final_event = handle.result(timeout=10)  # or: for event in handle.events()
    engine.shutdown()
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from inference.engine.backends.base import ModelBackend
from inference.engine.compute_thread import ComputeThread
from inference.engine.config import EngineConfig
from inference.engine.request import (
    AdapterSpec,
    Event,
    FinalEvent,
    Request,
    ResumeState,
    SamplingParams,
)
from inference.engine.sched.outputs import tick_failed, worker_shutdown
from inference.engine.sched.preemption import for_another_engine
from inference.engine.sched.scheduler import Scheduler
from inference.engine.structured.compiler import GrammarCompiler
from inference.engine.submission import (
    EngineRefusal,
    EngineStoppedError,
    GrammarBusyError,
    InvalidRequestError,
    QueueFullError,
    RequestHandle,
    build_request,
    checked_adapter,
    gate_one_refusal,
)

__all__ = ["EngineRefusal", "EngineStoppedError", "EventSink", "GrammarBusyError",
           "InvalidRequestError", "LLMEngine", "PreemptSink", "QueueFullError", "RequestHandle"]

log = logging.getLogger(__name__)

EventSink = Callable[[list[Event]], None]  # see LLMEngine
# Called on the worker thread with a tick's preempted requests, each as another engine needs it.
PreemptSink = Callable[[list[ResumeState]], None]
# Seconds shutdown waits more for a tick that outlasted its timeout (then leaves its requests).
TICK_END_WAIT_S = 120.0


class LLMEngine:
    """A scheduler and a backend behind a thread-safe API.

    Args:
        config: engine settings; see :class:`inference.engine.config.EngineConfig`.
        backend: the model; by default loaded from ``config`` (``BACKEND``, ``MODEL_PATH``).
        event_sink: called on the worker thread with each tick's events, in order (for the
            Redis bridge): once with the events before the tick's decode step (first tokens)
            when there are any, once with the rest; events also go to each request's handle.
        preempt_sink: see :attr:`preempt_sink`.

    Raises:
        ValueError: if the KV pool cannot hold the active-KV budget.
    """

    def __init__(self, config: EngineConfig | None = None, backend: ModelBackend | None = None,
                 event_sink: EventSink | None = None, preempt_sink: PreemptSink | None = None):
        self.config = config = config or EngineConfig()
        # Loading its own backend, the engine does every tensor operation on one thread.
        self._compute = ComputeThread("engine-compute") if backend is None else None
        if self._compute is not None:  # an engine dropped without shutdown frees it too
            weakref.finalize(self, self._compute.close, 0)
        try:
            self.backend, self.scheduler = self._on_compute(lambda: self._load(config, backend))
        except BaseException:
            self._close_compute()
            raise
        self.tokenizer = self.backend.tokenizer
        self.event_sink, self.preempt_sink = event_sink, preempt_sink
        self.scheduler.state.arrivals = lambda: self._inbox  # a batch pass gives way to them

        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        if (pool := self.scheduler.state.adapters) is not None:  # an adapter's files read
            pool.notify = self._wakeup.set
        self._inbox: list[tuple[str, Any]] = []
        self.grammars = GrammarCompiler(self.tokenizer, self.backend.vocab_size, config)
        self._handles: dict[str, RequestHandle] = {}
        self._queued = 0  # gate 1: submitted and not yet admitted or ended
        self._stopping = False
        self._loop_done: threading.Event | None = None
        self._started_at = time.time()
        self._tick_seconds = self._tick_seconds_total = 0.0  # the last tick's; all ticks' (s)
        self._stats = self._build_stats()

    @property
    def preempt_sink(self) -> PreemptSink | None:
        """Where preempted requests go. None: back to this engine's pending queue. Set (a
        worker's Redis bridge): each leaves the engine (no event: its client sees a pause) and goes
        to the sink after its tick, with what another engine needs to continue it
        (``submit(resume=...)``). Set it before :meth:`start`."""
        return self._preempt_sink

    @preempt_sink.setter
    def preempt_sink(self, sink: PreemptSink | None) -> None:
        self._preempt_sink = sink
        self.scheduler.hand_out_preempted = sink is not None

    def submit(self, *, prompt_token_ids: Sequence[int] | None = None, prompt: str | None = None,
               messages: Sequence[dict[str, str]] | None = None,
               sampling: SamplingParams | None = None, tenant: str = "default",
               fairness_key: str = "", priority: int = 0, fairness_weight: float = 1.0,
               request_id: str | None = None, queue_wait_s: float | None = None,
               resume: ResumeState | None = None, batch: bool = False,
               deadline_s: float | None = None, adapter: AdapterSpec | None = None
               ) -> RequestHandle:
        """Queue a request; never waits for a tick.

        Exactly one of ``prompt_token_ids``, ``prompt`` (text) or ``messages`` (chat, rendered
        with the model's chat template) is given. ``priority`` is the tier (higher first);
        ``fairness_key`` defaults to the tenant; ``fairness_weight`` scales its VTC share.
        ``queue_wait_s``: seconds from now within which it must be admitted, else it ends with
        ``queue_timeout`` (None: no deadline; 0 or less: already past it).
        ``resume``: the state of a request preempted on this engine or another (handed to the
        :attr:`preempt_sink`): it continues from there, with its original prompt given here and
        ``resume.sampling`` (``sampling`` ignored). ``batch``: the batch service class
        (``queue_wait_s`` ignored; past ``deadline_s``, seconds from now, it ends with
        ``batch_expired`` in any phase; ``docs/design.md``, "The batch service class").
        ``adapter``: the LoRA adapter it runs under (None: the bare model).

        Returns:
            A handle whose :meth:`RequestHandle.events` yields the request's events.

        Raises:
            InvalidRequestError: empty prompt, ``prompt_len + max_tokens`` beyond the context,
                a ``resume`` that does not match the prompt, or ``n`` beyond max_batch_size.
            QueueFullError: ``max_pending`` requests wait (gate 1 of an engine on its own).
            EngineStoppedError: the engine is shutting down.
            GrammarBusyError: its tenant has ``STRUCTURED_COMPILES_PER_TENANT`` grammars
                compiling here (``grammar_busy``); a constrained request waits for its grammar,
                compiled on :attr:`grammars`' threads, before it joins the queue.
        """
        request = build_request(
            self.tokenizer, self.scheduler.eos_token_ids, self.max_model_len,
            prompt_token_ids=prompt_token_ids, prompt=prompt, messages=messages,
            sampling=sampling, tenant=tenant, fairness_key=fairness_key, priority=priority,
            fairness_weight=fairness_weight, request_id=request_id, queue_wait_s=queue_wait_s,
            resume=resume, clock=self.scheduler.clock, max_n=self.config.max_batch_size,
            batch=batch, deadline_s=deadline_s)
        request.adapter = adapter and checked_adapter(adapter, self.scheduler.state.adapters)
        handle = RequestHandle(request.request_id,
                               resume.prompt_len if resume is not None else request.prompt_len)
        with self._lock:
            refusal = gate_one_refusal(self._stopping, self._queued, self.config.max_pending,
                                       request.request_id in self._handles, request.request_id)
            if refusal is not None:
                raise refusal
            self._queued += 1
            self._handles[request.request_id] = handle
            constrained = request.sampling.structured is not None and request.grammar is None
            if not constrained:
                self._inbox.append(("submit", request))
        # A constrained request joins the inbox once its grammar is compiled (at once if cached).
        busy = constrained and self.grammars.start(request, partial(self._inbox_add, "submit"))
        if busy:
            with self._lock:
                self._queued -= 1
                self._handles.pop(request.request_id, None)
            raise GrammarBusyError(busy)
        self._wakeup.set()
        return handle

    def _inbox_add(self, kind: str, item: Any) -> None:  # from any thread
        with self._lock:
            self._inbox.append((kind, item))
        self._wakeup.set()

    def abort(self, request_id: str) -> None:
        """End a request in any phase (final event ``abort``); unknown or ended ids are ignored."""
        self.grammars.abort(request_id)  # one compiling ends as it joins the queue
        self._inbox_add("abort", request_id)

    def withdraw_pending(self, timeout: float = 5.0) -> list[Request]:
        """Take out and return the requests not yet admitted (no event emitted for them),
        between ticks; none if no tick began within ``timeout`` seconds. A draining worker hands
        them to another worker while its running requests finish."""
        box, done = item = ([], threading.Event())
        self._inbox_add("withdraw", item)
        if self._loop_done is None:
            self._drain_inbox()
            self._after_tick([])
        if not done.wait(timeout):
            with self._lock:  # not taken by a tick yet: called off (a taken one ends at once)
                if any(queued[1] is item for queued in self._inbox):
                    self._inbox = [queued for queued in self._inbox if queued[1] is not item]
                    return []
            done.wait()
        return box

    def num_queued(self) -> int:
        """Gate 1's figure: requests submitted and not yet admitted (or ended)."""
        with self._lock:
            return self._queued

    def stats(self) -> dict[str, Any]:
        """The stats snapshot published after the latest tick (never waits for a tick)."""
        snapshot = dict(self._stats, num_queued=self.num_queued())
        snapshot["uptime_s"] = time.time() - self._started_at  # now, not at that tick
        return snapshot

    def debug_snapshot(self) -> dict[str, Any]:
        """Queue membership and reservations; only consistent between ticks (tests, ``step``)."""
        return self.scheduler.debug_snapshot()

    def step(self) -> list[Event]:
        """Drain the inbox and run one tick on the calling thread; return its events.

        For tests and benchmarks that drive the engine synchronously; do not mix with
        :meth:`start`. An engine that loaded its own backend runs the tick on its compute thread.
        """
        return self._on_compute(self._step)

    def _step(self) -> list[Event]:
        self._drain_inbox()
        started = time.perf_counter()
        early: list[Event] = []

        def emit_early(events: list[Event]) -> None:  # first tokens: before the decode step
            early.extend(events)
            self._emit(events)

        events = self.scheduler.step(emit_early)
        self._tick_seconds = time.perf_counter() - started
        self._tick_seconds_total += self._tick_seconds
        self._after_tick(events)
        return early + events

    def has_work(self) -> bool:  # a request queued, running, or waiting for its grammar
        if self.grammars.compiling() > 0:  # first: a compile joins the inbox, then ends
            return True
        return self._has_tick_work() or self.scheduler.has_work()

    def _has_tick_work(self) -> bool:
        with self._lock:
            return bool(self._inbox) or self.scheduler.state.has_tick_work()

    def start(self) -> None:
        """Start the worker thread that ticks while there is work (the compute thread; one of
        its own for an engine given its backend)."""
        if self._loop_done is not None:
            return
        self.grammars.warm_up()  # structured outputs: ready before they come
        if self._compute is None:
            self._compute = ComputeThread("engine-worker")
        self._loop_done = self._compute.submit(self._run, stop=self._ask_stop)

    def shutdown(self, timeout: float = 10.0) -> list[Request]:
        """Stop taking work; end in-flight requests with a ``worker_shutdown`` error event.

        The loop stops after its tick in progress, waited for ``timeout`` seconds and then up to
        :data:`TICK_END_WAIT_S` more (logged); never ended under a running tick.

        Returns:
            Pending requests that were never admitted, withdrawn without any event, so the
            caller can hand them to another worker.
        """
        self._ask_stop()
        # The loop ends after the tick in progress; ending the requests meanwhile would race it.
        if not self._loop_ended(timeout):
            log.warning("the tick in progress outlasted %g s: waiting for it", timeout)
            if not self._loop_ended(TICK_END_WAIT_S):
                log.error("the tick in progress did not end within %g s: its requests are "
                          "left to the other workers", TICK_END_WAIT_S)
                return []
        withdrawn = self._on_compute(self._end)
        self._close_compute()
        return withdrawn

    def _ask_stop(self) -> None:
        with self._lock:
            self._stopping = True
        self._wakeup.set()

    def _loop_ended(self, timeout: float) -> bool:
        return self._loop_done is None or self._loop_done.wait(timeout)

    def _end(self) -> list[Request]:
        self.grammars.close()  # compiles in flight join the inbox first
        self._drain_inbox()
        withdrawn = self.scheduler.withdraw_pending()
        with self._lock:
            for request in withdrawn:
                self._handles.pop(request.request_id, None)
        self.scheduler.fail_all(worker_shutdown())
        self._after_tick(self.scheduler.take_events())
        return withdrawn

    def _load(self, config: EngineConfig,
              backend: ModelBackend | None) -> tuple[ModelBackend, Scheduler]:
        if backend is None:
            from inference.engine.backends import load_backend

            backend = load_backend(config)
        block_bytes = backend.kv_bytes_per_token() * config.kv_block_size
        num_blocks = config.kv_num_blocks or max(1, config.kv_cache_bytes // block_bytes)
        self.max_model_len = min(filter(None, (config.max_model_len, backend.max_model_len)))
        return backend, Scheduler(config, backend, num_blocks)  # calibrates its cost model

    def _on_compute(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` on the compute thread, or in place for an engine without one."""
        return fn() if self._compute is None else self._compute.call(fn)

    def _close_compute(self) -> None:
        if self._compute is not None:
            self._compute.close()

    def _run(self) -> None:
        while True:
            with self._lock:
                if self._stopping:
                    return
            if not self._has_tick_work():
                self._wakeup.wait(timeout=0.5)
                self._wakeup.clear()
                continue
            try:
                self._step()
            except Exception:  # keep serving: fail what was live, then go on
                # (not one request's own values: the scheduler contains those) logged whole,
                # the clients told without its (torch) text
                log.exception("tick failed")
                self.scheduler.fail_all(tick_failed())
                self._after_tick(self.scheduler.take_events())

    def _drain_inbox(self) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
        for kind, item in inbox:
            if kind == "submit":
                self.scheduler.add_request(item)
            elif kind == "withdraw":
                box, done = item
                box.extend(self.scheduler.withdraw_pending())
                with self._lock:
                    for request in box:
                        self._handles.pop(request.request_id, None)
                done.set()
            elif not self.scheduler.abort_request(item):
                log.debug("abort of unknown request %s ignored", item)

    def _after_tick(self, events: list[Event]) -> None:
        left = self.scheduler.take_left_pending()
        preempted = self.scheduler.take_preempted()
        # The snapshot first: a reader never sees rows freed here but pending not yet left.
        self._stats = self._build_stats()
        with self._lock:
            self._queued -= left
            for state in preempted:
                self._handles.pop(state.request_id, None)
        self._emit(events)
        if preempted and self._preempt_sink is not None:
            try:  # after the tick's events: the sink's requests have all of theirs out
                self._preempt_sink([for_another_engine(s) for s in preempted])
            except Exception:
                log.exception("preempt sink failed")

    def _emit(self, events: list[Event]) -> None:
        """Deliver ``events`` to their handles and the event sink (on the engine's thread)."""
        with self._lock:
            handles = [self._handles.get(e.request_id) for e in events]
            for event in events:
                if isinstance(event, FinalEvent):
                    self._handles.pop(event.request_id, None)
        for handle, event in zip(handles, events, strict=True):
            if handle is not None:
                handle._put(event)
        if self.event_sink is not None and events:
            try:
                self.event_sink(events)
            except Exception:
                log.exception("event sink failed")

    def _build_stats(self) -> dict[str, Any]:
        return dict(self.scheduler.stats(), last_tick_s=self._tick_seconds,
                    tick_seconds_total=round(self._tick_seconds_total, 4),
                    max_model_len=self.max_model_len, structured=self.grammars.stats())
