"""A worker's intake: what it takes from the shared queue and when, its count in gate 1, and the
requests its engine preempted going back (:class:`Intake`, owned by
:class:`inference.worker.bridge.WorkerBridge`; main thread, except :meth:`Intake.on_preempted`).

- A worker takes only what it can start soon: its free rows and ``WORKER_PREFETCH`` more, less
  what already waits in its engine (:meth:`Intake.room`). With priority preemption on, a worker
  whose rows are full still takes requests of a higher tier than its lowest preemptible decode
  rows, as many as it has such rows (:meth:`Intake.preempt_room`): its engine preempts for them
  at its next tick. It then waits for an enqueue or for a row of its own to free up, whichever
  comes first (:meth:`Intake.poll`).
- A request it takes counts in gate 1 until its engine admits it (:meth:`Intake.reconcile_queue`
  releases those that left the engine's pending queue) or it ends.
- A request it takes again while its engine still holds an earlier take of it (this worker was
  paused past its heartbeat TTL, reclaimed, and the request went back to the queue) waits beside
  the engine: the earlier take is stopped, and the new one enters the engine once the earlier
  one has left it (:meth:`Intake.poll` starts it then). The earlier take's events carry its own
  take token, so Redis drops them; the new take is served in full.
- A request its engine preempted leaves the engine with its
  :class:`~inference.engine.request.ResumeState` (:meth:`Intake.on_preempted`, engine thread). The
  main thread writes the request's events first, then puts it back at its place in the shared queue
  with that state in its message (:class:`~inference.protocol.messages.Resume`), for any worker; one
  whose client left meanwhile ends here instead, billed for what it streamed
  (:meth:`Intake.hand_back_preempted`).
- A message with a resume state is submitted to continue where it stopped: the same request id
  and events stream, the next ``seq``, the text, random draws, timings and usage going on.
"""

from __future__ import annotations

import logging
import threading

import redis

from inference.engine.llm_engine import (
    EngineRefusal,
    EngineStoppedError,
    LLMEngine,
    QueueFullError,
)
from inference.engine.request import BATCH_TIER, ResumeState
from inference.protocol.events import (
    ErrorCode,
    ErrorInfo,
    FinalEvent,
    FinishReason,
    Usage,
    whole_request_choices,
)
from inference.protocol.keys import EVENTS_TTL_S, Keys
from inference.protocol.messages import RequestMessage
from inference.worker.fair_queue import FairQueue, QueuedRequest
from inference.worker.live import LiveRequest, WorkerState
from inference.worker.origins import WebOrigins
from inference.worker.preparation import from_wire, queue_timeout, submit_args, to_wire
from inference.worker.publisher import EventPublisher

log = logging.getLogger(__name__)


class Intake:
    """Requests in, gate 1's held count, and preempted requests back out (module docstring).

    Args:
        state: the worker's shared state (its live requests, held count, ended ids).
        engine: the engine the requests are submitted to.
        queue: the shared queue's client.
        client: a Redis client (abort marks).
        keys: key names.
        publisher: the worker's event writer (a preempted request's events go out before it
            moves; one Redis lost is ended without ownership).
        origins: judges whether a request's web process is alive.
        prefetch: requests this worker takes beyond its free rows (``WORKER_PREFETCH``): it takes
            only what it can start soon, so the shared queue, not the worker that read first,
            decides each request's place.
        batch_prefetch: batch requests it may hold beyond its free rows
            (``WORKER_BATCH_PREFETCH``; None: ``prefetch``): batch work has no one waiting on a
            stream, so a freed row is refilled from the engine at its next tick rather than
            after a take from Redis.
    """

    def __init__(self, state: WorkerState, engine: LLMEngine, queue: FairQueue,
                 client: redis.Redis, keys: Keys, *, publisher: EventPublisher,
                 origins: WebOrigins, prefetch: int, batch_prefetch: int | None = None):
        self.state = state
        self.engine = engine
        self.queue = queue
        self.client = client
        self.keys = keys
        self.publisher = publisher
        self.origins = origins
        self.prefetch = max(0, prefetch)
        self.batch_prefetch = self.prefetch if batch_prefetch is None else max(0, batch_prefetch)
        # Preempted requests (engine thread) with the take token of the take preempted.
        self._preempted: list[tuple[ResumeState, str]] = []
        self._preempted_lock = threading.Lock()
        # Requests taken again while the engine still holds an earlier take of them, by id
        # (main thread): each enters the engine once that one has left it.
        self._waiting: dict[str, QueuedRequest] = {}

    def num_waiting(self) -> int:
        """Requests taken again that wait for an earlier take of theirs to leave the engine."""
        return len(self._waiting)

    def room(self, prefetch: int | None = None) -> int:
        """Requests this worker may take now: its free rows and ``prefetch`` (None: its own)
        more, less those already waiting in its engine or beside it (taken again,
        :meth:`num_waiting`)."""
        stats = self.engine.stats()
        free = stats["max_batch_size"] - stats["num_active"] - stats["num_prefilling"]
        return (max(0, free) + (self.prefetch if prefetch is None else prefetch)
                - self.engine.num_queued() - len(self._waiting))

    def preempt_room(self) -> tuple[int, int] | None:
        """``(n, tier)``: with its rows full, this worker may take ``n`` requests of a higher
        tier than ``tier`` (its lowest preemptible decode rows: as many as it has there, less
        the requests of a higher tier already waiting in its engine); None: none."""
        stats = self.engine.stats()
        rows = stats.get("preemptible_rows")
        if not rows:
            return None
        submitted_since = max(0, self.engine.num_queued() - stats["num_pending"])
        n = rows["rows"] - rows["pending_above"] - submitted_since - len(self._waiting)
        return (n, rows["tier"]) if n > 0 else None

    def poll(self, block_ms: int = 50) -> int:
        """Take what this worker can start soon, in the deployment's fair order; return how many.

        Preempted requests go back to the queue first, and requests taken again whose earlier
        take left the engine enter it. With room and nothing waiting it blocks up to
        ``block_ms`` for the next enqueue; with its rows full of rows it may preempt, up to
        ``block_ms`` for a higher tier's enqueue or a row of its own to end; with no room
        otherwise, up to ``block_ms`` for one of its requests to end. Woken, it takes at once.

        Raises:
            Reclaimed: this worker was reclaimed while silent (it takes nothing until it has
                stopped what it held: :meth:`inference.worker.recovery.Recovery.on_reclaimed`).
        """
        self.hand_back_preempted()
        self._start_waiting()
        room = self._room_now()
        n, above, batch = room if room is not None else (0, None, 0)
        taken = self.queue.take(n, above, batch_extra=batch)
        if not taken and n <= 0:
            # Until a row frees up (a request's end wakes it) or the poll interval passes (only
            # batch work to prefetch: no enqueue's wake-up is this worker's).
            self.state.row_freed.wait(block_ms / 1000)
            self.state.row_freed.clear()
            return 0
        if not taken:
            self.state.waiting_full = above is not None  # then a row of ours ending nudges it
            try:
                woken = self.queue.wait(block_ms / 1000, above=above)
            finally:
                self.state.waiting_full = False
            if woken:
                self.hand_back_preempted()
                again = self._room_now()
                taken = (self.queue.take(again[0], again[1], batch_extra=again[2])
                         if again is not None else [])
        for request in taken:
            self._take(request)
        return len(taken)

    def interactive_room(self) -> int:
        """Interactive requests this worker may take beside the batch ones waiting in its engine
        (held back by the ITL rule, ``docs/design.md``, "The batch service class"): :meth:`room`
        without them, as any interactive request sorts before them."""
        stats = self.engine.stats()
        return self.room() + stats.get("num_pending_batch", 0)

    def _room_now(self) -> tuple[int, int | None, int] | None:
        """``(n, None, b)``: take up to ``n`` (:meth:`room`); ``(n, tier, b)``: up to ``n`` of a
        higher tier than ``tier`` (:meth:`interactive_room`, :meth:`preempt_room`); then up to
        ``b`` batch requests more (``batch_prefetch``); None: nothing."""
        if not self.state.accepting:
            return None
        room = self.room()
        batch = max(0, self.room(self.batch_prefetch) - max(0, room))
        if room > 0:
            return room, None, batch
        beside_batch = self.interactive_room()
        preempt = self.preempt_room()
        if beside_batch > 0:  # batch rows to preempt as well: the larger room of the two
            batch_rows = preempt[0] if preempt is not None and preempt[1] == BATCH_TIER else 0
            return max(beside_batch, batch_rows), BATCH_TIER, batch
        if preempt is not None:
            return preempt[0], preempt[1], batch
        return (0, None, batch) if batch else None

    def _take(self, queued: QueuedRequest) -> None:
        self.state.held += int(not queued.batch)  # in gate 1 until its engine admits it
        self._start(queued)

    def _start(self, queued: QueuedRequest) -> None:
        """Submit a request taken (and counted in ``held``) to the engine, or end it here."""
        message, take = queued.message, queued.take
        if message is None:
            self._end_unadmitted(queued.request_id, take, FinishReason.ERROR, ErrorInfo(
                code=ErrorCode.INVALID_REQUEST, message="the request message was malformed"),
                batch=queued.batch)
            return
        rid = message.request_id
        if self.client.exists(self.keys.aborted(rid)) or not self.origins.alive(message.origin):
            self._end_unadmitted(rid, take, FinishReason.ABORT, message=message)
            return
        expired = queue_timeout(message)
        if expired is not None:
            self._end_unadmitted(rid, take, FinishReason.ERROR, expired, message)
            return
        if not self.state.enter_engine(rid, take):
            # Taken again while the engine still holds an earlier take of it (reclaimed from
            # this worker while it was paused): that one stops, and this one enters the engine
            # once it has left (its final event, or its preemption, says so).
            log.warning("request %s taken again while an earlier take of it is in the engine: "
                        "stopping that one first", rid)
            self.state.add(rid, LiveRequest(message, take))
            self._waiting[rid] = queued
            self.engine.abort(rid)
            return
        try:
            kwargs = submit_args(message, self.engine.tokenizer, self.engine.max_model_len)
            if message.resume is not None:  # preempted: it goes on where it stopped
                kwargs["resume"] = from_wire(message, kwargs["sampling"])
            self.state.add(rid, LiveRequest(message, take, len(kwargs["prompt_token_ids"])))
            self.engine.submit(**kwargs)
        except (QueueFullError, EngineStoppedError):
            # This worker cannot take it now: back to its place for any worker (still counted).
            self.state.left_engine(rid)
            self.state.forget(rid, take)
            self.state.held -= int(not queued.batch)
            self.queue.requeue({rid: take})
            return
        except EngineRefusal as exc:
            self.state.left_engine(rid)
            self.state.forget(rid, take)
            self._end_unadmitted(rid, take, FinishReason.ERROR, exc.error, message)
            return
        if self.client.exists(self.keys.aborted(rid)):
            self.engine.abort(rid)  # the abort may have been published before we submitted

    def _start_waiting(self) -> None:
        """Submit the requests taken again whose earlier take has left the engine."""
        for rid, queued in list(self._waiting.items()):
            if self.state.in_engine(rid):
                continue
            del self._waiting[rid]
            if self.state.holds(rid, queued.take):  # not ended nor handed back meanwhile
                self.state.forget(rid, queued.take)
                self._start(queued)

    def withdraw_waiting(self) -> dict[str, QueuedRequest]:
        """Forget the requests taken again that wait beside the engine; return them by id (for
        a hand-back to the queue)."""
        waiting, self._waiting = self._waiting, {}
        return {rid: q for rid, q in waiting.items()
                if self.state.forget(rid, q.take) is not None}

    def reconcile_queue(self) -> None:
        """Release from gate 1 the requests that left this engine's pending queue (main thread).

        Those taken again that wait beside the engine are still held; batch requests never are
        (the engine's count read first: a tick ending between the reads releases less).

        Raises:
            redis.RedisError: Redis is unreachable (they are released at the next call).
        """
        queued = self.engine.num_queued() - self.engine.stats().get("num_pending_batch", 0)
        waiting = sum(1 for q in self._waiting.values() if not q.batch)
        left = max(0, self.state.held - queued - waiting)
        self.state.held -= left
        self.queue.release_held(left)  # with what an earlier call could not send

    def _end_unadmitted(self, request_id: str, take: str, reason: FinishReason,
                        error: ErrorInfo | None = None,
                        message: RequestMessage | None = None, batch: bool = False) -> None:
        """Finish a request this worker took that never entered its engine (a preempted one:
        after the events it streamed, billed for them)."""
        resume = message.resume if message is not None else None
        n = message.sampling.n if message is not None else 1
        event = FinalEvent(request_id=request_id, finish_reason=reason, error=error,
                           choices=whole_request_choices(n, reason, error))
        if resume is not None:
            event = event.model_copy(update={"seq": resume.next_seq, "usage": resume.usage(),
                                             "choices": resume.ended_choices(reason, error)})
        lost = self.queue.write_events([(event, take)], EVENTS_TTL_S)
        self.state.count_outside(reason)
        if not (message.batch if message is not None else batch):  # a batch one: never held
            self.state.held -= 1
            self.queue.release_held(1)
        if not lost:
            self.state.record_ended(request_id)

    # -- preempted requests ----------------------------------------------------------------

    def on_preempted(self, states: list[ResumeState]) -> None:
        """The engine preempted these requests (engine thread, after their tick's events):
        they go back to the shared queue from the main thread (:meth:`hand_back_preempted`)."""
        # Each has left the engine: with the take token of the take preempted.
        taken = [(s, self.state.left_engine(s.request_id) or "-") for s in states]
        with self._preempted_lock:
            self._preempted.extend(taken)
        self.state.row_freed.set()
        try:
            self.queue.nudge()
        except Exception:  # noqa: BLE001 - the next poll hands them back anyway
            log.debug("could not nudge the main thread", exc_info=True)

    def hand_back_preempted(self) -> int:
        """Put the requests the engine preempted back at their places in the shared queue,
        after their events; return how many went back.

        Raises:
            redis.RedisError: Redis is unreachable (those not handed back yet wait for the
                next call).
        """
        with self._preempted_lock:
            preempted = list(self._preempted)
        if not preempted:
            return 0
        self.publisher.flush_events()  # every token it streamed is in its stream before it moves
        back = 0
        for item in preempted:
            back += self._hand_back(*item)
            with self._preempted_lock:
                self._preempted.remove(item)
        return back

    def _hand_back(self, preempted: ResumeState, take: str) -> int:
        rid = preempted.request_id
        live = self.state.get(rid)
        started = bool(preempted.generated or preempted.choices)
        resume = to_wire(preempted) if started else None
        usage = resume.usage() if resume is not None else Usage()
        ended = (resume.ended_choices(FinishReason.ABORT) if resume is not None
                 else whole_request_choices(preempted.sampling.n, FinishReason.ABORT))
        if live is None or live.take != take:
            # Ended meanwhile (reclaimed, or lost with Redis's data), or a stale take of a
            # request taken again: nothing goes back.
            wiped = self.state.wiped.get(rid)
            if wiped is not None and wiped.take == take:
                del self.state.wiped[rid]
                self.publisher.write_unowned_final(FinalEvent(
                    request_id=rid, seq=preempted.next_seq, finish_reason=FinishReason.ABORT,
                    usage=usage, choices=ended), wiped)
            return 0
        if self.client.exists(self.keys.aborted(rid)) or not self.origins.alive(
                live.message.origin):
            lost = self.queue.write_events([(FinalEvent(
                request_id=rid, seq=preempted.next_seq, finish_reason=FinishReason.ABORT,
                usage=usage, choices=ended), take)],
                EVENTS_TTL_S)
            self.state.forget(rid, take)
            self.state.count_outside(FinishReason.ABORT)
            if not lost:
                self.state.record_ended(rid)
            return 0
        # A batch row preempted while it prefilled streamed nothing: its message goes back as
        # it came, to start again (docs/design.md, "The batch service class").
        message = (live.message if resume is None
                   else live.message.model_copy(update={"resume": resume}))
        back = self.queue.preempt(message, usage, take)
        self.state.forget(rid, take)
        if not back:
            log.warning("preempted request %s is no longer this worker's", rid)
        return int(back)
