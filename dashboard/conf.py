"""The dashboard's own settings (``settings.DASHBOARD``), read at call time with defaults."""

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
    # Acknowledged entries of the requests streams are kept this long, then trimmed (seconds).
    "REQUESTS_STREAM_RETENTION_S": 600.0,
    # A worker silent this long is dropped from the heartbeat set (seconds).
    "DEAD_WORKER_AFTER_S": 3600.0,
}


def dashboard_settings() -> dict[str, Any]:
    """The dashboard settings: ``settings.DASHBOARD`` over :data:`DEFAULTS`."""
    return {**DEFAULTS, **getattr(settings, "DASHBOARD", {})}
