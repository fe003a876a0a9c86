"""A worker's intake: what it takes from the shared queue and when, and the requests its engine
preempted going back (a mixin of :class:`inference.worker.bridge.WorkerBridge`; main thread, except
:meth:`Intake.on_preempted`).

- A worker takes only what it can start soon: its free rows and ``WORKER_PREFETCH`` more, less
  what already waits in its engine (:meth:`Intake.room`). With priority preemption on, a worker
  whose rows are full still takes requests of a higher tier than its lowest preemptible decode
  rows, as many as it has such rows (:meth:`Intake.preempt_room`): its engine preempts for them
  at its next tick. It then waits for an enqueue or for a row of its own to free up, whichever
  comes first.
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

import base64
import dataclasses
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from inference.engine.llm_engine import EngineRefusal, EngineStoppedError, QueueFullError
from inference.engine.request import ResumeState, SamplingParams
from inference.protocol.events import ErrorCode, ErrorInfo, FinalEvent, FinishReason
from inference.protocol.keys import EVENTS_TTL_S
from inference.protocol.messages import RequestMessage, Resume
from inference.worker.fair_queue import QueuedRequest
from inference.worker.preparation import queue_timeout, submit_args

if TYPE_CHECKING:
    from inference.worker.bridge import WorkerBridge

log = logging.getLogger(__name__)


@dataclass
class LiveRequest:
    """A request this worker took from Redis and has not finished (nor handed back)."""

    message: RequestMessage
    prompt_tokens: int = 0
    started: bool = False  # whether its first event was handed to Redis


def to_wire(state: ResumeState) -> Resume:
    """The resume state a preempted request's message carries to the next worker."""
    return Resume(
        prompt_tokens=state.prompt_len, max_tokens=state.sampling.max_tokens,
        generated=state.generated, next_seq=state.next_seq, preemptions=state.preemptions,
        cached_prompt_tokens=state.cached_prompt_tokens, arrived_at=state.arrived_at,
        admitted_at=state.admitted_at, first_token_at=state.first_token_at,
        requeued_at=time.time(),
        sampler_state=(None if state.sampler_state is None
                       else base64.b64encode(state.sampler_state).decode()))


def from_wire(message: RequestMessage, sampling: SamplingParams) -> ResumeState:
    """The engine's resume state of a message that carries one (``sampling``: the message's,
    as :func:`inference.worker.preparation.submit_args` resolved it; ``max_tokens`` is the
    state's)."""
    resume = message.resume
    assert resume is not None
    return ResumeState(
        request_id=message.request_id, prompt_len=resume.prompt_tokens,
        sampling=dataclasses.replace(sampling, max_tokens=resume.max_tokens),
        generated=tuple(resume.generated), next_seq=resume.next_seq,
        preemptions=resume.preemptions, cached_prompt_tokens=resume.cached_prompt_tokens,
        arrived_at=resume.arrived_at, admitted_at=resume.admitted_at,
        first_token_at=resume.first_token_at,
        sampler_state=(None if resume.sampler_state is None
                       else base64.b64decode(resume.sampler_state)))


class Intake:
    """Requests in, and preempted requests back out (module docstring)."""

    _preempted: list[ResumeState]
    _preempted_lock: threading.Lock
    _waiting_full: bool  # the main thread waits with its rows full (a freed row nudges it)

    def _init_intake(self: WorkerBridge) -> None:
        self._preempted = []
        self._preempted_lock = threading.Lock()
        self._waiting_full = False
        self.engine.preempt_sink = self.on_preempted

    def room(self: WorkerBridge) -> int:
        """Requests this worker may take now: its free rows and ``prefetch`` more, less those
        already waiting in its engine."""
        stats = self.engine.stats()
        free = stats["max_batch_size"] - stats["num_active"] - stats["num_prefilling"]
        return max(0, free) + self.prefetch - self.engine.num_queued()

    def preempt_room(self: WorkerBridge) -> tuple[int, int] | None:
        """``(n, tier)``: with its rows full, this worker may take ``n`` requests of a higher
        tier than ``tier`` (its lowest preemptible decode rows: as many as it has there, less
        the requests of a higher tier already waiting in its engine); None: none."""
        stats = self.engine.stats()
        rows = stats.get("preemptible_rows")
        if not rows:
            return None
        submitted_since = max(0, self.engine.num_queued() - stats["num_pending"])
        n = rows["rows"] - rows["pending_above"] - submitted_since
        return (n, rows["tier"]) if n > 0 else None

    def poll(self: WorkerBridge, block_ms: int = 50) -> int:
        """Take what this worker can start soon, in the deployment's fair order; return how many.

        Preempted requests go back to the queue first. With room and nothing waiting it blocks
        up to ``block_ms`` for the next enqueue; with its rows full of rows it may preempt, up
        to ``block_ms`` for a higher tier's enqueue or a row of its own to end; with no room
        otherwise, up to ``block_ms`` for one of its requests to end. Woken, it takes at once.
        """
        self.hand_back_preempted()
        room = self._room_now()
        if room is None:
            # Until a row frees up (a request's end wakes it) or the poll interval passes.
            self._row_freed.wait(block_ms / 1000)
            self._row_freed.clear()
            return 0
        taken = self.queue.take(*room)
        if not taken:
            above = room[1]
            self._waiting_full = above is not None  # then a row of ours ending nudges it
            try:
                woken = self.queue.wait(block_ms / 1000, above=above)
            finally:
                self._waiting_full = False
            if woken:
                self.hand_back_preempted()
                room = self._room_now()
                taken = self.queue.take(*room) if room is not None else []
        for request in taken:
            self._take(request)
        return len(taken)

    def _room_now(self: WorkerBridge) -> tuple[int, int | None] | None:
        """``(n, None)``: take up to ``n`` (:meth:`room`); ``(n, tier)``: rows full, take up to
        ``n`` of a higher tier than ``tier`` (:meth:`preempt_room`); None: take nothing."""
        if not self._accepting:
            return None
        room = self.room()
        if room > 0:
            return room, None
        return self.preempt_room()

    def _take(self: WorkerBridge, queued: QueuedRequest) -> None:
        self._held += 1  # counted in gate 1 until its engine admits it
        message = queued.message
        if message is None:
            self._end_unadmitted(queued.request_id, FinishReason.ERROR, ErrorInfo(
                code=ErrorCode.INVALID_REQUEST, message="the request message was malformed"))
            return
        rid = message.request_id
        if self.client.exists(self.keys.aborted(rid)) or not self._origin_alive(message.origin):
            self._end_unadmitted(rid, FinishReason.ABORT, message=message)
            return
        expired = queue_timeout(message)
        if expired is not None:
            self._end_unadmitted(rid, FinishReason.ERROR, expired, message)
            return
        try:
            kwargs = submit_args(message, self.engine.tokenizer, self.engine.max_model_len)
            if message.resume is not None:  # preempted: it goes on where it stopped
                kwargs["resume"] = from_wire(message, kwargs["sampling"])
            with self._live_lock:
                self._live[rid] = LiveRequest(message, len(kwargs["prompt_token_ids"]))
            self.engine.submit(**kwargs)
        except (QueueFullError, EngineStoppedError):
            # This worker cannot take it now: back to its place for any worker (still counted).
            self._forget(rid)
            self._held -= 1
            self.queue.requeue([rid])
            return
        except EngineRefusal as exc:
            self._forget(rid)
            self._end_unadmitted(rid, FinishReason.ERROR, exc.error, message)
            return
        if self.client.exists(self.keys.aborted(rid)):
            self.engine.abort(rid)  # the abort may have been published before we submitted

    def _end_unadmitted(self: WorkerBridge, request_id: str, reason: FinishReason,
                        error: ErrorInfo | None = None,
                        message: RequestMessage | None = None) -> None:
        """Finish a request this worker took that never entered its engine (a preempted one:
        after the events it streamed, billed for them)."""
        resume = message.resume if message is not None else None
        event = FinalEvent(request_id=request_id, finish_reason=reason, error=error)
        if resume is not None:
            event = event.model_copy(update={"seq": resume.next_seq, "usage": resume.usage()})
        lost = self.queue.write_events([event], EVENTS_TTL_S)
        self._count_ended(reason)
        self._held -= 1
        self.queue.release_held(1)
        if not lost:
            self._ended.put(request_id)

    # -- preempted requests ----------------------------------------------------------------

    def on_preempted(self: WorkerBridge, states: list[ResumeState]) -> None:
        """The engine preempted these requests (engine thread, after their tick's events):
        they go back to the shared queue from the main thread (:meth:`hand_back_preempted`)."""
        with self._preempted_lock:
            self._preempted.extend(states)
        self._row_freed.set()
        try:
            self.queue.nudge()
        except Exception:  # noqa: BLE001 - the next poll hands them back anyway
            log.debug("could not nudge the main thread", exc_info=True)

    def hand_back_preempted(self: WorkerBridge) -> int:
        """Put the requests the engine preempted back at their places in the shared queue,
        after their events; return how many went back.

        Raises:
            redis.RedisError: Redis is unreachable (those not handed back yet wait for the
                next call).
        """
        with self._preempted_lock:
            states = list(self._preempted)
        if not states:
            return 0
        self.flush_events()  # every token it streamed is in its stream before it moves
        back = 0
        for state in states:
            back += self._hand_back(state)
            with self._preempted_lock:
                self._preempted.remove(state)
        return back

    def _hand_back(self: WorkerBridge, state: ResumeState) -> int:
        rid = state.request_id
        with self._live_lock:
            live: LiveRequest | None = self._live.get(rid)
        resume = to_wire(state)
        usage = resume.usage()
        if live is None:  # ended meanwhile: reclaimed, or lost with Redis's data
            wiped = self._wiped.pop(rid, None)
            if wiped is not None:
                self._write_unowned_final(FinalEvent(
                    request_id=rid, seq=state.next_seq, finish_reason=FinishReason.ABORT,
                    usage=usage), wiped)
            return 0
        if self.client.exists(self.keys.aborted(rid)) or not self._origin_alive(
                live.message.origin):
            lost = self.queue.write_events([FinalEvent(
                request_id=rid, seq=state.next_seq, finish_reason=FinishReason.ABORT,
                usage=usage)], EVENTS_TTL_S)
            self._forget(rid)
            self._count_ended(FinishReason.ABORT)
            if not lost:
                self._ended.put(rid)
            return 0
        message = live.message.model_copy(update={"resume": resume})
        back = self.queue.preempt(message, usage)
        self._forget(rid)
        if not back:
            log.warning("preempted request %s is no longer this worker's", rid)
        return int(back)
