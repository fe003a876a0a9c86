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

:class:`Admission` is a base class of :class:`inference.engine.sched.scheduler.Scheduler`.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from inference.engine.config import PrefillMode
from inference.engine.request import ErrorInfo, FinishReason, Request, RequestPhase, ResumeState
from inference.engine.sched.preemption import preempted_state, resumed_request

if TYPE_CHECKING:
    from inference.engine.sched.scheduler import Scheduler

log = logging.getLogger(__name__)


class Admission:
    """Phase 1 of the tick: ``_admit_pending`` with its gates and preemption."""

    preemption_enabled: bool
    max_preemptions: int
    # True in a worker: a preempted request leaves the engine (``preempted_out``, then the
    # engine's preempt sink) instead of waiting again in ``_pending``.
    hand_out_preempted: bool
    preempted_out: list[ResumeState]
    preemptions: int
    preempted_tokens_recomputed: int
    admissions: int  # rows admitted since start (each row's ``admit_seq``)

    def _init_preemption(self: Scheduler) -> None:
        self.max_preemptions = self.config.max_preemptions
        self.preemption_enabled = self.config.preemption and self.max_preemptions > 0
        self.hand_out_preempted = False
        self.preempted_out = []
        self.preemptions = 0
        self.preempted_tokens_recomputed = 0
        self.admissions = 0

    # -- admission and the gates -------------------------------------------------------------

    def _admit_pending(self: Scheduler) -> None:
        """Admit the head of ``_pending`` while a row is free and gates 2 and 3 pass; a head
        that has no row or fails gate 2 may preempt lower-tier rows (:meth:`_preempt_for`)."""
        while self._pending:
            request = self.policy.peek_next()
            assert request is not None
            if len(self._prefilling) + len(self._active) >= self.max_batch_size:
                if self._preempt_for(request):
                    continue
                return
            demand = request.kv_demand
            # Gate 2, soft: wait until admitted rows release budget.
            if self.active_kv_reserved + demand > self.active_kv_budget:
                if self._preempt_for(request):
                    continue
                self._soft_hold(2)
                return
            # Gate 3, soft: wait until blocks free up (no evict-to-admit thrash).
            match = self.kv.find_cached_prefix(request)
            if self.kv.blocks_needed(request, match) > self.kv.available_blocks():
                self._soft_hold(3)
                return
            picked = self.policy.pick_next()
            assert picked is request
            del self._pending[request.request_id]
            self.left_pending += 1
            self.kv.admit(request, match)
            request.reserved_kv_tokens = demand
            self.active_kv_reserved += demand
            self.admissions += 1
            request.admit_seq = self.admissions
            if request.admitted_time is None:  # a resumed request keeps its first admission
                request.admitted_time = self._clock()
            self.backend.add_row(request.request_id)
            request.phase = RequestPhase.PREFILLING
            self._prefilling.append(request)
            if self.prefill_mode is PrefillMode.MONOLITHIC:
                self._run_prefill([request], whole_prompt=True)

    def _soft_hold(self: Scheduler, gate: int) -> None:
        self.soft_held[gate] += 1
        self.kv_admit_blocked += 1

    def _hard_reject(self: Scheduler, request: Request, gate: int, error: ErrorInfo) -> None:
        self.hard_rejected[gate] += 1
        self.kv_admit_blocked += 1
        self._finish(request, FinishReason.ERROR, error)

    # -- preemption ----------------------------------------------------------------------------

    def _victims(self: Scheduler, head: Request) -> list[Request]:
        """The decode rows that may be preempted for ``head``, in the order they would be:
        lower tier than ``head`` (lowest first), most recently admitted first, still live,
        preempted fewer than ``max_preemptions`` times."""
        if not self.preemption_enabled:
            return []
        rows = [r for r in self._active if r.priority < head.priority
                and r.finish_reason is None and r.preemptions < self.max_preemptions]
        rows.sort(key=lambda r: (r.priority, -r.admit_seq))
        return rows

    def _preempt_for(self: Scheduler, head: Request) -> bool:
        """Preempt the fewest rows of :meth:`_victims` whose release lets ``head`` in now;
        return whether any was preempted (none is when no choice lets it in)."""
        victims = self._victims(head)
        if not victims:
            return False
        match = self.kv.find_cached_prefix(head)
        for n in range(1, len(victims) + 1):
            if self._fits_without(head, match, victims[:n]):
                for row in victims[:n]:
                    log.info("preempting %s (tier %d) for %s (tier %d)", row.request_id,
                             row.priority, head.request_id, head.priority)
                    self._preempt(row)
                return True
        return False

    def _fits_without(self: Scheduler, head: Request, match: Any,
                      rows: Sequence[Request]) -> bool:
        """Whether ``head`` (its prefix hit ``match``) passes a free row, gate 2 and gate 3
        once ``rows`` have released their rows, reservations, blocks and promised blocks."""
        if len(self._prefilling) + len(self._active) - len(rows) >= self.max_batch_size:
            return False
        reserved = self.active_kv_reserved - sum(r.reserved_kv_tokens for r in rows)
        if reserved + head.kv_demand > self.active_kv_budget:
            return False
        refs = Counter(b for r in rows for b in r.block_table)
        blocks = self.kv.blocks
        released = sum(1 for b, n in refs.items() if blocks[b].ref_count == n)
        available = (self.kv.available_blocks() + released
                     + sum(r.reserved_blocks for r in rows))
        revived = sum(1 for b in match.block_ids if blocks[b].ref_count == refs.get(b, 0))
        needed = self.kv.blocks_for_tokens(head.kv_demand) - len(match.block_ids) + revived
        return needed <= available

    def _preempt(self: Scheduler, request: Request) -> None:
        """Take a decode row out of the batch by recompute (module docstring)."""
        state = preempted_state(request, self._clock)
        self._active.remove(request)
        self.kv.free(request)  # full blocks stay cached (evictable), the rest is free
        self.active_kv_reserved -= request.reserved_kv_tokens
        request.reserved_kv_tokens = 0
        self.backend.remove_row(request.request_id)
        request.phase = RequestPhase.FINISHED
        self.preemptions += 1
        if self.hand_out_preempted:
            self.policy.on_request_finished(request)
            self.preempted_out.append(state)
            return
        resumed = resumed_request(
            state, request.prompt_token_ids[:state.prompt_len], tenant=request.tenant,
            fairness_key=request.fairness_key, priority=request.priority,
            fairness_weight=request.fairness_weight, tokenizer=self.tokenizer,
            eos_token_ids=self.eos_token_ids, clock=self._clock,
            arrival_seq=request.arrival_seq)
        # Arrived before the old row leaves, so its key never looks idle (no VTC lift).
        self.add_request(resumed)
        self.policy.on_request_finished(request)
        self.left_pending -= 1  # waiting again: counted in the engine's queue (gate 1)

    def preemption_stats(self: Scheduler) -> dict[str, Any]:
        """The stats fields of preemption (``docs/engine.md``)."""
        return {
            "preemption": {"enabled": self.preemption_enabled,
                           "max_preemptions": self.max_preemptions},
            "preemptions": self.preemptions,
            "preempted_tokens_recomputed": self.preempted_tokens_recomputed,
            "preemptible_rows": self.preemptible_rows(),
        }

    def preemptible_rows(self: Scheduler) -> dict[str, int] | None:
        """What a worker whose rows are full may take to preempt for: the lowest tier of the
        decode rows that may be preempted (``tier``), how many of them are in it (``rows``),
        and how many pending requests already sort above it (``pending_above``); None when no
        row may be preempted."""
        if not self.preemption_enabled:
            return None
        rows = [r for r in self._active
                if r.finish_reason is None and r.preemptions < self.max_preemptions]
        if not rows:
            return None
        lowest = min(r.priority for r in rows)
        return {"tier": lowest, "rows": sum(1 for r in rows if r.priority == lowest),
                "pending_above": sum(1 for r in self._pending.values() if r.priority > lowest)}
