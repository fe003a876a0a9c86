"""The continuous-batching scheduler of ``docs/design.md``.

Three queues hold every live request exactly once: ``_pending`` (ordered by the policy),
``_prefilling`` (admitted, prompt still being fed in chunks) and ``_active`` (rows in the decode
batch); they are fields of one :class:`~inference.engine.sched.state.SchedulerState` (``pending``,
``prefilling``, ``active``), with the KV pool, the policy, the reservation, the counters, the
events and the clock. :class:`Scheduler` owns that state and the collaborators that share it:

- :class:`~inference.engine.sched.lifecycle.RowLifecycle`: a row's arrival, prefill, promotion
  (``_promote_to_decode``), tokens and exit, called by every phase;
- :class:`~inference.engine.sched.admission.Admission`: phase 1, ``_admit_pending`` (gates 2 and 3,
  active-KV budget and KV block pool; soft-hold or hard-reject; a higher tier may preempt
  lower-tier decode rows);
- :class:`~inference.engine.sched.mixed_tick.MixedPass`: ``_mixed_pass``, with
  ``PREFILL_MODE=mixed_batch`` phases 2 and 4 as one forward pass after admission, its prompt
  tokens sized to ``TARGET_ITL_MS`` (:mod:`inference.engine.sched.tick_budget`);
- :class:`~inference.engine.sched.stats.SchedulerStats`: the stats and the debug snapshot.

One tick runs four phases in a fixed order (:meth:`Scheduler.step`):

1. ``_admit_pending`` (the admission collaborator);
2. ``_advance_prefill_chunk``: one chunk per prefilling row; the final chunk's logits give the
   first token and ``_promote_to_decode`` splices the row into ``_active``;
3. ``_evict_finished``: rows that stopped leave, free their blocks and reservation, get their
   final event;
4. ``_decode_step``: one batched forward pass, one token per active row.

With ``mixed_batch``, ``_mixed_pass`` replaces phases 2 and 4 and eviction comes after it.

Admit comes before evict, so a row promoted in this tick streams its first token in this tick and
that token is never lost. The scheduler is single-threaded:
:class:`inference.engine.llm_engine.LLMEngine` feeds it from a thread-safe inbox and runs
:meth:`Scheduler.step` on its worker thread.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from inference.engine.adapter_pool import AdapterPool
from inference.engine.backends.base import ModelBackend
from inference.engine.config import EngineConfig, PrefillMode
from inference.engine.kv_cache import KVCacheManager
from inference.engine.request import (
    ErrorInfo,
    Event,
    FinishReason,
    Request,
    RequestPhase,
    ResumeState,
)
from inference.engine.sched.admission import Admission
from inference.engine.sched.lifecycle import RowLifecycle
from inference.engine.sched.mixed_tick import MixedPass
from inference.engine.sched.outputs import batch_expired, queue_timeout
from inference.engine.sched.policy import SchedulingPolicy, make_policy
from inference.engine.sched.state import SchedulerState
from inference.engine.sched.stats import SchedulerStats
from inference.engine.sched.tick_budget import PassCostModel


class Scheduler:
    """Queues, the four-phase tick, the gates and the reservation accounting.

    Args:
        config: engine settings (batch size, chunk size, policy, KV sizes, budget).
        backend: the model; its KV pool is allocated here, once.
        num_blocks: KV blocks in the pool (already resolved from a byte budget if needed).

    Raises:
        ValueError: if the active-KV budget does not fit in the pool.

    Its parts, for tests and tools that look inside: ``state`` (the
    :class:`~inference.engine.sched.state.SchedulerState`), ``rows``, ``admission``, ``mixed``
    and ``observer`` (the collaborators of the module docstring).
    """

    def __init__(self, config: EngineConfig, backend: ModelBackend, num_blocks: int):
        active_kv_budget = config.resolved_budget(num_blocks)
        kv = KVCacheManager(num_blocks, config.kv_block_size, config.enable_prefix_caching)
        backend.allocate_kv_pool(num_blocks, config.kv_block_size)
        policy = make_policy(
            config.scheduling_policy, config.vtc_input_weight, config.vtc_output_weight)
        self.state = SchedulerState(config, backend, kv, policy, active_kv_budget)
        if config.max_loras and backend.serves_adapters:
            self.state.adapters = AdapterPool(config.max_loras, backend.build_adapter,
                                              clock=self.state.clock)
        self.rows = RowLifecycle(self.state)
        self.admission = Admission(self.state, self.rows)
        self.mixed = MixedPass(self.state, self.rows)  # calibrates its cost model
        self.admission.cost_model = self.mixed.cost_model  # the batch rows' ITL rule
        self.observer = SchedulerStats(self.state, self.admission, self.mixed)

    # -- what the engine reads -----------------------------------------------------------------

    @property
    def kv(self) -> KVCacheManager:
        """The KV block pool's manager."""
        return self.state.kv

    @property
    def policy(self) -> SchedulingPolicy:
        """The scheduling policy: the order of ``_pending`` and the per-key accounting."""
        return self.state.policy

    @property
    def active_kv_budget(self) -> int:
        """Gate 2's limit, in tokens."""
        return self.state.active_kv_budget

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The backend tokenizer's end-of-sequence token ids."""
        return self.state.eos_token_ids

    @property
    def clock(self) -> Callable[[], float]:
        """The monotonic clock (seconds) of every request time of this scheduler."""
        return self.state.clock

    @property
    def cost_model(self) -> PassCostModel | None:
        """The mixed-batch pass's cost model; None outside ``mixed_batch`` or with no target."""
        return self.mixed.cost_model

    @property
    def hand_out_preempted(self) -> bool:
        """True (a worker): a preempted request leaves the engine, its resume state taken with
        :meth:`take_preempted`; False: it waits again in ``_pending``."""
        return self.admission.hand_out_preempted

    @hand_out_preempted.setter
    def hand_out_preempted(self, value: bool) -> None:
        self.admission.hand_out_preempted = value

    # -- entry points (called on the worker thread) --------------------------------------------

    def add_request(self, request: Request) -> None:
        """Put a validated request into ``_pending``; one that can never fit (bigger than the
        active-KV budget or the whole pool) is hard-rejected at once, with its final event.
        Its LoRA adapter, if not loaded, starts loading now when the pool has a free slot."""
        self.rows.enqueue(request)
        pool = self.state.adapters
        if (request.adapter is not None and pool is not None
                and request.phase is RequestPhase.PENDING):
            pool.prefetch(request.adapter)

    def abort_request(self, request_id: str) -> bool:
        """End a request in any phase with ``finish_reason=abort`` (every choice of a request
        of ``n`` choices, with one final event); False if it is not live."""
        return self.rows.finish_request(request_id, FinishReason.ABORT)

    def step(self, on_prefill_events: Callable[[list[Event]], None] | None = None
             ) -> list[Event]:
        """Run one tick; return the events it produced, in order.

        Args:
            on_prefill_events: if given, called with the events of the phases before decode
                (first tokens of rows promoted this tick, requests ended by the gates or by
                their first token) before the decode step runs, so a first token reaches its
                client without waiting for the batch's decode step; those events are then
                not returned again.
        """
        state = self.state
        self._expire_pending()
        self.admission._admit_pending()
        mixed = state.prefill_mode is PrefillMode.MIXED_BATCH
        if not mixed:
            self._advance_prefill_chunk()
            self._evict_finished()
        if on_prefill_events is not None and state.events:
            on_prefill_events(state.take_events())
        if mixed:
            # One pass; rows that stopped in it leave at once (their blocks are reused from the
            # next tick's admission on).
            self.mixed._mixed_pass()
            self._evict_finished()
        else:
            self._decode_step()
        state.tick_count += 1
        return state.take_events()

    def take_events(self) -> list[Event]:
        """Events produced outside a tick (aborts, shutdown)."""
        return self.state.take_events()

    def take_left_pending(self) -> int:
        """How many requests left ``_pending`` (admitted or ended) since the last call; the
        engine takes them off its own gate-1 count."""
        return self.state.take_left_pending()

    def take_preempted(self) -> list[ResumeState]:
        """The resume state of each row preempted out of the engine (``hand_out_preempted``)
        since the last call, in order."""
        return self.state.take_preempted()

    def has_work(self) -> bool:
        """Whether any request is live (pending, prefilling or decoding)."""
        return self.state.has_work()

    def withdraw_pending(self) -> list[Request]:
        """Take every pending request out, without events (shutdown hands them back)."""
        state = self.state
        withdrawn = list(state.pending.values())
        for request in withdrawn:
            del state.pending[request.request_id]
            state.policy.remove(request)
            request.phase = RequestPhase.FINISHED
            state.left_pending += 1
        return withdrawn

    def fail_all(self, error: ErrorInfo) -> None:
        """End every live request with ``error`` (shutdown, fatal backend failure)."""
        state = self.state
        for request in [*state.pending.values(), *state.prefilling, *state.active]:
            self.rows.finish(request, FinishReason.ERROR, error)

    # -- observation ---------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """A JSON-able stats snapshot (:meth:`SchedulerStats.stats`)."""
        return self.observer.stats()

    def debug_snapshot(self) -> dict[str, Any]:
        """Queue membership and per-row reservations, for invariant checks."""
        return self.observer.debug_snapshot()

    def preemptible_rows(self) -> dict[str, int] | None:
        """The lowest preemptible tier, its rows and the pending requests above it
        (:meth:`Admission.preemptible_rows`); None when no row may be preempted."""
        return self.admission.preemptible_rows()

    # -- the phases around admission -----------------------------------------------------------

    def _expire_pending(self) -> None:
        """End the pending requests whose admission deadline has passed (``queue_timeout``),
        and the batch requests past their own deadline in any phase (``batch_expired``)."""
        state = self.state
        now = state.clock()
        expired = [r for r in state.pending.values()
                   if r.queue_deadline is not None and now > r.queue_deadline]
        for request in expired:
            self.rows.finish(request, FinishReason.ERROR,
                             queue_timeout(now - request.arrival_time))
        # A batch request past its own deadline ends in whatever phase it is (every choice).
        late = {r.event_id for r in (*state.pending.values(), *state.prefilling, *state.active)
                if r.expires_at is not None and now > r.expires_at}
        for request_id in late:
            self.rows.finish_request(request_id, FinishReason.ERROR, batch_expired())

    def _advance_prefill_chunk(self) -> None:
        """Phase 2: one chunk of every prefilling row, in one prefill pass."""
        if self.state.prefilling:
            self.rows.run_prefill(list(self.state.prefilling), whole_prompt=False)

    def _evict_finished(self) -> None:
        """Phase 3: every active row that stopped leaves, with its final event."""
        for request in [r for r in self.state.active if r.finish_reason is not None]:
            self.rows.finish(request, request.finish_reason)

    def _decode_step(self) -> None:
        """Phase 4: one batched decode pass, one token per active row."""
        rows = list(self.state.active)
        if not rows:
            return
        batch = self.rows.decode_rows(rows)
        logits = self.rows.forward("decode", rows, lambda: self.state.backend.decode(batch))
        if logits is not None:
            self.rows.apply_decode(rows, logits)
