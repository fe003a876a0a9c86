"""The Redis side of an inference worker: requests in, events out, aborts, stats, gate 1, usage.

:class:`WorkerBridge` owns one engine's collaborators and the one state object they share, and
calls them; each takes that state, the engine, the shared queue and the Redis client in its
constructor, and none imports the bridge. Where each method lives:

- :class:`~inference.worker.live.WorkerState`: the live-request table and what more than one
  part reads (the take of each request its engine holds, the wiped requests, the ended ids for
  usage and the counts of those ended outside the engine, gate 1's held count, the epoch, its
  sight of Redis); ``flush_usage``.
- :class:`~inference.worker.intake.Intake`: what the worker takes from the shared queue and when,
  its gate-1 count, and preempted requests going back: ``poll``, ``reconcile_queue``,
  ``on_preempted`` (engine thread), ``hand_back_preempted``.
- :class:`~inference.worker.publisher.EventPublisher`: events out, in order and once each, a
  Redis outage ridden out in a buffer: ``on_events`` (engine thread), ``flush_events``,
  ``start_publisher``, ``stop_publisher``, ``write_unowned_final``.
- :class:`~inference.worker.recovery.Recovery`: what the worker does when something else died,
  or it is told to stop (``docs/design.md``, "Faults"): ``audit``, ``housekeep``,
  ``reclaim_predecessor``, ``on_reclaimed``, ``check_epoch``, ``check_data_loss``,
  ``begin_drain``, ``busy``, ``shutdown``.
- :class:`~inference.worker.origins.WebOrigins`: whether a request's web process is alive.
- :class:`WorkerBridge` itself: :meth:`~WorkerBridge.on_control` (aborts, on a Redis pub/sub
  thread), :meth:`~WorkerBridge.charge_service` (the fairness counters) and
  :meth:`~WorkerBridge.publish_stats` (heartbeat and stats); and, for its callers (the main
  loop, :func:`inference.worker.main.serve`), a method of the same name that only calls the
  collaborator's for ``poll``, ``reconcile_queue``, ``flush_events``, ``flush_usage``,
  ``housekeep``, ``audit``, ``begin_drain``, ``busy``, ``shutdown``, ``start_publisher``,
  ``stop_publisher``, ``on_events`` and ``on_preempted``.

The engine's ``event_sink`` is the publisher's ``on_events`` and its ``preempt_sink`` the
intake's ``on_preempted``; the publisher's ``lost_sink`` is the recovery's ``check_data_loss``.
The rest runs on the worker's main thread (and the publisher's writes on its own thread, once
started).
Message schema and key names: :mod:`inference.protocol`; the shared request queue:
:mod:`inference.worker.fair_queue`; turning a message into a submission:
:mod:`inference.worker.preparation`. No tensor work happens here.
"""

from __future__ import annotations

import json
import logging
import time

import redis
from pydantic import ValidationError

from inference.engine.llm_engine import LLMEngine
from inference.engine.request import ResumeState
from inference.protocol.events import Event
from inference.protocol.keys import Keys
from inference.protocol.messages import ControlMessage
from inference.worker.fair_queue import FairQueue, Reclaimed
from inference.worker.intake import Intake
from inference.worker.live import UsageSink, WorkerState
from inference.worker.origins import WebOrigins
from inference.worker.publisher import EventPublisher
from inference.worker.recovery import Recovery

__all__ = ["UsageSink", "WorkerBridge"]

log = logging.getLogger(__name__)


class WorkerBridge:
    """Connects one :class:`LLMEngine` to Redis through its collaborators (module docstring).

    Args:
        engine: a started or not yet started engine; its ``event_sink`` and ``preempt_sink`` are
            set here (to the publisher and the intake).
        client: a Redis client (``decode_responses=False``).
        keys: key names (see :mod:`inference.protocol`).
        worker_id: this worker's heartbeat member and stats key.
        prefetch: requests this worker takes beyond its free rows (``WORKER_PREFETCH``): it takes
            only what it can start soon, so the shared queue, not the worker that read first,
            decides each request's place.
        batch_prefetch: batch requests it may hold beyond its free rows
            (``WORKER_BATCH_PREFETCH``; None: ``prefetch``).
        usage_sink: called on the main thread with the id of each request this worker ended
            (its usage entry is in the ledger; the sink has it recorded).
        web_ttl_s: a web process whose heartbeat is older than this is gone, with the clients
            of the answers it was streaming: those answers are stopped.
        heartbeat_ttl_s: the workers' heartbeat TTL (``WORKER_HEARTBEAT_TTL_S``): with
            ``web_ttl_s``, it sets how long Redis may go without answering this worker before
            its sight of Redis breaks (half the shorter one).
        event_hold_s: how long a tick's token events may wait for the next tick's
            (``EVENT_HOLD_MS``; :mod:`inference.worker.publisher`).
        event_hold_min_streams: the fewest streams a tick's tokens must go to for it to be
            held (``EVENT_HOLD_MIN_STREAMS``).
        model: the base model it serves (its name in the API), advertised in its stats; its
            queue is ``keys``'s (:meth:`inference.protocol.keys.Keys.of_model`).

    Attributes:
        state, intake, publisher, recovery, origins: the collaborators (module docstring).
    """

    def __init__(self, engine: LLMEngine, client: redis.Redis, keys: Keys, worker_id: str, *,
                 prefetch: int, batch_prefetch: int | None = None,
                 usage_sink: UsageSink | None = None, web_ttl_s: float = 10.0,
                 heartbeat_ttl_s: float = 10.0, event_hold_s: float = 0.0,
                 event_hold_min_streams: int = 1, model: str = ""):
        self.engine = engine
        self.model = model
        self.client = client
        self.keys = keys
        self.worker_id = worker_id
        self.queue = FairQueue(client, keys, worker_id, engine.config.scheduling_policy)
        self.state = WorkerState(usage_sink, sight_gap_s=min(web_ttl_s, heartbeat_ttl_s) / 2)
        self.origins = WebOrigins(self.state, client, keys, web_ttl_s)
        self.publisher = EventPublisher(self.state, engine, self.queue, client, keys,
                                        hold_s=event_hold_s,
                                        hold_min_streams=event_hold_min_streams)
        self.intake = Intake(self.state, engine, self.queue, client, keys,
                             publisher=self.publisher, origins=self.origins, prefetch=prefetch,
                             batch_prefetch=batch_prefetch)
        self.recovery = Recovery(self.state, engine, self.queue, client, keys, worker_id,
                                 publisher=self.publisher, intake=self.intake,
                                 origins=self.origins)
        self.publisher.lost_sink = self.recovery.check_data_loss
        # Weighted service already charged to the shared counters, per fairness key.
        self._charged: dict[str, float] = {}
        engine.event_sink = self.publisher.on_events
        engine.preempt_sink = self.intake.on_preempted

    # -- calls the collaborators answer -----------------------------------------------------

    def poll(self, block_ms: int = 50) -> int:
        """:meth:`Intake.poll`: take what this worker can start soon; return how many. A worker
        that Redis says was reclaimed (it was silent past its TTL) first stops what it held
        and registers afresh (:meth:`Recovery.on_reclaimed`), and takes at the next call."""
        try:
            return self.intake.poll(block_ms)
        except Reclaimed:
            self.recovery.on_reclaimed()
            return 0

    def reconcile_queue(self) -> None:
        """:meth:`Intake.reconcile_queue`: release from gate 1 what its engine admitted."""
        self.intake.reconcile_queue()

    def on_preempted(self, states: list[ResumeState]) -> None:
        """:meth:`Intake.on_preempted` (engine thread)."""
        self.intake.on_preempted(states)

    def on_events(self, events: list[Event]) -> None:
        """:meth:`EventPublisher.on_events`: write or hand over one tick's events (engine
        thread)."""
        self.publisher.on_events(events)

    def flush_events(self, *, held: bool = True) -> None:
        """:meth:`EventPublisher.flush_events`: write the events that wait (raises while Redis
        is unreachable; ``held`` False: not a tick the publisher holds)."""
        self.publisher.flush_events(held=held)

    def start_publisher(self) -> None:
        """:meth:`EventPublisher.start_publisher`: write events on a thread of their own."""
        self.publisher.start_publisher()

    def stop_publisher(self) -> None:
        """:meth:`EventPublisher.stop_publisher`."""
        self.publisher.stop_publisher()

    def flush_usage(self) -> int:
        """:meth:`WorkerState.flush_usage`: hand ended requests' ids to the usage sink; return
        how many."""
        return self.state.flush_usage()

    def audit(self) -> None:
        """:meth:`Recovery.audit`: compare what this worker holds with what Redis says."""
        self.recovery.audit()

    def housekeep(self, heartbeat_ttl_s: float) -> None:
        """:meth:`Recovery.housekeep`: end expired waiting requests, reclaim dead workers'."""
        self.recovery.housekeep(heartbeat_ttl_s)

    def begin_drain(self) -> int:
        """:meth:`Recovery.begin_drain`: no new work, unadmitted requests back; how many."""
        return self.recovery.begin_drain()

    def busy(self) -> bool:
        """:meth:`Recovery.busy`: whether it still runs requests or has events to write."""
        return self.recovery.busy()

    def shutdown(self, timeout_s: float) -> int:
        """:meth:`Recovery.shutdown`: stop; return how many requests went back to the queue."""
        return self.recovery.shutdown(timeout_s)

    # -- aborts (pub/sub thread) --------------------------------------------------------------

    def on_control(self, raw: dict) -> None:
        """Handle one pub/sub message of the control channel (aborts of requests it holds)."""
        try:
            message = ControlMessage.from_json(raw["data"])
        except (KeyError, ValidationError):
            log.warning("ignoring malformed control message %r", raw.get("data"))
            return
        if self.state.is_mine(message.request_id):
            self.engine.abort(message.request_id)

    # -- fairness counters, heartbeat and stats (main thread) ---------------------------------

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
                self._charged[key] = served  # the queue sends it, once, however long it takes
        self.queue.charge(delta)

    def publish_stats(self, ttl_s: float) -> None:
        """Heartbeat and stats snapshot (expiring after ``ttl_s`` without a refresh).

        A worker whose heartbeat lapsed was reclaimed by another (its requests went back to the
        queue or were ended): it finds out here, stops what it still runs, and starts afresh
        (:meth:`Recovery.on_reclaimed`). A worker that finds the deployment's epoch changed knows
        Redis lost its data (:meth:`Recovery.check_epoch`).
        """
        state = self.state
        self.recovery.check_epoch()
        if not state.registered and not state.holds_any():
            self.recovery.reclaim_predecessor(ttl_s)
        snapshot = self.engine.stats()
        finished = dict(snapshot.get("requests_finished") or {})
        for reason, n in state.ended_outside.items():  # ended before reaching the engine
            finished[reason] = finished.get(reason, 0) + n
        snapshot["requests_finished"] = finished
        snapshot["worker_id"] = self.worker_id
        snapshot["model"] = self.model
        snapshot["held_in_gate1"] = state.held
        snapshot["events_unsent"] = self.publisher.num_unsent()
        snapshot["published_at"] = time.time()
        pipe = self.client.pipeline(transaction=False)
        pipe.zadd(self.keys.workers, {self.worker_id: time.time()}, xx=state.registered)
        pipe.set(self.keys.stats(self.worker_id), json.dumps(snapshot, default=str),
                 px=max(1, int(ttl_s * 1000)))
        # The LoRA adapters it holds, for the queue's affinity (take.lua): until its next beat.
        self.queue.hold_adapters((snapshot.get("adapters") or {}).get("loaded_keys") or [],
                                 ttl_s, pipe)
        if not state.registered:  # afresh: what a reclaim of its id marked is over
            pipe.delete(self.keys.fq("reclaimed", self.worker_id))
            # The queue it serves: where a reclaim of it looks (reclaim.lua), which model's
            # requests the web tier may count on it for (gateway.workers).
            pipe.hset(self.keys.worker_queue, self.worker_id, self.keys.queue)
        # Registered is whether its heartbeat is there after the update, not whether the update
        # changed it: the client sends a round again after a lost reply, and the same score
        # again changes nothing.
        pipe.zscore(self.keys.workers, self.worker_id)
        still_registered = pipe.execute()[-1] is not None
        if state.registered and not still_registered:
            # Gone from the heartbeats: reclaimed, or Redis lost its data after the epoch was
            # read above (then what it holds is billed as computed, and it registers afresh at
            # the next heartbeat).
            if self.recovery.check_data_loss():
                return
            self.recovery.on_reclaimed()
        state.registered = True
