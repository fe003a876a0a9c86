"""What the parts of one worker's bridge share: the requests it holds and the counts around them.

:class:`WorkerState` is the one object that :class:`inference.worker.bridge.WorkerBridge` and its
collaborators (:class:`~inference.worker.intake.Intake`,
:class:`~inference.worker.publisher.EventPublisher`, :class:`~inference.worker.recovery.Recovery`,
:class:`~inference.worker.origins.WebOrigins`) read and write in common:

- the live-request table: the requests this worker took from Redis and has not finished nor
  handed back, each with the token of its take (:class:`LiveRequest`, guarded by a lock: the
  main, engine or publisher, and pub/sub threads all read it);
- which take of each request its engine holds (:meth:`WorkerState.enter_engine` before a submit,
  :meth:`WorkerState.tag` as its events come out): the engine knows a request by its id only,
  and a worker reclaimed while it was paused may take a request again while its engine still
  runs the earlier take of it, whose events must go out with that earlier take's token (Redis
  drops them) and which must leave the engine before the new take enters it;
- the requests whose state Redis lost (their final events are written without ownership);
- the ids of the requests this worker ended, waiting for their usage to be handed to the usage
  sink (main thread, :meth:`WorkerState.flush_usage`), and the counts, by finish reason, of those
  it ended outside its engine (in its stats);
- its place in the deployment: gate 1's held count, whether it takes work, whether its heartbeat
  is published, the epoch it knows, and its sight of Redis (how long Redis has answered it
  without a break: :class:`inference.protocol.liveness.RedisSight`);
- the signals between its threads: a row of its engine freed up, its main thread waits with its
  rows full.

No Redis call is made here.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from inference.protocol.events import Event, FinalEvent, FinishReason
from inference.protocol.liveness import RedisSight
from inference.protocol.messages import RequestMessage

log = logging.getLogger(__name__)

# Called with the id of each request this worker ended, to have its usage recorded from the
# ledger (the Celery usage task in production).
UsageSink = Callable[[str], None]


@dataclass
class LiveRequest:
    """A request this worker took from Redis and has not finished (nor handed back); ``take``:
    the token of that take (its writes carry it)."""

    message: RequestMessage
    take: str
    prompt_tokens: int = 0
    started: bool = False  # whether its first event was handed to Redis
    streamed: int = 0  # the token events of it Redis took (its stream held them)


class WorkerState:
    """The live-request table of one worker and what its bridge's parts share (module docstring).

    Args:
        usage_sink: called on the main thread with the id of each request this worker ended
            (:meth:`flush_usage`); None: the ids are dropped.

    Attributes:
        wiped: requests whose state Redis lost, by id: their final events are written without
            ownership (:meth:`inference.worker.publisher.EventPublisher.write_unowned_final`).
        ended_outside: requests this worker ended outside its engine, by finish reason.
        held: requests this worker counts in the global gate-1 counter: taken from Redis, not
            yet admitted by its engine (nor ended). Only the main thread touches it.
        accepting: whether this worker takes work (False once it drains).
        registered: whether this worker's heartbeat has been published.
        epoch: the deployment's epoch as this worker knows it (None: not read yet).
        sight: how long Redis has answered this worker without a break (the main loop feeds
            it): heartbeats are judged against it (:mod:`inference.protocol.liveness`), so an
            outage, or a pause of this worker, is never taken for deaths.
        row_freed: set by the engine thread when one of its requests ends or is preempted.
        waiting_full: the main thread waits with its rows full (a freed row then nudges it).
    """

    def __init__(self, usage_sink: UsageSink | None = None, sight_gap_s: float = 5.0):
        self.usage_sink = usage_sink
        self._live: dict[str, LiveRequest] = {}
        # Request id -> the take token of the instance of it that the engine holds.
        self._in_engine: dict[str, str] = {}
        self._live_lock = threading.Lock()
        self._ended: queue.SimpleQueue[str] = queue.SimpleQueue()
        self.wiped: dict[str, LiveRequest] = {}
        self.ended_outside: dict[str, int] = {}
        self.held = 0
        self.accepting = True
        self.registered = False
        self.epoch: str | None = None
        self.sight = RedisSight(sight_gap_s)
        self.row_freed = threading.Event()
        self.waiting_full = False

    # -- the live-request table (any thread) -------------------------------------------------

    def add(self, request_id: str, live: LiveRequest) -> None:
        """Record a request this worker took (before its engine gets it)."""
        with self._live_lock:
            self._live[request_id] = live

    def get(self, request_id: str) -> LiveRequest | None:
        """The live request ``request_id``; None: this worker does not hold it."""
        with self._live_lock:
            return self._live.get(request_id)

    def is_mine(self, request_id: str) -> bool:
        """Whether this worker holds the request ``request_id``."""
        with self._live_lock:
            return request_id in self._live

    def holds(self, request_id: str, take: str) -> bool:
        """Whether this worker holds the take ``take`` of the request ``request_id``."""
        with self._live_lock:
            live = self._live.get(request_id)
            return live is not None and live.take == take

    def forget(self, request_id: str, take: str | None = None) -> LiveRequest | None:
        """Drop a request from the table (with ``take``: only if it holds that take); return
        it, or None if this worker did not hold it."""
        with self._live_lock:
            live = self._live.get(request_id)
            if live is None or (take is not None and live.take != take):
                return None
            return self._live.pop(request_id)

    def mark_started(self, request_id: str, take: str) -> None:
        """The first event of the take ``take`` of ``request_id`` reached Redis."""
        with self._live_lock:
            live = self._live.get(request_id)
            if live is not None and live.take == take:
                live.started = True

    def drop_stale(self, request_id: str, take: str, stop: Callable[[str], None]) -> bool:
        """Redis refused the events of the take ``take`` of ``request_id`` (reclaimed while this
        worker was silent): forget it if the table holds that take, and call ``stop(request_id)``
        if the engine holds it still (under the table's lock, so that the stop can never reach a
        later take of the same request: that one enters the engine only once this one left).
        Returns whether the table held it."""
        with self._live_lock:
            live = self._live.get(request_id)
            held = live is not None and live.take == take
            if held:
                del self._live[request_id]
            if self._in_engine.get(request_id) == take:
                stop(request_id)
            return held

    # -- which take the engine holds (main and engine threads) ----------------------------------

    def enter_engine(self, request_id: str, take: str) -> bool:
        """Record that the take ``take`` of ``request_id`` is about to be submitted to the
        engine; False (nothing recorded) while the engine still holds an earlier take of it."""
        with self._live_lock:
            if request_id in self._in_engine:
                return False
            self._in_engine[request_id] = take
            return True

    def left_engine(self, request_id: str) -> str | None:
        """The engine no longer holds ``request_id`` (withdrawn, refused, preempted); return the
        take token it held, or None."""
        with self._live_lock:
            return self._in_engine.pop(request_id, None)

    def in_engine(self, request_id: str) -> bool:
        """Whether the engine holds a take of ``request_id``."""
        with self._live_lock:
            return request_id in self._in_engine

    def tag(self, events: Sequence[Event]) -> list[tuple[Event, str]]:
        """Each of one tick's events with the take token of the take the engine emitted it for
        (engine thread, as the engine hands them out); a final event's take leaves the engine
        with it. An event of a request the engine was not given through this worker gets a
        token no take has ("-"): Redis drops it."""
        with self._live_lock:
            tagged = []
            for event in events:
                take = self._in_engine.get(event.request_id, "-")
                if isinstance(event, FinalEvent):
                    self._in_engine.pop(event.request_id, None)
                tagged.append((event, take))
            return tagged

    def take_all(self) -> dict[str, LiveRequest]:
        """Empty the table; return what it held (the worker lost its requests to Redis)."""
        with self._live_lock:
            live, self._live = self._live, {}
        return live

    def holds_any(self) -> bool:
        """Whether this worker holds any request."""
        with self._live_lock:
            return bool(self._live)

    def live_origins(self) -> dict[str, str]:
        """``{request id: origin}``: the web process streaming each live request ("" for none)."""
        with self._live_lock:
            return {rid: r.message.origin for rid, r in self._live.items()}

    def missing(self, request_ids: Iterable[str]) -> list[str]:
        """Those of ``request_ids`` that this worker does not hold, in order."""
        with self._live_lock:
            return [rid for rid in request_ids if rid not in self._live]

    def unstarted_prompts(self, takes: Iterable[tuple[str, str]]) -> dict[str, int]:
        """``{request id: prompt tokens}`` of those of the ``(request id, take token)`` pairs
        whose take this worker holds and whose first event was not handed to Redis yet."""
        counts: dict[str, int] = {}
        with self._live_lock:
            for rid, take in takes:
                live = self._live.get(rid)
                if live is not None and live.take == take and not live.started:
                    counts[rid] = live.prompt_tokens
        return counts

    # -- ended requests and their usage -------------------------------------------------------

    def count_outside(self, reason: FinishReason) -> None:
        """Count a request this worker ended without its engine (in its stats)."""
        self.ended_outside[reason.value] = self.ended_outside.get(reason.value, 0) + 1

    def record_ended(self, request_id: str) -> None:
        """Queue the id of a request this worker ended, for its usage (any thread)."""
        self._ended.put(request_id)

    def flush_usage(self) -> int:
        """Hand the id of each request this worker ended to the usage sink; return how many
        (main thread).

        A sink that fails leaves the entry in the ledger: the reconciliation records it.
        """
        n = 0
        while True:
            try:
                request_id = self._ended.get_nowait()
            except queue.Empty:
                return n
            n += 1
            if self.usage_sink is None:
                continue
            try:
                self.usage_sink(request_id)
            except Exception:  # noqa: BLE001 - usage must not stop serving
                log.exception("could not send the usage of %s (the reconciliation will)",
                              request_id)
