"""The dashboard's own settings (``settings.DASHBOARD``), read at call time with these defaults."""

from __future__ import annotations

from typing import Any

from django.conf import settings

DEFAULTS: dict[str, Any] = {
    # Seconds between stats snapshots (the Celery beat task); the charts' resolution.
    "SNAPSHOT_INTERVAL_S": 5.0,
    # Snapshots older than this are deleted by the cleanup task (seconds).
    "SNAPSHOT_RETENTION_S": 86400.0,
    # Seconds between cleanup runs.
    "CLEANUP_INTERVAL_S": 600.0,
    # The charts' time span (seconds).
    "CHART_WINDOW_S": 3600.0,
    # How often the page asks for fresh numbers (milliseconds).
    "POLL_INTERVAL_MS": 2000,
}


def dashboard_settings() -> dict[str, Any]:
    """The dashboard settings: ``settings.DASHBOARD`` over :data:`DEFAULTS`."""
    return {**DEFAULTS, **getattr(settings, "DASHBOARD", {})}


def beat_schedule(overrides: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Celery beat's schedule (``CELERY_BEAT_SCHEDULE``) for the settings ``overrides``.

    Built while the settings module loads, so it takes the overrides instead of reading them.
    """
    conf = {**DEFAULTS, **overrides}
    return {
        "stats-snapshot": {"task": "dashboard.tasks.snapshot_stats",
                           "schedule": conf["SNAPSHOT_INTERVAL_S"]},
        "cleanup": {"task": "dashboard.tasks.cleanup", "schedule": conf["CLEANUP_INTERVAL_S"]},
    }
