"""A worker's events out: each tick's events written to their requests' streams, in order, once.

The engine thread hands a tick's events over (:meth:`EventPublisher.on_events`); they are written
on the publisher thread (:meth:`EventPublisher.start_publisher`), or at once on the engine thread
without one. Each event is tagged, as the engine hands it out, with the take token of the take
the engine emitted it for (:meth:`inference.worker.live.WorkerState.tag`). One write is one Lua
script run (``FairQueue.write_events``): it writes only the events of takes this worker owns,
records the next ``seq`` of each request, and ends a request with its final event. A Redis
outage is ridden out here: events wait, in order, in a buffer and are written when Redis is back,
at most once each (the main thread's :meth:`EventPublisher.flush_events`).

With a hold (``EVENT_HOLD_MS``), a tick whose events are all tokens after a request's first,
of at least ``EVENT_HOLD_MIN_STREAMS`` requests, waits for the next tick's and goes out with
them, in one write: each stream then gets its tokens two at a time, and every web process reads,
frames and sends them together (a per-write cost on each side). A token waits at most one tick
and at most the hold; a first token, a final event, a tick of fewer streams (a lone stream's
tokens go one at a time: its inter-token latency stays the step's), or a tick that finds a held
one goes out at once, as does everything on :meth:`EventPublisher.flush_events` (a preempted
request's hand-back, a stop).

A write that finds a request no longer this worker's tells why: Redis lost its data (the
``lost_sink`` the bridge sets, :meth:`inference.worker.recovery.Recovery.check_data_loss`, moves
every live request to the wiped ones, whose final events are then written without ownership,
:meth:`EventPublisher.write_unowned_final`), or the take was reclaimed while this worker was
silent (it is stopped here, unless the request was taken again since: then only the stale take,
whose events and final are dropped, leaves the engine).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable

import redis

from inference.engine.llm_engine import LLMEngine
from inference.protocol.events import (
    ErrorCode,
    ErrorInfo,
    Event,
    FinalEvent,
    FinishReason,
    TokenEvent,
    encode_event,
    whole_request_choices,
)
from inference.protocol.keys import EVENTS_TTL_S, Keys
from inference.worker.fair_queue import FairQueue, Owned
from inference.worker.live import LiveRequest, WorkerState

log = logging.getLogger(__name__)

# Events buffered while Redis is unreachable, at most (then the oldest requests are stopped).
MAX_UNSENT_EVENTS = 100_000


class EventPublisher:
    """Writes one engine's events to Redis (module docstring).

    Args:
        state: the worker's shared state (the live requests, the wiped ones, the ended ids).
        engine: the engine whose events these are (a request found reclaimed is aborted in it).
        queue: the shared queue's client (its ``write_events`` script).
        client: a Redis client (``decode_responses=False``).
        keys: key names.
        hold_s: how long a tick's token events may wait for the next tick's (seconds; 0: never
            held; module docstring).
        hold_min_streams: the fewest requests whose tokens a tick must carry to be held.

    Attributes:
        lost_sink: called on the writing thread when a write finds requests no longer this
            worker's, before they are handled (the bridge sets it); None: not called.
    """

    def __init__(self, state: WorkerState, engine: LLMEngine, queue: FairQueue,
                 client: redis.Redis, keys: Keys, hold_s: float = 0.0,
                 hold_min_streams: int = 1):
        self.state = state
        self.engine = engine
        self.hold_s = hold_s
        self.hold_min_streams = hold_min_streams
        self._ticks = 0  # ticks whose events wait in _unsent (guarded by _unsent_lock)
        self._held_at: float | None = None  # monotonic time the held tick's events began waiting
        self.queue = queue
        self.client = client
        self.keys = keys
        self.lost_sink: Callable[[], object] | None = None
        # Events not yet written, in order, each with its take token (guarded by _unsent_lock);
        # _send_lock serializes the writes (the engine or publisher thread, and the main
        # thread's flushes).
        self._unsent: list[Owned] = []
        self._unsent_lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._publisher: threading.Thread | None = None
        self._publish_now = threading.Event()
        self._publisher_stop = False

    def num_unsent(self) -> int:
        """How many events wait to be written."""
        return len(self._unsent)

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
            held_at = self._held_at
            self._publish_now.wait(None if held_at is None
                                   else max(0.0, held_at + self.hold_s - time.monotonic()))
            self._publish_now.clear()
            try:  # e.g. Redis lost after a write, reading the epoch: the thread goes on
                with self._send_lock:
                    if not self._holds():
                        self._send_unsent()
            except Exception:  # noqa: BLE001
                log.exception("event publisher: write failed")

    def on_events(self, events: list[Event]) -> None:
        """Write one tick's events to their requests' streams (only for requests it owns); with
        a publisher thread (:meth:`start_publisher`), hand them to it and return at once
        (engine thread).

        When Redis is unreachable the events wait, in order, and go out with the next write or
        :meth:`flush_events`; the engine goes on generating meanwhile.
        """
        tagged = self.state.tag(events)  # now: a later take of the same id may follow at once
        # Kept before anything here that can fail (a nudge meets an unreachable Redis): a tick's
        # events lost here would leave a gap in each of its streams.
        with self._unsent_lock:
            self._unsent.extend(tagged)
            self._ticks += 1
        if any(isinstance(e, FinalEvent) for e in events):
            self.state.row_freed.set()
            if self.state.waiting_full:  # a main thread waiting with its rows full: a row is free
                try:
                    self.queue.nudge()
                except Exception:  # noqa: BLE001 - its poll's timeout wakes it anyway
                    log.debug("could not nudge the main thread", exc_info=True)
        if self._publisher is not None:
            self._publish_now.set()
            return
        with self._send_lock:
            self._send_unsent()

    def flush_events(self, *, held: bool = True) -> None:
        """Write the events that wait, the publisher's included (main thread; raises while Redis
        is unreachable). Returns once every event handed over before the call is written;
        ``held`` False leaves a tick the publisher holds (module docstring) to it (the main
        loop's flush, which writes what an outage kept back)."""
        with self._send_lock:
            if not self._unsent:
                return
            if not held:
                with self._unsent_lock:
                    if (self._held_at is not None and self._ticks == 1
                            and time.monotonic() < self._held_at + self.hold_s):
                        return
            self._send_unsent(raise_errors=True)

    def _holds(self) -> bool:
        """Whether the waiting events wait on for the next tick's (the publisher thread, holding
        ``_send_lock``; module docstring): a tick of tokens after each request's first, alone,
        is held; a held one goes once another tick's events come or its hold is over."""
        with self._unsent_lock:
            if self._held_at is not None:
                return self._ticks == 1 and time.monotonic() < self._held_at + self.hold_s
            if (self.hold_s <= 0 or self._ticks != 1 or self._publisher_stop
                    or not all(isinstance(e, TokenEvent) and e.seq > 0 for e, _ in self._unsent)
                    or len({e.request_id for e, _ in self._unsent}) < self.hold_min_streams):
                return False
            self._held_at = time.monotonic()
            return True

    def _send_unsent(self, raise_errors: bool = False) -> None:
        """Write the waiting events (the caller holds ``_send_lock``)."""
        with self._unsent_lock:
            events, self._unsent = self._unsent, []
            self._ticks, self._held_at = 0, None
        if not events:
            return
        counts = self.state.unstarted_prompts((e.request_id, take) for e, take in events)
        try:
            lost = self.queue.write_events(events, EVENTS_TTL_S, counts)
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
        if lost and self.lost_sink is not None:
            self.lost_sink()
        for event, take in events:
            if (event.request_id, take) in lost:
                continue
            if isinstance(event, TokenEvent):
                self.state.mark_started(event.request_id, take)
                live = self.state.get(event.request_id)
                if live is not None and live.take == take:  # what its stream holds
                    live.streamed = max(live.streamed, event.seq + 1)
            else:
                ended = self.state.forget(event.request_id, take)
                # A batch line's usage is recorded by its batch's step, with the other lines
                # it collects (api.batch_runner); the reconciliation records what it misses.
                if ended is not None and not ended.message.batch:
                    self.state.record_ended(event.request_id)
        for request_id, take in lost:
            wiped = self.state.wiped.get(request_id)
            if wiped is not None and wiped.take == take:
                final = next((e for e, t in events if e.request_id == request_id and t == take
                              and isinstance(e, FinalEvent)), None)
                if final is not None:
                    self.state.wiped.pop(request_id, None)
                    self.write_unowned_final(final, wiped)
                continue
            # Reclaimed while this worker was silent: another take serves it (or it ended).
            if self.state.drop_stale(request_id, take, self.engine.abort):
                log.warning("request %s is no longer this worker's: stopping it", request_id)

    def write_unowned_final(self, event: FinalEvent, live: LiveRequest) -> None:
        """End a request Redis lost: a retryable ``state_lost`` error (whatever the engine's own
        end: it was stopped for this), billed for the tokens its stream held when Redis lost it
        (those the engine generated since never reached a client), and the prompt computed.

        The final event and the request's usage entry are written without ownership (Redis no
        longer records who holds it); its id is queued for its usage.

        Raises:
            redis.RedisError: Redis is unreachable.
        """
        streamed = min(event.usage.completion_tokens, live.streamed)
        error = ErrorInfo(code=ErrorCode.STATE_LOST, retryable=True,
                          message="the server's request store restarted and lost this "
                                  "request; retry it",
                          details={"completion_tokens": streamed})
        lost = FinalEvent(
            request_id=event.request_id, seq=event.seq, finish_reason=FinishReason.ERROR,
            usage=event.usage.model_copy(update={"completion_tokens": streamed}),
            text=event.text, timings=event.timings, error=error,
            choices=whole_request_choices(len(event.choices), FinishReason.ERROR, error))
        stream = self.keys.events(event.request_id)
        entry = {"final": lost.model_dump_json(), "body": live.message.to_json(),
                 "first_at": None, "finished_at": time.time()}
        pipe = self.client.pipeline(transaction=False)
        pipe.xadd(stream, encode_event(lost))
        pipe.expire(stream, EVENTS_TTL_S)
        pipe.hset(self.keys.usage_pending, event.request_id, json.dumps(entry))
        pipe.execute()
        self.state.record_ended(event.request_id)
