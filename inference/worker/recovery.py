"""What a worker does when something else died, or it is told to stop (:class:`Recovery`, owned by
:class:`inference.worker.bridge.WorkerBridge`; main thread, except
:meth:`Recovery.check_data_loss`).

- :meth:`Recovery.audit` (every heartbeat): a live request with an abort mark stops (its pub/sub
  message was missed), a live request whose web process is gone stops (nobody reads its answer),
  and a request the queue says this worker took but the worker does not hold (the reply of a take
  was lost) goes back to its place.
- :meth:`Recovery.housekeep` (every heartbeat): waiting requests past their admission deadline
  end, and dead workers' requests are reclaimed, as this worker's own sight of Redis allows
  (:mod:`inference.protocol.liveness`: not for a heartbeat TTL after Redis stopped answering it,
  or after it was paused itself); :meth:`Recovery.reclaim_predecessor` (its first heartbeat):
  what an earlier process under this worker's id left.
- Its heartbeat lapsed and it was reclaimed (:meth:`Recovery.on_reclaimed`: its next heartbeat,
  or its next take, which Redis refuses until then, says so): it stops everything it still holds,
  every take of which is stale (another worker has it, it went back to the queue, or it ended
  with ``worker_lost``), and registers afresh; only then does it take again.
- Redis lost its data (the deployment's epoch changed, :meth:`Recovery.check_epoch` at each
  heartbeat, :meth:`Recovery.check_data_loss` when a write finds requests no longer this
  worker's, or when a heartbeat finds it gone from the heartbeats: a loss after that heartbeat's
  epoch read looks like a reclaim, and is told apart by the epoch): it stops what it ran and
  bills each request for what was computed (the final event and usage entry written without
  ownership, by the event publisher).
- :meth:`Recovery.begin_drain` then :meth:`Recovery.shutdown` (SIGTERM): no new work, unadmitted
  requests back to the queue, the running ones finish within the grace period.
"""

from __future__ import annotations

import logging
import time
import uuid

import redis

from inference.engine.llm_engine import LLMEngine
from inference.engine.request import Request
from inference.protocol.events import FinishReason
from inference.protocol.keys import EVENTS_TTL_S, Keys
from inference.worker.fair_queue import FairQueue
from inference.worker.intake import Intake
from inference.worker.live import WorkerState
from inference.worker.origins import WebOrigins
from inference.worker.publisher import EventPublisher

log = logging.getLogger(__name__)


class Recovery:
    """Audits, reclaims, Redis data loss, drain and shutdown of one worker (module docstring).

    Args:
        state: the worker's shared state.
        engine: the worker's engine (what it stops or withdraws).
        queue: the shared queue's client.
        client: a Redis client (``decode_responses=False``).
        keys: key names.
        worker_id: this worker's heartbeat member and stats key.
        publisher: the worker's event writer (stopped and flushed at shutdown).
        intake: the worker's intake (gate 1's held count; preempted requests handed back at
            shutdown).
        origins: judges whether a request's web process is alive.
    """

    def __init__(self, state: WorkerState, engine: LLMEngine, queue: FairQueue,
                 client: redis.Redis, keys: Keys, worker_id: str, *,
                 publisher: EventPublisher, intake: Intake, origins: WebOrigins):
        self.state = state
        self.engine = engine
        self.queue = queue
        self.client = client
        self.keys = keys
        self.worker_id = worker_id
        self.publisher = publisher
        self.intake = intake
        self.origins = origins
        self._audit_stopped: set[str] = set()

    def audit(self) -> None:
        """Compare what this worker holds with what Redis says (every heartbeat).

        - a live request with an abort mark is stopped (its pub/sub message was missed);
        - a live request whose web process is gone is stopped (nobody reads its answer);
        - a request the queue says this worker took but the worker does not hold (the reply
          of a take was lost) goes back to its place.

        Raises:
            redis.RedisError: Redis is unreachable.
        """
        live = self.state.live_origins()
        # A stop ordered at an earlier heartbeat may still wait for a slow tick to end: it is
        # ordered again (abort is idempotent) but logged only the first time.
        self._audit_stopped &= live.keys()
        if live:
            pipe = self.client.pipeline(transaction=False)
            for rid in live:
                pipe.exists(self.keys.aborted(rid))
            marks = pipe.execute()
            gone = {o for o in set(live.values()) if o and not self.origins.alive(o)}
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
        strays = self.queue.takes(self.state.missing(taken))
        if strays:
            log.warning("%d request(s) recorded as taken by this worker that it does not hold: "
                        "back to the queue", len(strays))
            self.queue.requeue(strays)  # each also leaves this worker's held count

    # -- reclaims ---------------------------------------------------------------------------

    def housekeep(self, heartbeat_ttl_s: float) -> None:
        """End waiting requests past their admission deadline, and reclaim dead workers' ones.

        The same scripts run in the web tiers and a Celery beat task (whoever runs first does
        the work, once); the requests ended here have their usage recorded through this worker.
        Heartbeats are judged against this worker's own sight of Redis (``state.sight``): for a
        heartbeat TTL after Redis stopped answering it (or after it was paused), none is.

        Raises:
            redis.RedisError: Redis is unreachable.
        """
        for request_id in self.queue.expire(EVENTS_TTL_S):
            self.state.count_outside(FinishReason.ERROR)
            self.state.record_ended(request_id)
        requeued, workers, ended = self.queue.reclaim(heartbeat_ttl_s, EVENTS_TTL_S,
                                                      sight_s=self.state.sight.seconds())
        if workers:
            log.warning("reclaimed dead worker(s) %s: %d request(s) back in the queue, %d ended",
                        ", ".join(workers), requeued, len(ended))
        for request_id in ended:
            self.state.count_outside(FinishReason.ERROR)
            self.state.record_ended(request_id)

    def reclaim_predecessor(self, ttl_s: float) -> None:
        """Reclaim what a process that ran under this worker's id before and died left under it
        (its first heartbeat, holding nothing yet): taken requests go back to the queue, running
        ones end."""
        requeued, _, ended = self.queue.reclaim(ttl_s, EVENTS_TTL_S, include_self=True,
                                                sight_s=self.state.sight.seconds())
        if requeued or ended:
            log.warning("an earlier process under this worker's id left %d request(s) "
                        "taken (back in the queue) and %d running (ended)", requeued,
                        len(ended))
        for request_id in ended:
            self.state.record_ended(request_id)

    def on_reclaimed(self) -> None:
        """This worker's heartbeat lapsed and its requests were reclaimed: stop what it still
        holds, drop its gate-1 count, and register afresh (then it may take again).

        Everything it holds is stale then: Redis refuses its takes from the reclaim until this
        runs (``take.lua``), so each take it holds came before the reclaim. The requests its
        engine still runs are stopped; one it takes again later enters the engine once the
        stale take has left it (:class:`inference.worker.intake.Intake`).

        Raises:
            redis.RedisError: Redis is unreachable (it runs again at the next heartbeat).
        """
        live = list(self.state.take_all())
        self.intake.withdraw_waiting()
        log.error("this worker's heartbeat lapsed and its %d request(s) were reclaimed: "
                  "stopping them", len(live))
        for request_id in live:
            self.engine.abort(request_id)
        self.state.held = 0
        self.queue.drop_releases()
        self.register()

    def register(self) -> None:
        """Publish this worker's heartbeat afresh, with no request held (its first heartbeat,
        after a reclaim or a loss of Redis's data): its gate-1 count and its reclaimed mark go.

        Raises:
            redis.RedisError: Redis is unreachable.
        """
        pipe = self.client.pipeline(transaction=True)
        pipe.hdel(self.keys.fq("held"), self.worker_id)
        pipe.delete(self.keys.fq("reclaimed", self.worker_id))
        pipe.zadd(self.keys.workers, {self.worker_id: time.time()})
        pipe.execute()

    # -- Redis losing its data ----------------------------------------------------------------

    def check_epoch(self) -> None:
        """Read the deployment's epoch (every heartbeat); one that changed since the last read
        means Redis lost its data (:meth:`_on_wiped`)."""
        if self.state.epoch is None or self._epoch_changed():
            if self.state.epoch is not None:
                self._on_wiped()
            self.state.epoch = self._read_epoch()

    def check_data_loss(self) -> bool:
        """A write found requests no longer this worker's (the writing thread), or a heartbeat
        found this worker gone from the heartbeats: if the epoch changed, Redis lost its data
        (:meth:`_on_wiped`; returns True); else another worker reclaimed them (False).

        Raises:
            redis.RedisError: Redis is unreachable.
        """
        if self._epoch_changed():
            self._on_wiped()
            return True
        return False

    def _read_epoch(self) -> str:
        self.client.set(self.keys.epoch, uuid.uuid4().hex, nx=True)
        value = self.client.get(self.keys.epoch)
        return value.decode() if isinstance(value, bytes) else str(value)

    def _epoch_changed(self) -> bool:
        if self.state.epoch is None:
            return False
        value = self.client.get(self.keys.epoch)
        current = value.decode() if isinstance(value, bytes) else value
        return current != self.state.epoch

    def _on_wiped(self) -> None:
        """Redis lost its data: the requests this worker holds are in no queue any more, and
        their readers ended them. Stop them; bill each for what was computed (its final event
        is written without ownership, with its usage entry)."""
        self.intake.withdraw_waiting()  # never in the engine: nothing to stop nor to bill
        live = self.state.take_all()
        log.error("Redis lost its data (the epoch changed): stopping this worker's %d "
                  "request(s)", len(live))
        self.state.wiped.update(live)
        for request_id in live:
            self.engine.abort(request_id)
        self.state.held = 0
        self.queue.drop_releases()
        self.state.registered = False
        self.state.epoch = self._read_epoch()

    # -- drain and shutdown -----------------------------------------------------------------

    def begin_drain(self) -> int:
        """Stop taking work and hand the requests not yet admitted back to their places in the
        shared queue (for another worker); the running ones go on. Returns how many went back.

        Raises:
            redis.RedisError: Redis is unreachable.
        """
        self.state.accepting = False
        withdrawn = self.engine.withdraw_pending()
        back, held = self._withdrawn(withdrawn)
        self.queue.requeue(back)
        self.state.held -= held
        self.intake.reconcile_queue()
        return len(back)

    def _withdrawn(self, withdrawn: list[Request]) -> tuple[dict[str, str], int]:
        """The requests the engine gave back (never admitted) and those taken again that wait
        beside it, as ``{request id: take token}`` of the takes this worker still holds (a stale
        take leaves the engine with nothing to hand back), and how many of them this worker
        holds in gate 1 (the interactive ones)."""
        waiting = self.intake.withdraw_waiting()
        back = {rid: q.take for rid, q in waiting.items()}
        held = sum(1 for q in waiting.values() if not q.batch)
        for request in withdrawn:
            take = self.state.left_engine(request.request_id)
            if take is not None and self.state.forget(request.request_id, take) is not None:
                back[request.request_id] = take
                held += int(not request.batch)
        return back, held

    def busy(self) -> bool:
        """Whether this worker still runs requests or has events to write."""
        return self.state.holds_any() or bool(self.publisher.num_unsent())

    def shutdown(self, timeout_s: float) -> int:
        """Stop taking work, hand unadmitted requests back to Redis, end the rest.

        In-flight requests end with a ``worker_shutdown`` error event (from the engine).

        Returns:
            How many requests went back to their places in the shared queue, for another worker.

        Raises:
            redis.RedisError: Redis is unreachable.
        """
        self.state.accepting = False
        withdrawn = self.engine.shutdown(timeout_s)
        self.publisher.stop_publisher()  # the engine's last events: written below, on this thread
        back, held = self._withdrawn(withdrawn)
        # Still counted in gate 1: back to their places in the queue, for another worker.
        self.queue.requeue(back)
        self.state.held -= held
        self.intake.reconcile_queue()
        self.publisher.flush_events()
        preempted = self.intake.hand_back_preempted()  # preempted in its last ticks: any worker's
        self.state.flush_usage()
        # Its heartbeat is left to age out rather than removed: requests sent meanwhile wait in
        # the queue for the next worker (a restart of the only one) instead of being refused
        # with no_worker_available; after the TTL it is reclaimed (nothing is left to take).
        self.client.delete(self.keys.stats(self.worker_id))
        self.client.hdel(self.keys.fq("held"), self.worker_id)
        return len(back) + preempted
