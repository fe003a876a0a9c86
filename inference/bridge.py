"""The Redis side of an inference worker: requests in, events out, aborts, stats, gate 1, usage.

Message schema and key names: :mod:`inference.protocol`; reading the requests streams:
:mod:`inference.intake`; turning a message into a submission: :mod:`inference.preparation`.
Threads: the worker's main thread calls :meth:`WorkerBridge.poll` (read and submit),
:meth:`reconcile_queue`, :meth:`flush_usage` and :meth:`publish_stats`; the engine thread calls
:meth:`on_events` once or twice per tick; a Redis pub/sub thread calls :meth:`on_control`. No
tensor work happens here.
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
from inference.intake import RequestIntake
from inference.preparation import queue_timeout, submit_args
from inference.protocol import (
    EVENTS_TTL_S,
    ControlMessage,
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
        worker_id: this worker's consumer name and stats key.
        prefetch: requests this worker holds in its engine's pending queue at most
            (``WORKER_PREFETCH``); it reads no more from Redis while that many wait, so idle
            workers get the rest.
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
        self.prefetch = max(1, prefetch)
        self.usage_sink = usage_sink
        self.intake = RequestIntake(client, keys, worker_id, self._take)
        self._live: dict[str, LiveRequest] = {}
        self._live_lock = threading.Lock()
        self._finished: queue.SimpleQueue[tuple[FinalEvent, LiveRequest]] = queue.SimpleQueue()
        # Requests this worker counts in the global gate-1 counter: taken from Redis, not yet
        # admitted by its engine (or ended). Only the main thread touches it.
        self._held = 0
        self._accepting = True
        engine.event_sink = self.on_events

    # -- requests in (main thread) ----------------------------------------------------------

    def ensure_groups(self) -> list[int]:
        """Create the consumer group of every registered tier's requests stream if missing.

        Returns:
            The registered priorities, highest first.
        """
        self.intake.forget_tiers()
        return [priority for priority, _ in self.intake.tiers()]

    def poll(self, block_ms: int = 50) -> int:
        """Take up to the free prefetch room of requests, highest priority first; return how many.

        See :meth:`inference.intake.RequestIntake.poll`.
        """
        if not self._accepting:
            return 0
        return self.intake.poll(self.prefetch - self.engine.num_queued(), block_ms)

    def _take(self, message: RequestMessage) -> None:
        rid = message.request_id
        self._held += 1  # counted in gate 1 since the web tier accepted it
        if self.client.exists(self.keys.aborted(rid)):
            self._end_unadmitted(message, FinishReason.ABORT)
            return
        expired = queue_timeout(message)
        if expired is not None:
            self._end_unadmitted(message, FinishReason.ERROR, expired)
            return
        try:
            kwargs = submit_args(message, self.engine.tokenizer, self.engine.max_model_len)
            with self._live_lock:
                self._live[rid] = LiveRequest(message)
            self.engine.submit(**kwargs)
        except (QueueFullError, EngineStoppedError):
            # This worker cannot take it now: hand it back for any worker (still counted).
            self._forget(rid)
            self._held -= 1
            self.intake.requeue(message)
            return
        except EngineRefusal as exc:
            self._forget(rid)
            self._end_unadmitted(message, FinishReason.ERROR, exc.error)
            return
        if self.client.exists(self.keys.aborted(rid)):
            self.engine.abort(rid)  # the abort may have been published before we submitted

    def _end_unadmitted(self, message: RequestMessage, reason: FinishReason,
                        error: ErrorInfo | None = None) -> None:
        """Finish a request that never entered the engine: its final event, gate 1, usage."""
        event = FinalEvent(request_id=message.request_id, finish_reason=reason, error=error)
        pipe = self.client.pipeline(transaction=False)
        key = self.keys.events(message.request_id)
        pipe.xadd(key, encode_event(event))
        pipe.expire(key, EVENTS_TTL_S)
        pipe.decr(self.keys.queue)
        pipe.execute()
        self._held -= 1
        self._finished.put((event, LiveRequest(message)))

    def _forget(self, request_id: str) -> LiveRequest | None:
        with self._live_lock:
            return self._live.pop(request_id, None)

    # -- events out (engine thread) ---------------------------------------------------------

    def on_events(self, events: list[Event]) -> None:
        """Append one tick's events to their requests' streams, in one pipeline."""
        now = time.time()
        pipe = self.client.pipeline(transaction=False)
        for event in events:
            key = self.keys.events(event.request_id)
            pipe.xadd(key, encode_event(event))
            pipe.expire(key, EVENTS_TTL_S)
            if isinstance(event, TokenEvent):
                live = self._live.get(event.request_id)
                if live is not None and live.first_token_at is None:
                    live.first_token_at = now
            else:
                live = self._forget(event.request_id)
                if live is not None:
                    self._finished.put((event, live))
        pipe.execute()

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
        """Release from the gate-1 counter the requests that left this engine's pending queue."""
        left = self._held - self.engine.num_queued()
        if left > 0:
            self.client.decrby(self.keys.queue, left)
            self._held -= left

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
        """Heartbeat and stats snapshot (expiring after ``ttl_s`` without a refresh)."""
        snapshot = self.engine.stats()
        snapshot["worker_id"] = self.worker_id
        snapshot["held_in_gate1"] = self._held
        snapshot["published_at"] = time.time()
        pipe = self.client.pipeline(transaction=False)
        pipe.zadd(self.keys.workers, {self.worker_id: time.time()})
        pipe.set(self.keys.stats(self.worker_id), json.dumps(snapshot, default=str),
                 px=max(1, int(ttl_s * 1000)))
        pipe.execute()

    # -- shutdown ---------------------------------------------------------------------------

    def shutdown(self, timeout_s: float) -> int:
        """Stop taking work, hand unadmitted requests back to Redis, end the rest.

        In-flight requests end with a ``worker_shutdown`` error event (from the engine).

        Returns:
            How many requests went back, each to its own tier's requests stream, for another
            worker.
        """
        self._accepting = False
        self.client.zrem(self.keys.workers, self.worker_id)
        withdrawn = self.engine.shutdown(timeout_s)
        for request in withdrawn:
            live = self._forget(request.request_id)
            if live is None:
                continue
            # Still counted in gate 1: it goes back to its tier's stream, still waiting.
            self.intake.requeue(live.message)
            self._held -= 1
        self.reconcile_queue()
        self.flush_usage()
        self.client.delete(self.keys.stats(self.worker_id))
        return len(withdrawn)
