"""Observation of the scheduler: its stats snapshot and a debug view of its queues.

:class:`SchedulerStats` reads, and never changes, the scheduler's
:class:`~inference.engine.sched.state.SchedulerState`, with the fields that the phase-1
collaborator (:class:`~inference.engine.sched.admission.Admission`: preemption) and the
mixed-batch one (:class:`~inference.engine.sched.mixed_tick.MixedPass`: the tick budget) report.
"""

from __future__ import annotations

from typing import Any

from inference.engine.config import PrefillMode
from inference.engine.sched.admission import Admission
from inference.engine.sched.mixed_tick import MixedPass
from inference.engine.sched.state import SchedulerState


class SchedulerStats:
    """``stats`` and ``debug_snapshot`` of one scheduler.

    Args:
        state: the scheduler's shared state.
        admission: its phase 1 (the preemption fields).
        mixed: its mixed-batch pass (the ``tick_budget`` field, in ``mixed_batch`` mode).
    """

    def __init__(self, state: SchedulerState, admission: Admission, mixed: MixedPass):
        self.state = state
        self.admission = admission
        self.mixed = mixed

    def stats(self) -> dict[str, Any]:
        """A JSON-able stats snapshot (the field names of ``docs/design.md``, backpressure)."""
        state = self.state
        snapshot: dict[str, Any] = {
            "policy": state.policy.name,
            "prefill_mode": state.prefill_mode.value,
            "max_batch_size": state.max_batch_size,
            "max_pending": state.config.max_pending,
            "num_pending": len(state.pending),
            "num_pending_batch": sum(1 for r in state.pending.values() if r.batch),
            "num_prefilling": len(state.prefilling),
            "num_active": len(state.active),
            "active_kv_reserved": state.active_kv_reserved,
            "active_kv_budget": state.active_kv_budget,
            "kv_admit_blocked": state.kv_admit_blocked,
            "tick_count": state.tick_count,
            "tokens_generated": state.tokens_generated,
            "prompt_tokens_computed": state.prompt_tokens_computed,
            "admissions_soft_held": {str(g): n for g, n in state.soft_held.items()},
            "admissions_hard_rejected": {str(g): n for g, n in state.hard_rejected.items()},
            "requests_finished": dict(state.finished),
            "per_key": {key: s.to_dict() for key, s in state.policy.keys.items()},
        }
        # The backend's compute dtype (``DTYPE=auto`` resolved); None for a model-free backend.
        dtype = getattr(state.backend, "dtype", None)
        snapshot["dtype"] = str(dtype).removeprefix("torch.") if dtype is not None else None
        snapshot.update(self.admission.preemption_stats())
        if state.prefill_mode is PrefillMode.MIXED_BATCH:
            snapshot["tick_budget"] = self.mixed.tick_budget_stats()
        snapshot.update(state.kv.snapshot())
        if state.adapters is not None:
            # The LoRA adapters: loaded, loads and evictions, and the rows running under each.
            adapters = state.adapters.stats()
            adapters["num_parked"] = sum(1 for r in state.pending.values() if r.parked)
            running: dict[str, int] = {}
            for row in (*state.prefilling, *state.active):
                if row.adapter is not None:
                    running[row.adapter.name] = running.get(row.adapter.name, 0) + 1
            adapters["running"] = running
            snapshot["adapters"] = adapters
        return snapshot

    def debug_snapshot(self) -> dict[str, Any]:
        """Queue membership and per-row reservations, for invariant checks; the forks of
        requests of ``n`` > 1 choices (``forked_requests``, ``forked_choices``: the rows they
        made, choice 0 included)."""
        state = self.state
        head = state.policy.peek_next()
        return {
            "pending": [r.debug_row() for r in state.pending.values()],
            "pending_head": head.request_id if head is not None else None,
            "prefilling": [r.debug_row() for r in state.prefilling],
            "active": [r.debug_row() for r in state.active],
            "active_kv_reserved": state.active_kv_reserved,
            "forked_requests": state.forked_requests,
            "forked_choices": state.forked_choices,
            **state.kv.snapshot(),
        }
