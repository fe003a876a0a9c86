"""What the phases of the scheduler's tick share: one :class:`SchedulerState` per scheduler.

The :class:`~inference.engine.sched.scheduler.Scheduler` builds it and hands it to each of its
collaborators, which all read and change this one object and hold no copy of its contents:

- :class:`~inference.engine.sched.lifecycle.RowLifecycle`: a row's arrival, prefill, promotion,
  tokens and exit;
- :class:`~inference.engine.sched.admission.Admission`: phase 1, gates 2 and 3, preemption;
- :class:`~inference.engine.sched.mixed_tick.MixedPass`: the mixed-batch forward pass;
- :class:`~inference.engine.sched.stats.SchedulerStats`: the stats and the debug snapshot.

The three queues of ``docs/design.md`` (section 2) are its fields ``pending`` (the ``_pending``
queue), ``prefilling`` (``_prefilling``) and ``active`` (``_active``): every live request is in
exactly one of them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from inference.engine.backends.base import ModelBackend, Tokenizer
from inference.engine.config import EngineConfig, PrefillMode
from inference.engine.kv_cache import KVCacheManager
from inference.engine.request import Event, FinishReason, Request, ResumeState
from inference.engine.sched.gates import GATES
from inference.engine.sched.policy import SchedulingPolicy


def _per_gate() -> dict[int, int]:
    return dict.fromkeys(GATES, 0)


def _per_finish_reason() -> dict[str, int]:
    return {reason.value: 0 for reason in FinishReason}


@dataclass(eq=False)
class SchedulerState:
    """The queues, the KV pool, the policy, the backend, the reservation, the counters, the
    events of the tick and the clock of one scheduler.

    Args:
        config: engine settings; ``prefill_mode``, ``chunk_size`` (prompt tokens per row per
            tick) and ``max_batch_size`` (rows) are read from it once.
        backend: the model, its KV pool already allocated.
        kv: the KV block pool's manager.
        policy: the order of ``pending`` and the per-fairness-key accounting.
        active_kv_budget: gate 2's limit, in tokens (``prompt_len + max_tokens`` summed over
            the admitted rows).
        clock: monotonic seconds; every request time (arrival, admission, first token,
            deadline) is on it.

    Queues: ``pending`` maps request id to request (membership only: the policy holds the
    order), ``prefilling`` holds admitted rows in admission order, ``active`` the decode batch.
    ``active_kv_reserved`` is the sum of the admitted rows' ``reserved_kv_tokens``. ``groups``
    maps the id of each live request forked into ``n`` > 1 choices to its
    :class:`~inference.engine.sched.choices.ChoiceGroup` (its rows are in ``active``).

    Counters, all since start: ``tick_count``, ``tokens_generated``,
    ``prompt_tokens_computed``, ``kv_admit_blocked`` (soft-holds and hard-rejects together),
    ``soft_held`` and ``hard_rejected`` (per gate), ``finished`` (per finish reason),
    ``admissions`` (each row's ``admit_seq``), ``preemptions``, ``preempted_tokens_recomputed``
    (prompt tokens computed again for resumed rows, charged to nobody), ``batch_preemptions``
    and ``batch_tokens_recomputed`` (the part of both of batch rows), ``batch_itl_held``
    (admissions of a batch head held back by the ITL rule), ``batch_decode_waits`` (batch
    decode rows left out of a pass by the same rule), ``batch_passes_yielded`` (passes of batch
    rows alone stopped for an interactive arrival, ``docs/design.md``, "The batch service
    class"), ``forked_requests``
    (requests of ``n`` > 1 choices forked after their one prefill) and ``forked_choices`` (the
    decode rows those forks made, choice 0 included). ``left_pending`` counts
    the requests that left ``pending`` (admitted or ended) since the engine last took it.

    Outputs: ``events`` (in order, until taken) and ``preempted_out`` (the resume states of
    rows preempted out of the engine, until taken).
    """

    config: EngineConfig
    backend: ModelBackend
    kv: KVCacheManager
    policy: SchedulingPolicy
    active_kv_budget: int
    clock: Callable[[], float] = time.monotonic

    tokenizer: Tokenizer = field(init=False)
    eos_token_ids: frozenset[int] = field(init=False)
    prefill_mode: PrefillMode = field(init=False)
    chunk_size: int = field(init=False)
    max_batch_size: int = field(init=False)

    pending: dict[str, Request] = field(default_factory=dict)
    prefilling: list[Request] = field(default_factory=list)
    active: list[Request] = field(default_factory=list)
    active_kv_reserved: int = 0
    groups: dict[str, Any] = field(default_factory=dict)

    tick_count: int = 0
    tokens_generated: int = 0
    prompt_tokens_computed: int = 0
    kv_admit_blocked: int = 0
    soft_held: dict[int, int] = field(default_factory=_per_gate)
    hard_rejected: dict[int, int] = field(default_factory=_per_gate)
    finished: dict[str, int] = field(default_factory=_per_finish_reason)
    admissions: int = 0
    preemptions: int = 0
    preempted_tokens_recomputed: int = 0
    batch_preemptions: int = 0
    batch_tokens_recomputed: int = 0
    batch_itl_held: int = 0
    batch_decode_waits: int = 0
    batch_passes_yielded: int = 0
    left_pending: int = 0
    forked_requests: int = 0
    forked_choices: int = 0

    events: list[Event] = field(default_factory=list)
    preempted_out: list[ResumeState] = field(default_factory=list)
    # What the engine's next tick takes in (``(kind, item)``: a ``"submit"``'s item is the
    # request), read while a pass runs (:mod:`inference.engine.sched.mixed_tick`).
    arrivals: Callable[[], Sequence[tuple[str, Any]]] = lambda: ()
    # The loaded LoRA adapters (inference.engine.adapter_pool; None: the backend serves none),
    # and the pending requests parked on each adapter's load, by digest.
    adapters: Any = None
    parked: dict[str, list[Request]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.tokenizer = self.backend.tokenizer
        self.eos_token_ids = frozenset(self.backend.tokenizer.eos_token_ids)
        self.prefill_mode = self.config.effective_prefill_mode
        self.chunk_size = self.config.prefill_chunk_size
        self.max_batch_size = self.config.max_batch_size

    def rows_held(self) -> int:
        """Admitted rows, prefilling and decoding: each holds a row of the batch and its KV
        (a request of ``n`` choices still prefilling holds the ``n`` rows it forks into)."""
        return sum(r.num_rows for r in self.prefilling) + len(self.active)

    def has_work(self) -> bool:
        """Whether any request is live (in one of the three queues)."""
        return bool(self.pending or self.prefilling or self.active)

    def has_tick_work(self) -> bool:
        """Whether a tick would do anything: a row runs, a request waits in the order, or an
        adapter's files were read (requests parked on a loading adapter alone wait for it)."""
        if self.prefilling or self.active:
            return True
        now = self.clock()
        if any(not r.parked or (r.queue_deadline is not None and now > r.queue_deadline)
               for r in self.pending.values()):
            return True
        return self.adapters is not None and self.adapters.has_news()

    def add_row(self, request: Request) -> None:
        """``request``'s row joins the backend's batch, under its LoRA adapter if it has one
        (loaded: it was admitted only once it was)."""
        self.backend.add_row(request.request_id)
        if request.adapter is not None:
            weights = self.adapters.get(request.adapter.key)
            assert weights is not None, "a row admitted before its adapter loaded"
            self.backend.set_row_adapter(request.request_id, weights)

    def find(self, request_id: str) -> Request | None:
        """The live request with ``request_id`` in any queue, or None."""
        request = self.pending.get(request_id)
        if request is not None:
            return request
        for request in (*self.prefilling, *self.active):
            if request.request_id == request_id:
                return request
        return None

    def emit(self, event: Event) -> None:
        """Queue ``event`` for the client, after those emitted before it."""
        self.events.append(event)

    def take_events(self) -> list[Event]:
        """The events emitted since they were last taken, in order; none are kept."""
        events, self.events = self.events, []
        return events

    def take_left_pending(self) -> int:
        """How many requests left ``pending`` since this was last taken; the count restarts."""
        left, self.left_pending = self.left_pending, 0
        return left

    def take_preempted(self) -> list[ResumeState]:
        """The resume states of rows preempted out of the engine since last taken."""
        preempted, self.preempted_out = self.preempted_out, []
        return preempted
