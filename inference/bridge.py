"""The Redis side of an inference worker: requests in, events out, aborts, stats, gate 1, usage.

Message schema and key names: :mod:`inference.protocol`; the shared request queue:
:mod:`inference.fair_queue`; turning a message into a submission: :mod:`inference.preparation`.
Threads: the worker's main thread calls :meth:`WorkerBridge.poll` (take and submit),
:meth:`reconcile_queue`, :meth:`charge_service`, :meth:`housekeep`, :meth:`flush_usage` and
:meth:`publish_stats`; the engine thread calls :meth:`on_events` once or twice per tick; a Redis
pub/sub thread calls :meth:`on_control`. No tensor work happens here.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
from pydantic import ValidationError

from inference.engine import EngineRefusal, EngineStoppedError, LLMEngine, QueueFullError
from inference.fair_queue import FairQueue, QueuedRequest
from inference.preparation import queue_timeout, submit_args
from inference.protocol import (
    EVENTS_TTL_S,
    ControlMessage,
    ErrorCode,
    ErrorInfo,
    Event,
    FinalEvent,
    FinishReason,
    Keys,
    RequestMessage,
    TokenEvent,
    UsageReport,
    encode_event,
)

log = logging.getLogger(__name__)

UsageSink = Callable[[UsageReport], None]


@dataclass
class LiveRequest:
    """A request this worker took from Redis and has not finished."""

    message: RequestMessage
    first_token_at: float | None = None


class WorkerBridge:
    """Connects one :class:`LLMEngine` to Redis.

    Args:
        engine: a started or not yet started engine; its ``event_sink`` is set here.
        client: a Redis client (``decode_responses=False``).
        keys: key names (see :mod:`inference.protocol`).
        worker_id: this worker's heartbeat member and stats key.
        prefetch: requests this worker takes beyond its free rows (``WORKER_PREFETCH``): it takes
            only what it can start soon, so the shared queue, not the worker that read first,
            decides each request's place.
        usage_sink: called on the main thread with each finished request's
            :class:`~inference.protocol.UsageReport` (sent to the Celery usage task in
            production).
    """

    def __init__(self, engine: LLMEngine, client: redis.Redis, keys: Keys, worker_id: str, *,
                 prefetch: int, usage_sink: UsageSink | None = None):
        self.engine = engine
        self.client = client
        self.keys = keys
        self.worker_id = worker_id
        self.usage_sink = usage_sink
        self.prefetch = max(0, prefetch)
        self.queue = FairQueue(client, keys, worker_id, engine.config.scheduling_policy)
        self._live: dict[str, LiveRequest] = {}
        self._live_lock = threading.Lock()
        self._finished: queue.SimpleQueue[tuple[FinalEvent, LiveRequest]] = queue.SimpleQueue()
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
        engine.event_sink = self.on_events

    # -- requests in (main thread) ----------------------------------------------------------

    def room(self) -> int:
        """Requests this worker may take now: its free rows and ``prefetch`` more, less those
        already waiting in its engine."""
        stats = self.engine.stats()
        free = stats["max_batch_size"] - stats["num_active"] - stats["num_prefilling"]
        return max(0, free) + self.prefetch - self.engine.num_queued()

    def poll(self, block_ms: int = 50) -> int:
        """Take what this worker can start soon, in the deployment's fair order; return how many.

        With room and nothing waiting it blocks up to ``block_ms`` for the next enqueue; with no
        room it waits up to ``block_ms`` for one of its requests to end.
        """
        if not self._accepting:
            return 0
        room = self.room()
        if room <= 0:
            # Until a row frees up (a request's end wakes it) or the poll interval passes.
            self._row_freed.wait(block_ms / 1000)
            self._row_freed.clear()
            return 0
        taken = self.queue.take(room)
        if not taken and self.queue.wait(block_ms / 1000):
            taken = self.queue.take(room)
        for request in taken:
            self._take(request)
        return len(taken)

    def _take(self, queued: QueuedRequest) -> None:
        self._held += 1  # counted in gate 1 until its engine admits it
        message = queued.message
        if message is None:
            self._end_unadmitted(None, queued.request_id, FinishReason.ERROR, ErrorInfo(
                code=ErrorCode.INVALID_REQUEST, message="the request message was malformed"))
            return
        rid = message.request_id
        if self.client.exists(self.keys.aborted(rid)):
            self._end_unadmitted(message, rid, FinishReason.ABORT)
            return
        expired = queue_timeout(message)
        if expired is not None:
            self._end_unadmitted(message, rid, FinishReason.ERROR, expired)
            return
        try:
            kwargs = submit_args(message, self.engine.tokenizer, self.engine.max_model_len)
            with self._live_lock:
                self._live[rid] = LiveRequest(message)
            self.engine.submit(**kwargs)
        except (QueueFullError, EngineStoppedError):
            # This worker cannot take it now: back to its place for any worker (still counted).
            self._forget(rid)
            self._held -= 1
            self.queue.requeue([rid])
            return
        except EngineRefusal as exc:
            self._forget(rid)
            self._end_unadmitted(message, rid, FinishReason.ERROR, exc.error)
            return
        if self.client.exists(self.keys.aborted(rid)):
            self.engine.abort(rid)  # the abort may have been published before we submitted

    def _end_unadmitted(self, message: RequestMessage | None, request_id: str,
                        reason: FinishReason, error: ErrorInfo | None = None) -> None:
        """Finish a request this worker took that never entered its engine."""
        event = FinalEvent(request_id=request_id, finish_reason=reason, error=error)
        lost = self.queue.write_events([event], EVENTS_TTL_S)
        self._count_ended(reason)
        self._held -= 1
        self.queue.release_held(1)
        if message is not None and not lost:
            self._finished.put((event, LiveRequest(message)))

    def _end_orphan(self, queued: QueuedRequest, error: ErrorInfo) -> None:
        """Finish a request no worker owns (withdrawn from the queue, or its worker died)."""
        event = FinalEvent(request_id=queued.request_id, finish_reason=FinishReason.ERROR,
                           error=error)
        self._count_ended(FinishReason.ERROR)
        key = self.keys.events(queued.request_id)
        pipe = self.client.pipeline(transaction=False)
        pipe.xadd(key, encode_event(event))
        pipe.expire(key, EVENTS_TTL_S)
        pipe.execute()
        if queued.message is not None:
            self._finished.put((event, LiveRequest(queued.message)))

    def _count_ended(self, reason: FinishReason) -> None:
        self._ended_outside[reason.value] = self._ended_outside.get(reason.value, 0) + 1

    def _forget(self, request_id: str) -> LiveRequest | None:
        with self._live_lock:
            return self._live.pop(request_id, None)

    # -- events out (engine thread) ---------------------------------------------------------

    def on_events(self, events: list[Event]) -> None:
        """Write one tick's events to their requests' streams (only for requests it owns)."""
        lost = set(self.queue.write_events(events, EVENTS_TTL_S))
        if any(isinstance(e, FinalEvent) for e in events):
            self._row_freed.set()
        now = time.time()
        for event in events:
            if event.request_id in lost:
                continue
            if isinstance(event, TokenEvent):
                live = self._live.get(event.request_id)
                if live is not None and live.first_token_at is None:
                    live.first_token_at = now
            else:
                live = self._forget(event.request_id)
                if live is not None:
                    self._finished.put((event, live))
        for request_id in lost:
            # Reclaimed while this worker was silent: another worker serves it (or ended it).
            if self._forget(request_id) is not None:
                log.warning("request %s is no longer this worker's: stopping it", request_id)
                self.engine.abort(request_id)

    # -- control (pub/sub thread) -----------------------------------------------------------

    def on_control(self, raw: dict[str, Any]) -> None:
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

    # -- gate 1, usage, stats (main thread) -------------------------------------------------

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
                self._charged[key] = served
        self.queue.charge(delta)

    def housekeep(self, heartbeat_ttl_s: float) -> None:
        """End waiting requests past their admission deadline, and reclaim dead workers' ones."""
        now = time.time()
        for queued in self.queue.expire(now):
            error = queue_timeout(queued.message, now) if queued.message else None
            self._end_orphan(queued, error or ErrorInfo(
                code=ErrorCode.QUEUE_TIMEOUT, message="not admitted before its deadline",
                retryable=True))
        requeued, workers, running = self.queue.reclaim(now, heartbeat_ttl_s)
        if workers:
            log.warning("reclaimed dead worker(s) %s: %d request(s) back in the queue, %d ended",
                        ", ".join(workers), requeued, len(running))
        for queued in running:
            self._end_orphan(queued, ErrorInfo(
                code=ErrorCode.WORKER_LOST, retryable=True,
                message="the inference worker serving this request stopped; retry it",
                details={"worker": ", ".join(workers)}))

    def flush_usage(self) -> int:
        """Hand each finished request's usage report to the usage sink; return how many."""
        n = 0
        while True:
            try:
                event, live = self._finished.get_nowait()
            except queue.Empty:
                return n
            n += 1
            if self.usage_sink is None:
                continue
            report = UsageReport(
                request_id=live.message.request_id, meta=live.message.meta, usage=event.usage,
                finish_reason=event.finish_reason, error=event.error,
                enqueued_at=live.message.enqueued_at, first_token_at=live.first_token_at,
                finished_at=time.time())
            try:
                self.usage_sink(report)
            except Exception:  # noqa: BLE001 - usage must not stop serving
                log.exception("could not record usage of %s", report.request_id)

    def publish_stats(self, ttl_s: float) -> None:
        """Heartbeat and stats snapshot (expiring after ``ttl_s`` without a refresh).

        A worker whose heartbeat lapsed was reclaimed by another (its requests went back to the
        queue or were ended): it finds out here, stops what it still runs, and starts afresh.
        """
        snapshot = self.engine.stats()
        finished = dict(snapshot.get("requests_finished") or {})
        for reason, n in self._ended_outside.items():  # ended before reaching the engine
            finished[reason] = finished.get(reason, 0) + n
        snapshot["requests_finished"] = finished
        snapshot["worker_id"] = self.worker_id
        snapshot["held_in_gate1"] = self._held
        snapshot["published_at"] = time.time()
        pipe = self.client.pipeline(transaction=False)
        pipe.zadd(self.keys.workers, {self.worker_id: time.time()}, xx=self._registered, ch=True)
        pipe.set(self.keys.stats(self.worker_id), json.dumps(snapshot, default=str),
                 px=max(1, int(ttl_s * 1000)))
        still_registered = pipe.execute()[0]
        if self._registered and not still_registered:
            self._on_reclaimed()
        self._registered = True

    def _on_reclaimed(self) -> None:
        with self._live_lock:
            live, self._live = list(self._live), {}
        log.error("this worker's heartbeat lapsed and its %d request(s) were reclaimed by "
                  "another worker: stopping them", len(live))
        for request_id in live:
            self.engine.abort(request_id)
        self._held = 0
        self.client.hdel(self.keys.fq("held"), self.worker_id)
        self.client.zadd(self.keys.workers, {self.worker_id: time.time()})

    # -- shutdown ---------------------------------------------------------------------------

    def shutdown(self, timeout_s: float) -> int:
        """Stop taking work, hand unadmitted requests back to Redis, end the rest.

        In-flight requests end with a ``worker_shutdown`` error event (from the engine).

        Returns:
            How many requests went back to their places in the shared queue, for another worker.
        """
        self._accepting = False
        self.client.zrem(self.keys.workers, self.worker_id)
        withdrawn = self.engine.shutdown(timeout_s)
        back = []
        for request in withdrawn:
            if self._forget(request.request_id) is not None:
                back.append(request.request_id)
        # Still counted in gate 1: back to their places in the queue, for another worker.
        self.queue.requeue(back)
        self._held -= len(back)
        self.reconcile_queue()
        self.flush_usage()
        self.client.delete(self.keys.stats(self.worker_id))
        self.client.hdel(self.keys.fq("held"), self.worker_id)
        return len(back)
