"""What a worker does when something else died, or it is told to stop (a mixin of
:class:`inference.worker.bridge.WorkerBridge`).

- :meth:`Recovery.audit` (every heartbeat): a live request with an abort mark stops (its pub/sub
  message was missed), a live request whose web process is gone stops (nobody reads its answer),
  and a request the queue says this worker took but the worker does not hold (the reply of a take
  was lost) goes back to its place.
- Its heartbeat lapsed and it was reclaimed: it stops what it still runs (another worker has it,
  or it ended with ``worker_lost``).
- Redis lost its data (the deployment's epoch changed): it stops what it ran and bills each
  request for what was computed (the final event and usage entry written without ownership).
- :meth:`Recovery.begin_drain` then :meth:`Recovery.shutdown` (SIGTERM): no new work, unadmitted
  requests back to the queue, the running ones finish within the grace period.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
import uuid
from typing import TYPE_CHECKING

import redis

from inference.protocol.events import ErrorCode, ErrorInfo, FinalEvent, FinishReason, encode_event
from inference.protocol.keys import EVENTS_TTL_S, Keys

if TYPE_CHECKING:
    from inference.engine.llm_engine import LLMEngine
    from inference.worker.fair_queue import FairQueue
    from inference.worker.intake import LiveRequest

log = logging.getLogger(__name__)


class Recovery:
    """The recovery half of a worker's bridge: the attributes below, and ``_forget``,
    ``reconcile_queue``, ``flush_events``, ``stop_publisher``, ``flush_usage`` and
    ``hand_back_preempted``, are the bridge's."""

    engine: LLMEngine
    client: redis.Redis
    keys: Keys
    worker_id: str
    queue: FairQueue
    web_ttl_s: float
    redis_ok_since: float
    epoch: str | None
    _live: dict[str, LiveRequest]
    _live_lock: threading.Lock
    _wiped: dict[str, LiveRequest]
    _origin_missing: dict[str, float]
    _audit_stopped: set[str]
    _ended: queue.SimpleQueue[str]
    _unsent: list
    _held: int
    _registered: bool
    _accepting: bool

    def audit(self) -> None:
        """Compare what this worker holds with what Redis says (every heartbeat).

        - a live request with an abort mark is stopped (its pub/sub message was missed);
        - a live request whose web process is gone is stopped (nobody reads its answer);
        - a request the queue says this worker took but the worker does not hold (the reply
          of a take was lost) goes back to its place.
        """
        with self._live_lock:
            live = {rid: r.message.origin for rid, r in self._live.items()}
        # A stop ordered at an earlier heartbeat may still wait for a slow tick to end: it is
        # ordered again (abort is idempotent) but logged only the first time.
        self._audit_stopped &= live.keys()
        if live:
            pipe = self.client.pipeline(transaction=False)
            for rid in live:
                pipe.exists(self.keys.aborted(rid))
            marks = pipe.execute()
            gone = {o for o in set(live.values()) if o and not self._origin_alive(o)}
            for (rid, origin), marked in zip(live.items(), marks, strict=True):
                if not marked and origin not in gone:
                    continue
                if rid not in self._audit_stopped:
                    self._audit_stopped.add(rid)
                    if marked:
                        log.info("request %s has an abort mark: stopping it", rid)
                    else:
                        log.warning("the web process %s streaming request %s is gone: "
                                    "stopping it", origin, rid)
                self.engine.abort(rid)
        taken, _running = self.queue.owned()
        with self._live_lock:
            strays = [rid for rid in taken if rid not in self._live]
        if strays:
            log.warning("%d request(s) recorded as taken by this worker that it does not hold: "
                        "back to the queue", len(strays))
            self.queue.requeue(strays)  # each also leaves this worker's held count

    def _origin_alive(self, origin: str) -> bool:
        """Whether the web process ``origin`` has a heartbeat younger than ``web_ttl_s`` (one
        never seen counts as alive for ``web_ttl_s`` from when it was first missed)."""
        if not origin or time.monotonic() - self.redis_ok_since < self.web_ttl_s:
            return True  # (just after an outage, no web process could beat: not judged)
        beat = self.client.zscore(self.keys.web, origin)
        now = time.time()
        if beat is not None:
            self._origin_missing.pop(origin, None)
            return now - float(beat) <= self.web_ttl_s
        first = self._origin_missing.setdefault(origin, time.monotonic())
        if len(self._origin_missing) > 10_000:
            self._origin_missing.clear()
        return time.monotonic() - first <= self.web_ttl_s

    def _read_epoch(self) -> str:
        self.client.set(self.keys.epoch, uuid.uuid4().hex, nx=True)
        value = self.client.get(self.keys.epoch)
        return value.decode() if isinstance(value, bytes) else str(value)

    def _epoch_changed(self) -> bool:
        if self.epoch is None:
            return False
        value = self.client.get(self.keys.epoch)
        current = value.decode() if isinstance(value, bytes) else value
        return current != self.epoch

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

    def _on_wiped(self) -> None:
        """Redis lost its data: the requests this worker holds are in no queue any more, and
        their readers ended them. Stop them; bill each for what was computed (its final event
        is written without ownership, with its usage entry)."""
        with self._live_lock:
            live, self._live = dict(self._live), {}
        log.error("Redis lost its data (the epoch changed): stopping this worker's %d "
                  "request(s)", len(live))
        self._wiped.update(live)
        for request_id in live:
            self.engine.abort(request_id)
        self._held = 0
        self._registered = False
        self.epoch = self._read_epoch()

    def _write_unowned_final(self, event: FinalEvent, live: LiveRequest) -> None:
        """End a request Redis lost: a retryable ``state_lost`` error (whatever the engine's own
        end: it was stopped for this), billed for what the engine computed."""
        lost = FinalEvent(
            request_id=event.request_id, seq=event.seq, finish_reason=FinishReason.ERROR,
            usage=event.usage, text=event.text, timings=event.timings,
            error=ErrorInfo(code=ErrorCode.STATE_LOST, retryable=True,
                            message="the server's request store restarted and lost this "
                                    "request; retry it",
                            details={"completion_tokens": event.usage.completion_tokens}))
        stream = self.keys.events(event.request_id)
        entry = {"final": lost.model_dump_json(), "body": live.message.to_json(),
                 "first_at": None, "finished_at": time.time()}
        pipe = self.client.pipeline(transaction=False)
        pipe.xadd(stream, encode_event(lost))
        pipe.expire(stream, EVENTS_TTL_S)
        pipe.hset(self.keys.usage_pending, event.request_id, json.dumps(entry))
        pipe.execute()
        self._ended.put(event.request_id)

    # -- drain and shutdown -----------------------------------------------------------------

    def begin_drain(self) -> int:
        """Stop taking work and hand the requests not yet admitted back to their places in the
        shared queue (for another worker); the running ones go on. Returns how many went back.
        """
        self._accepting = False
        withdrawn = self.engine.withdraw_pending()
        back = [r.request_id for r in withdrawn if self._forget(r.request_id) is not None]
        self.queue.requeue(back)
        self._held -= len(back)
        self.reconcile_queue()
        return len(back)

    def busy(self) -> bool:
        """Whether this worker still runs requests or has events to write."""
        with self._live_lock:
            live = bool(self._live)
        return live or bool(self._unsent)

    def shutdown(self, timeout_s: float) -> int:
        """Stop taking work, hand unadmitted requests back to Redis, end the rest.

        In-flight requests end with a ``worker_shutdown`` error event (from the engine).

        Returns:
            How many requests went back to their places in the shared queue, for another worker.
        """
        self._accepting = False
        withdrawn = self.engine.shutdown(timeout_s)
        self.stop_publisher()  # the engine's last events: written below, on this thread
        back = []
        for request in withdrawn:
            if self._forget(request.request_id) is not None:
                back.append(request.request_id)
        # Still counted in gate 1: back to their places in the queue, for another worker.
        self.queue.requeue(back)
        self._held -= len(back)
        self.reconcile_queue()
        self.flush_events()
        preempted = self.hand_back_preempted()  # preempted in its last ticks: any worker's
        self.flush_usage()
        # Its heartbeat is left to age out rather than removed: requests sent meanwhile wait in
        # the queue for the next worker (a restart of the only one) instead of being refused
        # with no_worker_available; after the TTL it is reclaimed (nothing is left to take).
        self.client.delete(self.keys.stats(self.worker_id))
        self.client.hdel(self.keys.fq("held"), self.worker_id)
        return len(back) + preempted
