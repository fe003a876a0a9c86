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
A request of ``n`` > 1 choices is preempted as a whole, every live choice's row at once
(:mod:`inference.engine.sched.choice_resume`). Within one tier nothing is preempted: a request that
fits waits for room. Preemption is for priority
only: it is never a way out of a full pool, since admission reserves every block a row can grow
into and decode never runs out of blocks.

Batch rows (``docs/design.md``, "The batch service class") are the exception: an interactive
head that finds no free row or fails gate 2 or gate 3 preempts batch rows first, in any phase
(prefilling or decode), whatever the tiers and without the ``MAX_PREEMPTIONS`` bound; a batch
head preempts nothing. A batch head is admitted only while the predicted pass of every row
stays within what the interactive rows alone take plus ``BATCH_ITL_SLACK_MS``
(:func:`inference.engine.sched.tick_budget.batch_row_fits`).

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
from inference.engine.request import BATCH_TIER, FinishReason, Request, RequestPhase
from inference.engine.sched.choice_resume import preempted_group_state, resumed_group_request
from inference.engine.sched.lifecycle import RowLifecycle
from inference.engine.sched.outputs import adapter_unavailable
from inference.engine.sched.preemption import preempted_state, restarted, resumed_request
from inference.engine.sched.state import SchedulerState
from inference.engine.sched.tick_budget import PassCostModel, PassShape, batch_row_fits

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
        # The mixed pass's cost model (the scheduler sets it; None: batch rows are admitted
        # whenever a row is free) and the slack batch rows may add to a pass (seconds).
        self.cost_model: PassCostModel | None = None
        self.batch_slack_s = state.config.batch_itl_slack_ms / 1000.0
        self.batch_slack_fraction = state.config.batch_itl_slack_fraction

    # -- admission and the gates -------------------------------------------------------------

    def _admit_pending(self) -> None:
        """Admit the head of ``_pending`` while a row is free and gates 2 and 3 pass; a head
        that has no row or fails gate 2 may preempt lower-tier rows (:meth:`_preempt_for`)."""
        state = self.state
        if state.adapters is not None:
            self._settle_adapters()
        while state.pending:
            request = state.policy.peek_next()
            if request is None:  # every pending request waits for its adapter
                return
            if request.adapter is not None and not state.adapters.is_loaded(
                    request.adapter.key):
                # Skipped, not held: it waits out of the order for its adapter's load and
                # comes back to its place when loaded (docs/design.md, "LoRA adapters").
                state.policy.park(request)
                state.parked.setdefault(request.adapter.key, []).append(request)
                state.adapters.want(request.adapter)
                continue
            if request.batch and not self._batch_fits(request):
                state.batch_itl_held += 1  # every request behind it is batch too
                return
            if state.rows_held() + request.num_rows > state.max_batch_size:
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
                if self._preempt_for(request, batch_only=True):
                    continue
                self._soft_hold(3)
                return
            picked = state.policy.pick_next()
            assert picked is request
            del state.pending[request.request_id]
            state.left_pending += 1
            state.kv.admit(request, match)
            if request.recomputed_prefix:  # started again: its usage keeps its first hits
                request.num_cached_tokens = request.first_cached_tokens
            request.reserved_kv_tokens = demand
            state.active_kv_reserved += demand
            state.admissions += 1
            request.admit_seq = state.admissions
            if request.admitted_time is None:  # a resumed request keeps its first admission
                request.admitted_time = state.clock()
            state.add_row(request)
            request.phase = RequestPhase.PREFILLING
            state.prefilling.append(request)
            if state.prefill_mode is PrefillMode.MONOLITHIC:
                self.rows.run_prefill([request], whole_prompt=True)

    def _settle_adapters(self) -> None:
        """Lay out the adapters whose files were read (:meth:`AdapterPool.poll`): requests
        parked on one loaded go back to their place in the order; those parked on one that
        failed to load end with ``adapter_unavailable`` (only they: no running row is
        touched)."""
        state = self.state

        def in_use() -> set[str]:
            rows = (*state.prefilling, *state.active,
                    *(r for r in state.pending.values() if not r.parked))
            return {r.adapter.key for r in rows if r.adapter is not None}

        loaded, failed = state.adapters.poll(in_use)
        for digest in loaded:
            for request in state.parked.pop(digest, ()):
                if state.pending.get(request.request_id) is request:
                    state.policy.unpark(request)
        for digest, why in failed.items():
            for request in state.parked.pop(digest, ()):
                if state.pending.get(request.request_id) is request:
                    self.rows.finish(request, FinishReason.ERROR,
                                     adapter_unavailable(request.adapter.name, why))

    def _batch_fits(self, head: Request) -> bool:
        """Whether a batch ``head`` keeps the predicted pass within the interactive rows' own
        plus the slack (every admitted row counted as the decode row it becomes)."""
        if self.cost_model is None:
            return True
        shapes = {True: [0, 0], False: [0, 0]}
        for row in (*self.state.prefilling, *self.state.active):
            shapes[row.batch][0] += row.num_rows
            shapes[row.batch][1] += row.num_rows * row.num_tokens
        return batch_row_fits(PassShape(*shapes[False]), PassShape(*shapes[True]),
                              head.num_rows, head.num_rows * head.num_tokens, self.cost_model,
                              self.batch_slack_fraction, self.batch_slack_s)

    def _soft_hold(self, gate: int) -> None:
        self.state.soft_held[gate] += 1
        self.state.kv_admit_blocked += 1

    # -- preemption ----------------------------------------------------------------------------

    def _preemptible(self, batch_only: bool = False) -> list[list[Request]]:
        """What may be preempted, each entry a request: a decode row, or every live row of a
        forked request of ``n`` > 1 choices (preempted together, only while each is a decode
        row that has not stopped); still live, preempted fewer than ``max_preemptions``
        times, with preemption on. A batch row whatever its preemptions or the setting, and
        prefilling too (except one resumed with its choices, and each choice of such a request
        while it replays its tokens); only those with ``batch_only``."""
        units: list[list[Request]] = []
        groups: set[int] = set()
        for row in (*self.state.prefilling, *self.state.active):
            if not row.batch and (batch_only or not self.preemption_enabled
                                  or row.phase is RequestPhase.PREFILLING
                                  or row.preemptions >= self.max_preemptions):
                continue
            if row.phase is RequestPhase.PREFILLING:
                # A choice replaying its tokens after its request resumed is one row of a
                # group: never preempted alone (nor its request, until each choice decodes).
                if row.group is None and (row.resume is None or not row.resume.choices):
                    units.append([row])
                continue
            if row.group is None:
                if row.finish_reason is None:
                    units.append([row])
                continue
            if id(row.group) in groups:
                continue
            groups.add(id(row.group))
            rows = row.group.live_rows()
            if all(r.phase is RequestPhase.ACTIVE and r.finish_reason is None for r in rows):
                units.append(rows)
        return units

    def _victims(self, head: Request, batch_only: bool = False) -> list[list[Request]]:
        """The requests that may be preempted for an interactive ``head``
        (:meth:`_preemptible`), in the order they would be: batch rows first, then lower tier
        than ``head`` (lowest first), most recently admitted first; none for a batch head."""
        if head.batch:
            return []
        units = [u for u in self._preemptible(batch_only)
                 if u[0].batch or u[0].priority < head.priority]
        units.sort(key=lambda u: (not u[0].batch, u[0].priority, -u[0].admit_seq))
        return units

    def _preempt_for(self, head: Request, batch_only: bool = False) -> bool:
        """Preempt the fewest requests of :meth:`_victims` whose release lets ``head`` in now;
        return whether any was preempted (none is when no choice lets it in)."""
        victims = self._victims(head, batch_only)
        if not victims:
            return False
        match = self.state.kv.find_cached_prefix(head)
        for n in range(1, len(victims) + 1):
            if self._fits_without(head, match, [r for unit in victims[:n] for r in unit]):
                for unit in victims[:n]:
                    log.info("preempting %s (tier %d) for %s (tier %d)", unit[0].event_id,
                             unit[0].priority, head.request_id, head.priority)
                    self._preempt(unit)
                return True
        return False

    def _fits_without(self, head: Request, match: Any, rows: Sequence[Request]) -> bool:
        """Whether ``head`` (its prefix hit ``match``) passes a free row, gate 2 and gate 3
        once ``rows`` have released their rows, reservations, blocks and promised blocks."""
        state = self.state
        freed = sum(r.num_rows if r.phase is RequestPhase.PREFILLING else 1 for r in rows)
        if state.rows_held() - freed + head.num_rows > state.max_batch_size:
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
        needed = kv.blocks_demand(head) - len(match.block_ids) + revived
        return needed <= available

    def _preempt(self, rows: list[Request]) -> None:
        """Take a request out of the batch by recompute (module docstring): its decode row,
        or every live row of a forked request together
        (:mod:`inference.engine.sched.choice_resume`)."""
        state = self.state
        request = rows[0]
        group = request.group
        if group is None:
            resume = preempted_state(request, state.clock)
        else:
            resume = preempted_group_state(group, state.clock)
            del state.groups[group.request_id]
        restart = not resume.generated and not resume.choices  # prefilling, nothing streamed
        fresh = restarted(request) if restart and not self.hand_out_preempted else None
        for row in rows:
            (state.prefilling if row.phase is RequestPhase.PREFILLING else state.active).remove(
                row)
            state.kv.free(row)  # full blocks stay cached (evictable), the rest is free
            state.active_kv_reserved -= row.reserved_kv_tokens
            row.reserved_kv_tokens = 0
            state.backend.remove_row(row.request_id)
            row.phase = RequestPhase.FINISHED
        state.preemptions += 1
        state.batch_preemptions += int(request.batch)
        if self.hand_out_preempted:
            state.policy.on_request_finished(request)
            state.preempted_out.append(resume)
            return
        prompt = request.prompt_token_ids[:resume.prompt_len]
        if fresh is not None:
            resumed = fresh
        elif group is not None:
            resumed = resumed_group_request(
                resume, prompt, tenant=request.tenant, fairness_key=request.fairness_key,
                priority=request.priority, fairness_weight=request.fairness_weight,
                clock=state.clock, arrival_seq=request.arrival_seq)
        else:
            resumed = resumed_request(
                resume, prompt, tenant=request.tenant,
                fairness_key=request.fairness_key, priority=request.priority,
                fairness_weight=request.fairness_weight, tokenizer=state.tokenizer,
                eos_token_ids=state.eos_token_ids, clock=state.clock,
                arrival_seq=request.arrival_seq)
        resumed.batch, resumed.expires_at = request.batch, request.expires_at
        resumed.adapter = request.adapter
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
            "batch_preemptions": self.state.batch_preemptions,
            "batch_tokens_recomputed": self.state.batch_tokens_recomputed,
            "batch_itl_held": self.state.batch_itl_held,
            "batch_itl_slack_ms": self.state.config.batch_itl_slack_ms,
            "batch_itl_slack_fraction": self.state.config.batch_itl_slack_fraction,
            "batch_decode_waits": self.state.batch_decode_waits,
            "batch_passes_yielded": self.state.batch_passes_yielded,
        }

    def preemptible_rows(self) -> dict[str, int] | None:
        """What a worker whose rows are full may take to preempt for: the lowest tier of the
        decode rows that may be preempted (``tier``), how many of them are in it (``rows``),
        and how many pending requests already sort above it (``pending_above``); None when no
        row may be preempted. Batch rows, which any interactive request may preempt, count as
        the tier :data:`~inference.engine.request.BATCH_TIER`, below every other."""
        rows = [r for unit in self._preemptible() for r in unit]
        if not rows:
            return None
        batch = [r for r in rows if r.batch]
        if batch:
            return {"tier": BATCH_TIER, "rows": sum(r.num_rows for r in batch),
                    "pending_above": sum(1 for r in self.state.pending.values()
                                         if not r.batch)}
        lowest = min(r.priority for r in rows)
        return {"tier": lowest, "rows": sum(1 for r in rows if r.priority == lowest),
                "pending_above": sum(1 for r in self.state.pending.values()
                                     if r.priority > lowest)}
