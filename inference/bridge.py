"""The Redis side of an inference worker: requests in, events out, aborts, stats, gate 1.

Message schema and key names: :mod:`inference.protocol`. Threads: the worker's main thread calls
:meth:`WorkerBridge.poll` (read and submit), :meth:`reconcile_queue`, :meth:`flush_usage` and
:meth:`publish_stats`; the engine thread calls :meth:`on_events` once per tick; a Redis pub/sub
thread calls :meth:`on_control`. No tensor work happens here.
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

from inference.engine import (
    EngineRefusal,
    EngineStoppedError,
    InvalidRequestError,
    LLMEngine,
    QueueFullError,
)
from inference.protocol import (
    CONSUMER_GROUP,
    ENQUEUE_LUA,
    EVENTS_TTL_S,
    ControlMessage,
    Keys,
    RequestMessage,
    encode_event,
    error_dict,
    final_event,
)
from inference.request import ErrorInfo, Event, FinalEvent, SamplingParams, TokenEvent

log = logging.getLogger(__name__)

UsageSink = Callable[[dict[str, Any]], None]
# HTTP status recorded for a request whose client went away (nginx's convention).
CLIENT_CLOSED_STATUS = 499


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
        prefetch: requests this worker holds in its engine's pending queue at most; it reads no
            more from Redis while that many wait, so idle workers get the rest. The free room is
            filled from the highest priority tier's stream down (see :meth:`poll`).
        usage_sink: called on the main thread with one payload per finished request (the Celery
            task ``api.tasks.record_usage`` in production).
    """

    def __init__(self, engine: LLMEngine, client: redis.Redis, keys: Keys, worker_id: str, *,
                 prefetch: int, usage_sink: UsageSink | None = None):
        self.engine = engine
        self.client = client
        self.keys = keys
        self.worker_id = worker_id
        self.prefetch = max(1, prefetch)
        self.usage_sink = usage_sink
        self._live: dict[str, LiveRequest] = {}
        self._live_lock = threading.Lock()
        self._finished: queue.SimpleQueue[tuple[dict[str, Any], RequestMessage, float | None]] = (
            queue.SimpleQueue())
        # Requests this worker counts in the global gate-1 counter: taken from Redis, not yet
        # admitted by its engine (or ended). Only the main thread touches it.
        self._held = 0
        self._accepting = True
        # Requests streams whose consumer group this worker made sure of -> their priority.
        self._tier_of: dict[str, int] = {}
        self._enqueue = client.register_script(ENQUEUE_LUA)
        engine.event_sink = self.on_events

    # -- set-up ---------------------------------------------------------------------------

    def ensure_groups(self) -> list[int]:
        """Create the consumer group of every registered tier's requests stream if missing.

        Returns:
            The registered priorities, highest first.
        """
        self._tier_of.clear()
        return [priority for priority, _ in self._tiers()]

    def _tiers(self) -> list[tuple[int, str]]:
        """``(priority, stream)`` of every registered tier, highest priority first.

        A tier seen for the first time gets its consumer group (normally made by the enqueue
        already; this covers a stream deleted by hand).
        """
        tiers = []
        for _, score in self.client.zrevrange(self.keys.request_tiers, 0, -1, withscores=True):
            priority = int(score)
            stream = self.keys.requests(priority)
            if stream not in self._tier_of:
                try:
                    self.client.xgroup_create(stream, CONSUMER_GROUP, id="0", mkstream=True)
                except redis.ResponseError as exc:
                    if "BUSYGROUP" not in str(exc):
                        raise
                self._tier_of[stream] = priority
            tiers.append((priority, stream))
        return tiers

    # -- requests in ----------------------------------------------------------------------

    def poll(self, block_ms: int = 50) -> int:
        """Take up to the free prefetch room of requests, highest priority first; return how many.

        The tiers' streams are read one at a time from the highest priority down, each for the
        room the higher ones left, so a backlog of a lower tier never stands in front of a later
        request of a higher one. When no tier has a request waiting, it blocks up to
        ``block_ms`` on every tier's stream at once and takes the first to arrive. With no free
        room, or no tier registered yet, it sleeps ``block_ms`` instead.
        """
        if not self._accepting:
            return 0
        room = self.prefetch - self.engine.num_queued()
        if room <= 0:
            time.sleep(block_ms / 1000)
            return 0
        tiers = self._tiers()
        if not tiers:
            time.sleep(block_ms / 1000)
            return 0
        taken = 0
        for _, stream in tiers:
            for name, entries in self._read({stream: ">"}, room - taken):
                taken += self._consume(name, entries)
            if taken >= room:
                return taken
        if taken:
            return taken
        # Nothing waiting. Requests that reached several tiers since the reads above come back
        # together, one per tier at most: the highest are taken, any past the room handed back.
        reply = self._read({stream: ">" for _, stream in tiers}, 1, block_ms)
        reply.sort(key=lambda item: self._tier_of.get(item[0], 0), reverse=True)
        for name, entries in reply:
            if taken >= room:
                for entry_id, fields in entries:
                    self._hand_back_entry(name, entry_id, fields)
                continue
            taken += self._consume(name, entries)
        return taken

    def _read(self, streams: dict[str, str], count: int,
              block_ms: int | None = None) -> list[tuple[str, list]]:
        """XREADGROUP: ``[(stream, [(entry_id, fields), ...]), ...]``, empty when none waits."""
        try:
            reply = self.client.xreadgroup(CONSUMER_GROUP, self.worker_id, streams, count=count,
                                           block=block_ms)
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            # A stream (and its group) was deleted: make sure of every group on the next poll.
            log.warning("requests stream without its consumer group: %s", exc)
            self._tier_of.clear()
            return []
        if not reply:
            return []
        items = reply.items() if isinstance(reply, dict) else reply
        return [(name.decode() if isinstance(name, bytes) else name, entries)
                for name, entries in items]

    def _consume(self, stream: str, entries: list) -> int:
        """Take (or drop, if malformed) and acknowledge entries read from ``stream``."""
        for entry_id, fields in entries:
            try:
                message = RequestMessage.from_json(fields[b"data"])
            except Exception:  # noqa: BLE001 - a malformed message must not stop the worker
                log.exception("dropping malformed request message %s", entry_id)
                self.client.decr(self.keys.queue)
            else:
                self._take(message)
            self.client.xack(stream, CONSUMER_GROUP, entry_id)
        return len(entries)

    def _hand_back_entry(self, stream: str, entry_id: Any, fields: dict) -> None:
        """Put an entry read but not taken back at the end of its stream (still in gate 1)."""
        pipe = self.client.pipeline(transaction=True)
        pipe.xadd(stream, fields)
        pipe.xack(stream, CONSUMER_GROUP, entry_id)
        pipe.execute()

    def _requeue(self, message: RequestMessage) -> None:
        """Put a request back on its own tier's stream for any worker (still in gate 1)."""
        priority = int(message.priority)
        self._enqueue(keys=[self.keys.requests(priority), self.keys.request_tiers],
                      args=[str(priority), CONSUMER_GROUP, message.to_json()])

    def _take(self, message: RequestMessage) -> None:
        rid = message.request_id
        self._held += 1  # counted in gate 1 since the web tier accepted it
        if self.client.exists(self.keys.aborted(rid)):
            self._end_unadmitted(message, final_event(rid, "abort"))
            return
        waited = time.time() - message.enqueued_at
        if message.queue_deadline_s and waited > message.queue_deadline_s:
            self._end_unadmitted(message, final_event(rid, "error", error=error_dict(
                "queue_timeout",
                f"request waited {waited:.1f} s for a worker, more than the allowed "
                f"{message.queue_deadline_s:g} s", 503, retryable=True,
                details={"max_queue_wait_s": message.queue_deadline_s})))
            return
        try:
            kwargs = self._submit_args(message)
            with self._live_lock:
                self._live[rid] = LiveRequest(message)
            self.engine.submit(**kwargs)
        except (QueueFullError, EngineStoppedError):
            # This worker cannot take it now: hand it back for any worker (still counted).
            self._forget(rid)
            self._held -= 1
            self._requeue(message)
            return
        except EngineRefusal as exc:
            self._forget(rid)
            self._end_unadmitted(message, final_event(rid, "error", error=exc.error.to_dict()))
            return
        if self.client.exists(self.keys.aborted(rid)):
            self.engine.abort(rid)  # the abort may have been published before we submitted

    def _submit_args(self, message: RequestMessage) -> dict[str, Any]:
        """Tokenize and resolve ``max_tokens``; raise ``InvalidRequestError`` for bad input."""
        tokenizer = self.engine.tokenizer
        if message.messages is not None:
            ids = tokenizer.apply_chat_template(message.messages)
        else:
            ids = tokenizer.encode(message.prompt or "")
        sampling = dict(message.sampling)
        if sampling.get("max_tokens") is None:
            left = self.engine.max_model_len - len(ids)
            if left < 1:
                raise InvalidRequestError(_error(
                    "context_length_exceeded",
                    f"prompt of {len(ids)} tokens leaves no room in the model's context of "
                    f"{self.engine.max_model_len} tokens", 400,
                    {"prompt_tokens": len(ids), "max_model_len": self.engine.max_model_len,
                     "param": "messages" if message.messages is not None else "prompt"}))
            sampling["max_tokens"] = min(message.default_max_tokens, left)
        try:
            params = SamplingParams(**sampling)
        except (TypeError, ValueError) as exc:
            raise InvalidRequestError(_error("invalid_request", str(exc), 400)) from exc
        return {"prompt_token_ids": ids, "sampling": params, "tenant": message.tenant,
                "fairness_key": message.fairness_key, "priority": message.priority,
                "fairness_weight": message.fairness_weight, "request_id": message.request_id}

    def _end_unadmitted(self, message: RequestMessage, event: dict[str, Any]) -> None:
        """Finish a request that never entered the engine: its final event, gate 1, usage."""
        pipe = self.client.pipeline(transaction=False)
        key = self.keys.events(message.request_id)
        pipe.xadd(key, encode_event(event))
        pipe.expire(key, EVENTS_TTL_S)
        pipe.decr(self.keys.queue)
        pipe.execute()
        self._held -= 1
        self._finished.put((event, message, None))

    def _forget(self, request_id: str) -> LiveRequest | None:
        with self._live_lock:
            return self._live.pop(request_id, None)

    # -- events out (engine thread) -------------------------------------------------------

    def on_events(self, events: list[Event]) -> None:
        """Append one tick's events to their requests' streams, in one pipeline."""
        now = time.time()
        pipe = self.client.pipeline(transaction=False)
        for event in events:
            key = self.keys.events(event.request_id)
            pipe.xadd(key, encode_event(event.to_dict()))
            pipe.expire(key, EVENTS_TTL_S)
            if isinstance(event, TokenEvent):
                live = self._live.get(event.request_id)
                if live is not None and live.first_token_at is None:
                    live.first_token_at = now
            elif isinstance(event, FinalEvent):
                live = self._forget(event.request_id)
                if live is not None:
                    self._finished.put((event.to_dict(), live.message, live.first_token_at))
        pipe.execute()

    # -- control (pub/sub thread) ---------------------------------------------------------

    def on_control(self, raw: dict[str, Any]) -> None:
        """Handle one pub/sub message of the control channel (aborts)."""
        try:
            message = ControlMessage.from_json(raw["data"])
        except Exception:  # noqa: BLE001
            log.warning("ignoring malformed control message %r", raw.get("data"))
            return
        if message.type == "abort":
            with self._live_lock:
                mine = message.request_id in self._live
            if mine:
                self.engine.abort(message.request_id)

    # -- gate 1, usage, stats (main thread) -----------------------------------------------

    def reconcile_queue(self) -> None:
        """Release from the gate-1 counter the requests that left this engine's pending queue."""
        left = self._held - self.engine.num_queued()
        if left > 0:
            self.client.decrby(self.keys.queue, left)
            self._held -= left

    def flush_usage(self) -> int:
        """Hand each finished request's usage to the usage sink; return how many."""
        n = 0
        while True:
            try:
                event, message, first_token_at = self._finished.get_nowait()
            except queue.Empty:
                return n
            n += 1
            if self.usage_sink is not None:
                try:
                    self.usage_sink(usage_payload(event, message, first_token_at))
                except Exception:  # noqa: BLE001 - usage must not stop serving
                    log.exception("could not record usage of %s", message.request_id)

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

    # -- shutdown -------------------------------------------------------------------------

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
            self._requeue(live.message)
            self._held -= 1
        self.reconcile_queue()
        self.flush_usage()
        self.client.delete(self.keys.stats(self.worker_id))
        return len(withdrawn)


def _error(code: str, message: str, status: int,
           details: dict[str, Any] | None = None) -> ErrorInfo:
    return ErrorInfo(code, message, status, details=details or {})


def usage_payload(event: dict[str, Any], message: RequestMessage,
                  first_token_at: float | None) -> dict[str, Any]:
    """The usage task's payload for a request's final event."""
    error = event.get("error") or {}
    if event["finish_reason"] == "error":
        status = int(error.get("status") or 500)
    elif event["finish_reason"] == "abort":
        status = CLIENT_CLOSED_STATUS
    else:
        status = 200
    now = time.time()
    return {
        "request_id": message.request_id,
        "meta": message.meta,
        "usage": event["usage"],
        "finish_reason": event["finish_reason"],
        "status": status,
        "error_code": error.get("code") or "",
        "ttft_s": (first_token_at - message.enqueued_at) if first_token_at else None,
        "duration_s": now - message.enqueued_at,
    }
