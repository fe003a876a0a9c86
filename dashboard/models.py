"""Periodic snapshots of the workers' stats, for the dashboard's charts."""

from __future__ import annotations

from django.db import models


class StatsSnapshot(models.Model):
    """The workers' stats summed at one moment (taken by a Celery beat task).

    Token counts are the workers' running totals; ``tokens_per_s`` is the generation rate since
    the previous snapshot. ``per_worker`` keeps each worker's ``tokens_generated`` and uptime so
    the next rate survives a worker restart; ``per_key`` is, per fairness key, the VTC counter,
    requests in flight and tokens served, summed over the workers.
    """

    taken_at = models.DateTimeField(db_index=True)
    workers = models.PositiveIntegerField(default=0)
    gate1_queued = models.IntegerField(default=0)
    num_pending = models.PositiveIntegerField(default=0)
    num_prefilling = models.PositiveIntegerField(default=0)
    num_active = models.PositiveIntegerField(default=0)
    kv_pressure = models.FloatField(default=0.0)
    active_kv_reserved = models.PositiveBigIntegerField(default=0)
    active_kv_budget = models.PositiveBigIntegerField(default=0)
    kv_admit_blocked = models.PositiveBigIntegerField(default=0)
    tokens_generated = models.PositiveBigIntegerField(default=0)
    prompt_tokens_computed = models.PositiveBigIntegerField(default=0)
    tokens_per_s = models.FloatField(default=0.0)
    per_worker = models.JSONField(default=dict)
    per_key = models.JSONField(default=dict)

    class Meta:
        ordering = ["-taken_at"]
        get_latest_by = "taken_at"

    def __str__(self) -> str:
        return f"stats at {self.taken_at:%Y-%m-%d %H:%M:%S}"

    def chart_point(self) -> dict[str, object]:
        """The fields the dashboard charts (time as unix seconds)."""
        return {
            "t": self.taken_at.timestamp(),
            "gate1_queued": self.gate1_queued,
            "num_pending": self.num_pending,
            "num_prefilling": self.num_prefilling,
            "num_active": self.num_active,
            "kv_pressure": self.kv_pressure,
            "active_kv_reserved": self.active_kv_reserved,
            "kv_admit_blocked": self.kv_admit_blocked,
            "tokens_per_s": self.tokens_per_s,
            "per_key": self.per_key,
        }
