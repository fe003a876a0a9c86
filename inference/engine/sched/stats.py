"""Observation of the scheduler: its stats snapshot and a debug view of its queues.

:class:`SchedulerStats` is a base class of :class:`inference.engine.sched.scheduler.Scheduler`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from inference.engine.config import PrefillMode

if TYPE_CHECKING:
    from inference.engine.sched.scheduler import Scheduler


class SchedulerStats:
    """``stats`` and ``debug_snapshot`` of the scheduler."""

    # -- observation -------------------------------------------------------------------------

    def stats(self: Scheduler) -> dict[str, Any]:
        """A JSON-able stats snapshot (the field names of ``docs/design.md``, backpressure)."""
        snapshot: dict[str, Any] = {
            "policy": self.policy.name,
            "prefill_mode": self.prefill_mode.value,
            "max_batch_size": self.max_batch_size,
            "max_pending": self.config.max_pending,
            "num_pending": len(self._pending),
            "num_prefilling": len(self._prefilling),
            "num_active": len(self._active),
            "active_kv_reserved": self.active_kv_reserved,
            "active_kv_budget": self.active_kv_budget,
            "kv_admit_blocked": self.kv_admit_blocked,
            "tick_count": self.tick_count,
            "tokens_generated": self.tokens_generated,
            "prompt_tokens_computed": self.prompt_tokens_computed,
            "admissions_soft_held": {str(g): n for g, n in self.soft_held.items()},
            "admissions_hard_rejected": {str(g): n for g, n in self.hard_rejected.items()},
            "requests_finished": dict(self.finished),
            "per_key": {key: s.to_dict() for key, s in self.policy.keys.items()},
        }
        # The backend's compute dtype (``DTYPE=auto`` resolved); None for a model-free backend.
        dtype = getattr(self.backend, "dtype", None)
        snapshot["dtype"] = str(dtype).removeprefix("torch.") if dtype is not None else None
        snapshot.update(self.preemption_stats())
        if self.prefill_mode is PrefillMode.MIXED_BATCH:
            snapshot["tick_budget"] = self.tick_budget_stats()
        snapshot.update(self.kv.snapshot())
        return snapshot

    def debug_snapshot(self: Scheduler) -> dict[str, Any]:
        """Queue membership and per-row reservations, for invariant checks."""
        head = self.policy.peek_next()
        return {
            "pending": [r.debug_row() for r in self._pending.values()],
            "pending_head": head.request_id if head is not None else None,
            "prefilling": [r.debug_row() for r in self._prefilling],
            "active": [r.debug_row() for r in self._active],
            "active_kv_reserved": self.active_kv_reserved,
            **self.kv.snapshot(),
        }
