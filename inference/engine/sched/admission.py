"""Phase 1 of the scheduler's tick: admission through gates 2 and 3, and priority preemption.

``_admit_pending`` looks at the head of ``_pending`` (the policy's order) while a row is free:
gate 2 (the active-KV budget) and gate 3 (the KV block pool) soft-hold it at the head (nothing
behind it overtakes it) or it is admitted (its prefix hit taken, its blocks and reservation
reserved) into ``_prefilling``. A head that finds no free row, or fails gate 2, may preempt
decode rows of a lower priority tier (``docs/design.md``, "Preemption across priority tiers";
:mod:`inference.engine.sched.preemption` for what a preempted request keeps): the lowest tier first,
within it the most recently admitted first, only rows preempted fewer than ``MAX_PREEMPTIONS``
times, and only as many as let the head in (a free row, gate 2 and gate 3 all checked on their
release before any is preempted; if no choice lets it in, none is, and the head waits as before).
Within one tier nothing is preempted: a request that fits waits for room. Preemption is for priority
only: it is never a way out of a full pool, since admission reserves every block a row can grow
into and decode never runs out of blocks.

:class:`Admission` is the scheduler's phase-1 collaborator: it reads and changes the
:class:`~inference.engine.sched.state.SchedulerState` it is given and ends or prefills rows through
the :class:`~inference.engine.sched.lifecycle.RowLifecycle` (the monolithic prefill of an admitted
row; a preempted request waiting again in ``_pending``).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from typing import Any

from inference.engine.config import PrefillMode
from inference.engine.request import Request, RequestPhase
from inference.engine.sched.lifecycle import RowLifecycle
from inference.engine.sched.preemption import preempted_state, resumed_request
from inference.engine.sched.state import SchedulerState

log = logging.getLogger(__name__)


class Admission:
    """Phase 1 of the tick: ``_admit_pending`` with its gates and preemption.

    Args:
        state: the scheduler's shared state (queues, pool, policy, reservation, counters).
        rows: the row lifecycle of the same state.

    ``preemption_enabled`` and ``max_preemptions`` come from the config (``PREEMPTION``,
    ``MAX_PREEMPTIONS``). ``hand_out_preempted`` is True in a worker: a preempted request
    leaves the engine (``state.preempted_out``, then the engine's preempt sink) instead of
    waiting again in ``_pending``.
    """

    def __init__(self, state: SchedulerState, rows: RowLifecycle):
        self.state = state
        self.rows = rows
        self.max_preemptions = state.config.max_preemptions
        self.preemption_enabled = state.config.preemption and self.max_preemptions > 0
        self.hand_out_preempted = False

    # -- admission and the gates -------------------------------------------------------------

    def _admit_pending(self) -> None:
        """Admit the head of ``_pending`` while a row is free and gates 2 and 3 pass; a head
        that has no row or fails gate 2 may preempt lower-tier rows (:meth:`_preempt_for`)."""
        state = self.state
        while state.pending:
            request = state.policy.peek_next()
            assert request is not None
            if state.rows_held() >= state.max_batch_size:
                if self._preempt_for(request):
                    continue
                return
            demand = request.kv_demand
            # Gate 2, soft: wait until admitted rows release budget.
            if state.active_kv_reserved + demand > state.active_kv_budget:
                if self._preempt_for(request):
                    continue
                self._soft_hold(2)
                return
            # Gate 3, soft: wait until blocks free up (no evict-to-admit thrash).
            match = state.kv.find_cached_prefix(request)
            if state.kv.blocks_needed(request, match) > state.kv.available_blocks():
                self._soft_hold(3)
                return
            picked = state.policy.pick_next()
            assert picked is request
            del state.pending[request.request_id]
            state.left_pending += 1
            state.kv.admit(request, match)
            request.reserved_kv_tokens = demand
            state.active_kv_reserved += demand
            state.admissions += 1
            request.admit_seq = state.admissions
            if request.admitted_time is None:  # a resumed request keeps its first admission
                request.admitted_time = state.clock()
            state.backend.add_row(request.request_id)
            request.phase = RequestPhase.PREFILLING
            state.prefilling.append(request)
            if state.prefill_mode is PrefillMode.MONOLITHIC:
                self.rows.run_prefill([request], whole_prompt=True)

    def _soft_hold(self, gate: int) -> None:
        self.state.soft_held[gate] += 1
        self.state.kv_admit_blocked += 1

    # -- preemption ----------------------------------------------------------------------------

    def _victims(self, head: Request) -> list[Request]:
        """The decode rows that may be preempted for ``head``, in the order they would be:
        lower tier than ``head`` (lowest first), most recently admitted first, still live,
        preempted fewer than ``max_preemptions`` times."""
        if not self.preemption_enabled:
            return []
        rows = [r for r in self.state.active if r.priority < head.priority
                and r.finish_reason is None and r.preemptions < self.max_preemptions]
        rows.sort(key=lambda r: (r.priority, -r.admit_seq))
        return rows

    def _preempt_for(self, head: Request) -> bool:
        """Preempt the fewest rows of :meth:`_victims` whose release lets ``head`` in now;
        return whether any was preempted (none is when no choice lets it in)."""
        victims = self._victims(head)
        if not victims:
            return False
        match = self.state.kv.find_cached_prefix(head)
        for n in range(1, len(victims) + 1):
            if self._fits_without(head, match, victims[:n]):
                for row in victims[:n]:
                    log.info("preempting %s (tier %d) for %s (tier %d)", row.request_id,
                             row.priority, head.request_id, head.priority)
                    self._preempt(row)
                return True
        return False

    def _fits_without(self, head: Request, match: Any, rows: Sequence[Request]) -> bool:
        """Whether ``head`` (its prefix hit ``match``) passes a free row, gate 2 and gate 3
        once ``rows`` have released their rows, reservations, blocks and promised blocks."""
        state = self.state
        if state.rows_held() - len(rows) >= state.max_batch_size:
            return False
        reserved = state.active_kv_reserved - sum(r.reserved_kv_tokens for r in rows)
        if reserved + head.kv_demand > state.active_kv_budget:
            return False
        refs = Counter(b for r in rows for b in r.block_table)
        kv = state.kv
        blocks = kv.blocks
        released = sum(1 for b, n in refs.items() if blocks[b].ref_count == n)
        available = kv.available_blocks() + released + sum(r.reserved_blocks for r in rows)
        revived = sum(1 for b in match.block_ids if blocks[b].ref_count == refs.get(b, 0))
        needed = kv.blocks_for_tokens(head.kv_demand) - len(match.block_ids) + revived
        return needed <= available

    def _preempt(self, request: Request) -> None:
        """Take a decode row out of the batch by recompute (module docstring)."""
        state = self.state
        resume = preempted_state(request, state.clock)
        state.active.remove(request)
        state.kv.free(request)  # full blocks stay cached (evictable), the rest is free
        state.active_kv_reserved -= request.reserved_kv_tokens
        request.reserved_kv_tokens = 0
        state.backend.remove_row(request.request_id)
        request.phase = RequestPhase.FINISHED
        state.preemptions += 1
        if self.hand_out_preempted:
            state.policy.on_request_finished(request)
            state.preempted_out.append(resume)
            return
        resumed = resumed_request(
            resume, request.prompt_token_ids[:resume.prompt_len], tenant=request.tenant,
            fairness_key=request.fairness_key, priority=request.priority,
            fairness_weight=request.fairness_weight, tokenizer=state.tokenizer,
            eos_token_ids=state.eos_token_ids, clock=state.clock,
            arrival_seq=request.arrival_seq)
        # Arrived before the old row leaves, so its key never looks idle (no VTC lift).
        self.rows.enqueue(resumed)
        state.policy.on_request_finished(request)
        state.left_pending -= 1  # waiting again: counted in the engine's queue (gate 1)

    # -- what preemption shows -----------------------------------------------------------------

    def preemption_stats(self) -> dict[str, Any]:
        """The stats fields of preemption (``docs/engine.md``)."""
        return {
            "preemption": {"enabled": self.preemption_enabled,
                           "max_preemptions": self.max_preemptions},
            "preemptions": self.state.preemptions,
            "preempted_tokens_recomputed": self.state.preempted_tokens_recomputed,
            "preemptible_rows": self.preemptible_rows(),
        }

    def preemptible_rows(self) -> dict[str, int] | None:
        """What a worker whose rows are full may take to preempt for: the lowest tier of the
        decode rows that may be preempted (``tier``), how many of them are in it (``rows``),
        and how many pending requests already sort above it (``pending_above``); None when no
        row may be preempted."""
        if not self.preemption_enabled:
            return None
        rows = [r for r in self.state.active
                if r.finish_reason is None and r.preemptions < self.max_preemptions]
        if not rows:
            return None
        lowest = min(r.priority for r in rows)
        return {"tier": lowest, "rows": sum(1 for r in rows if r.priority == lowest),
                "pending_above": sum(1 for r in self.state.pending.values()
                                     if r.priority > lowest)}
