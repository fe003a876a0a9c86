"""The Redis side of an inference worker: requests in, events out, aborts, stats, gate 1, usage.

Message schema and key names: :mod:`inference.protocol`; the shared request queue:
:mod:`inference.worker.fair_queue`; what a worker takes, and the requests its engine preempted going
back to the queue: :mod:`inference.worker.intake`; turning a message into a submission:
:mod:`inference.worker.preparation`. Threads: the worker's main thread calls
:meth:`WorkerBridge.poll` (hand back, take and submit), :meth:`reconcile_queue`,
:meth:`charge_service`,
:meth:`housekeep`, :meth:`audit`, :meth:`flush_events`, :meth:`flush_usage` and
:meth:`publish_stats`; the engine thread calls :meth:`on_events` once or twice per tick and
:meth:`on_preempted` after a tick that preempted; a Redis pub/sub thread calls
:meth:`on_control`. No tensor work happens here.

A Redis outage is ridden out here: events wait, in order, in a buffer and are written when Redis
is back, at most once each. What it does when something else died, or it is told to stop, is in
:mod:`inference.worker.recovery` (``docs/design.md``, "Faults").
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Callable

import redis
from pydantic import ValidationError

from inference.engine.llm_engine import LLMEngine
from inference.protocol.events import Event, FinalEvent, FinishReason, TokenEvent
from inference.protocol.keys import EVENTS_TTL_S, Keys
from inference.protocol.messages import ControlMessage
from inference.worker.fair_queue import FairQueue
from inference.worker.intake import Intake, LiveRequest
from inference.worker.recovery import Recovery

log = logging.getLogger(__name__)

# Called with the id of each request this worker ended, to have its usage recorded from the
# ledger (the Celery usage task in production).
UsageSink = Callable[[str], None]
# Events buffered while Redis is unreachable, at most (then the oldest requests are stopped).
MAX_UNSENT_EVENTS = 100_000


class WorkerBridge(Recovery, Intake):
    """Connects one :class:`LLMEngine` to Redis.

    Args:
        engine: a started or not yet started engine; its ``event_sink`` is set here.
        client: a Redis client (``decode_responses=False``).
        keys: key names (see :mod:`inference.protocol`).
        worker_id: this worker's heartbeat member and stats key.
        prefetch: requests this worker takes beyond its free rows (``WORKER_PREFETCH``): it takes
            only what it can start soon, so the shared queue, not the worker that read first,
            decides each request's place.
        usage_sink: called on the main thread with the id of each request this worker ended
            (its usage entry is in the ledger; the sink has it recorded).
        web_ttl_s: a web process whose heartbeat is older than this is gone, with the clients
            of the answers it was streaming: those answers are stopped.
    """

    def __init__(self, engine: LLMEngine, client: redis.Redis, keys: Keys, worker_id: str, *,
                 prefetch: int, usage_sink: UsageSink | None = None, web_ttl_s: float = 10.0):
        self.engine = engine
        self.client = client
        self.keys = keys
        self.worker_id = worker_id
        self.usage_sink = usage_sink
        self.prefetch = max(0, prefetch)
        self.web_ttl_s = web_ttl_s
        self.queue = FairQueue(client, keys, worker_id, engine.config.scheduling_policy)
        self._live: dict[str, LiveRequest] = {}
        self._live_lock = threading.Lock()
        self._ended: queue.SimpleQueue[str] = queue.SimpleQueue()
        # Events not yet written, in order (guarded by _unsent_lock); _send_lock serializes the
        # writes (the engine or publisher thread, and the main thread's flushes).
        self._unsent: list[Event] = []
        self._unsent_lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._publisher: threading.Thread | None = None
        self._publish_now = threading.Event()
        self._publisher_stop = False
        # Requests this worker counts in the global gate-1 counter: taken from Redis, not yet
        # admitted by its engine (or ended). Only the main thread touches it.
        self._held = 0
        self._accepting = True
        # Weighted service already charged to the shared counters, per fairness key.
        self._charged: dict[str, float] = {}
        self._registered = False  # whether this worker's heartbeat has been published
        self._row_freed = threading.Event()  # set by the engine thread when a request ends
        # Requests this worker ended outside its engine, by finish reason (in its stats).
        self._ended_outside: dict[str, int] = {}
        # The deployment's epoch as this worker knows it (None: not read yet).
        self.epoch: str | None = None
        # Requests whose state Redis lost: their final events are written without ownership.
        self._wiped: dict[str, LiveRequest] = {}
        # Origins (web processes) first seen without a heartbeat: origin -> monotonic time.
        self._origin_missing: dict[str, float] = {}
        self._audit_stopped: set[str] = set()
        # Monotonic time since which Redis has answered without a break (the main loop sets it
        # after an outage): heartbeats are judged only when every process could have written
        # them for a whole TTL since, so an outage is never taken for deaths.
        self.redis_ok_since = float("-inf")
        engine.event_sink = self.on_events
        self._init_intake()

    # -- requests in, preempted requests back (main thread): inference.worker.intake -------------

    def _count_ended(self, reason: FinishReason) -> None:
        self._ended_outside[reason.value] = self._ended_outside.get(reason.value, 0) + 1

    def _forget(self, request_id: str) -> LiveRequest | None:
        with self._live_lock:
            return self._live.pop(request_id, None)

    # -- events out (engine thread, the publisher thread, the main thread after an outage) --

    def start_publisher(self) -> None:
        """Write events on a thread of their own from now on (the worker process does).

        The engine thread then only hands a tick's events over and goes on to the next tick
        while they are written (one Redis round trip and script run per tick, about a
        millisecond, off the critical path), and a slow or unreachable Redis never stalls a
        tick. Order is kept: every write takes the events in the order the engine emitted them.
        """
        if self._publisher is None:
            self._publisher = threading.Thread(target=self._publish_loop, name="event-publisher",
                                               daemon=True)
            self._publisher.start()

    def stop_publisher(self) -> None:
        """Stop the publisher thread (the events it has not written stay for
        :meth:`flush_events`)."""
        publisher, self._publisher = self._publisher, None
        if publisher is not None:
            self._publisher_stop = True
            self._publish_now.set()
            publisher.join()
            self._publisher_stop = False

    def _publish_loop(self) -> None:
        while not self._publisher_stop:
            self._publish_now.wait()
            self._publish_now.clear()
            try:  # e.g. Redis lost after a write, reading the epoch: the thread goes on
                with self._send_lock:
                    self._send_unsent()
            except Exception:  # noqa: BLE001
                log.exception("event publisher: write failed")

    def on_events(self, events: list[Event]) -> None:
        """Write one tick's events to their requests' streams (only for requests it owns); with
        a publisher thread (:meth:`start_publisher`), hand them to it and return at once.

        When Redis is unreachable the events wait, in order, and go out with the next write or
        :meth:`flush_events`; the engine goes on generating meanwhile.
        """
        if any(isinstance(e, FinalEvent) for e in events):
            self._row_freed.set()
            if self._waiting_full:  # a main thread waiting with its rows full: a row is free
                self.queue.nudge()
        with self._unsent_lock:
            self._unsent.extend(events)
        if self._publisher is not None:
            self._publish_now.set()
            return
        with self._send_lock:
            self._send_unsent()

    def flush_events(self) -> None:
        """Write the events that wait, the publisher's included (main thread; raises while Redis
        is unreachable). Returns once every event handed over before the call is written."""
        with self._send_lock:
            if self._unsent:
                self._send_unsent(raise_errors=True)

    def _send_unsent(self, raise_errors: bool = False) -> None:
        """Write the waiting events (the caller holds ``_send_lock``)."""
        with self._unsent_lock:
            events, self._unsent = self._unsent, []
        if not events:
            return
        counts: dict[str, int] = {}
        with self._live_lock:
            for event in events:
                live = self._live.get(event.request_id)
                if live is not None and not live.started:
                    counts[event.request_id] = live.prompt_tokens
        try:
            lost = set(self.queue.write_events(events, EVENTS_TTL_S, counts))
        except Exception as exc:  # kept, in front of what the engine emitted meanwhile
            with self._unsent_lock:
                self._unsent[:0] = events
                waiting = len(self._unsent)
                if waiting > MAX_UNSENT_EVENTS:
                    log.error("%d events wait for Redis: dropping the oldest", waiting)
                    del self._unsent[: waiting - MAX_UNSENT_EVENTS]
            if not isinstance(exc, redis.RedisError):  # a fault of ours: logged, not fatal
                log.exception("could not write %d event(s): kept for the next try", waiting)
                return
            if raise_errors:
                raise
            log.warning("could not write %d event(s) (%s): kept for the next try",
                        waiting, exc)
            return
        if lost and self._epoch_changed():
            self._on_wiped()
        for event in events:
            if event.request_id in lost:
                continue
            if isinstance(event, TokenEvent):
                live = self._live.get(event.request_id)
                if live is not None:
                    live.started = True
            elif self._forget(event.request_id) is not None:
                self._ended.put(event.request_id)
        for request_id in lost:
            wiped = self._wiped.get(request_id)
            final = next((e for e in events if e.request_id == request_id
                          and isinstance(e, FinalEvent)), None)
            if wiped is not None:
                if final is not None:
                    self._wiped.pop(request_id, None)
                    self._write_unowned_final(final, wiped)
                continue
            # Reclaimed while this worker was silent: another worker serves it (or ended it).
            if self._forget(request_id) is not None:
                log.warning("request %s is no longer this worker's: stopping it", request_id)
                self.engine.abort(request_id)

    # -- control (pub/sub thread) -----------------------------------------------------------

    def on_control(self, raw: dict) -> None:
        """Handle one pub/sub message of the control channel (aborts)."""
        try:
            message = ControlMessage.from_json(raw["data"])
        except (KeyError, ValidationError):
            log.warning("ignoring malformed control message %r", raw.get("data"))
            return
        with self._live_lock:
            mine = message.request_id in self._live
        if mine:
            self.engine.abort(message.request_id)

    # -- gate 1, usage, stats, audits (main thread) -----------------------------------------

    def reconcile_queue(self) -> None:
        """Release from gate 1 the requests that left this engine's pending queue."""
        left = self._held - self.engine.num_queued()
        if left > 0:
            self.queue.release_held(left)
            self._held -= left

    def charge_service(self) -> None:
        """Charge the shared VTC counters with the service this engine gave since the last call.

        The engine's policy weighs each key's computed prompt tokens and generated tokens (and
        divides by the key's fairness weight); the difference since the last charge goes to the
        queue, so every worker orders the next requests by the service of the whole deployment.
        """
        per_key = self.engine.stats().get("per_key") or {}
        delta = {}
        for key, row in per_key.items():
            served = float(row.get("weighted_service") or 0.0)
            if served > self._charged.get(key, 0.0):
                delta[key] = served - self._charged.get(key, 0.0)
        self.queue.charge(delta)
        for key, amount in delta.items():  # charged only once the queue took it
            self._charged[key] = self._charged.get(key, 0.0) + amount

    def housekeep(self, heartbeat_ttl_s: float) -> None:
        """End waiting requests past their admission deadline, and reclaim dead workers' ones.

        The same scripts run in the web tiers and a Celery beat task (whoever runs first does
        the work, once); the requests ended here have their usage recorded through this worker.
        """
        for request_id in self.queue.expire(EVENTS_TTL_S):
            self._count_ended(FinishReason.ERROR)
            self._ended.put(request_id)
        if time.monotonic() - self.redis_ok_since < heartbeat_ttl_s:
            return  # just after an outage: a stale heartbeat may be a live worker's
        requeued, workers, ended = self.queue.reclaim(heartbeat_ttl_s, EVENTS_TTL_S)
        if workers:
            log.warning("reclaimed dead worker(s) %s: %d request(s) back in the queue, %d ended",
                        ", ".join(workers), requeued, len(ended))
        for request_id in ended:
            self._count_ended(FinishReason.ERROR)
            self._ended.put(request_id)

    def flush_usage(self) -> int:
        """Hand the id of each request this worker ended to the usage sink; return how many.

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

    def publish_stats(self, ttl_s: float) -> None:
        """Heartbeat and stats snapshot (expiring after ``ttl_s`` without a refresh).

        A worker whose heartbeat lapsed was reclaimed by another (its requests went back to the
        queue or were ended): it finds out here, stops what it still runs, and starts afresh. A
        worker that finds the deployment's epoch changed knows Redis lost its data.
        """
        if self.epoch is None or self._epoch_changed():
            if self.epoch is not None:
                self._on_wiped()
            self.epoch = self._read_epoch()
        if not self._registered and not self._live:
            # A process that ran under this id before and died left its requests under it.
            requeued, _, ended = self.queue.reclaim(ttl_s, EVENTS_TTL_S, include_self=True)
            if requeued or ended:
                log.warning("an earlier process under this worker's id left %d request(s) "
                            "taken (back in the queue) and %d running (ended)", requeued,
                            len(ended))
            for request_id in ended:
                self._ended.put(request_id)
        snapshot = self.engine.stats()
        finished = dict(snapshot.get("requests_finished") or {})
        for reason, n in self._ended_outside.items():  # ended before reaching the engine
            finished[reason] = finished.get(reason, 0) + n
        snapshot["requests_finished"] = finished
        snapshot["worker_id"] = self.worker_id
        snapshot["held_in_gate1"] = self._held
        snapshot["events_unsent"] = len(self._unsent)
        snapshot["published_at"] = time.time()
        pipe = self.client.pipeline(transaction=False)
        pipe.zadd(self.keys.workers, {self.worker_id: time.time()}, xx=self._registered, ch=True)
        pipe.set(self.keys.stats(self.worker_id), json.dumps(snapshot, default=str),
                 px=max(1, int(ttl_s * 1000)))
        still_registered = pipe.execute()[0]
        if self._registered and not still_registered:
            self._on_reclaimed()
        self._registered = True

