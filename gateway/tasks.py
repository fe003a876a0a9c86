"""Celery tasks of the web tier's side of the protocol: usage records, and the sweep that ends
what no live process would (see :mod:`gateway.usage` and :mod:`gateway.housekeeping`)."""

from __future__ import annotations

import time

import redis.exceptions
from celery import shared_task

from gateway import grace, housekeeping, usage
from gateway.conf import platform_settings
from inference.protocol.keys import USAGE_TASK_NAME

RECONCILE_TASK = "gateway.tasks.reconcile_usage"
SWEEP_TASK = "gateway.tasks.sweep_queue"


@shared_task(name=USAGE_TASK_NAME, ignore_result=True)
def record_usage(request_id: str) -> bool:
    """Write the usage record of one ended request from the usage ledger, and settle its token
    reservations; nothing when it was recorded already (idempotent per request id)."""
    return usage.record(str(request_id))


@shared_task(name=RECONCILE_TASK, ignore_result=True)
def reconcile_usage() -> int:
    """Record the usage entries whose task was lost (periodic); return how many were written."""
    return usage.reconcile()


# Monotonic time this process last saw Redis answer again after an outage.
_back_since = float("-inf")


@shared_task(name=SWEEP_TASK, ignore_result=True)
def sweep_queue() -> int:
    """Reclaim dead workers' requests and end expired ones, also when no worker or web process
    lives to do it (periodic); record their usage; end the generations whose grace period
    without a reader ran out (:mod:`gateway.grace`). Returns how many requests were ended.

    Right after a Redis outage (this task failed on it) it reclaims nothing for a heartbeat
    TTL: a stale heartbeat may then be a live worker's that could not beat.
    """
    global _back_since
    try:
        recovering = time.monotonic() - _back_since < platform_settings()["WORKER_HEARTBEAT_TTL_S"]
        ended = housekeeping.sweep(reclaim=not recovering)
    except redis.exceptions.RedisError:
        _back_since = float("inf")
        raise
    if _back_since == float("inf"):
        _back_since = time.monotonic()
    for request_id in ended:
        usage.record(request_id)
    # Generations whose grace period without a reader ran out (the chat's answers), also when
    # no web process lives to end them.
    grace.sweep()
    return len(ended)
