"""Celery tasks of the web tier's side of the protocol: usage records, the sweep that ends
what no live process would (see :mod:`gateway.usage` and :mod:`gateway.housekeeping`), and the
check of a LoRA adapter (:mod:`gateway.adapter_validation`)."""

from __future__ import annotations

import logging

import django.dispatch
import redis.exceptions
from celery import Task, shared_task
from django.db import DatabaseError

from gateway import adapter_validation, grace, housekeeping, usage
from gateway.conf import platform_settings
from gateway.errors import database_unavailable
from inference.protocol.keys import USAGE_TASK_NAME
from inference.protocol.liveness import RedisSight
from tenants.adapters import VALIDATE_TASK

log = logging.getLogger(__name__)

RECONCILE_TASK = "gateway.tasks.reconcile_usage"
SWEEP_TASK = "gateway.tasks.sweep_queue"


# A usage record whose database cannot take it now (locked, unreachable) is tried again this many
# times, this long apart (seconds, doubling); what is still left, the reconciliation records.
USAGE_RETRIES = 5
USAGE_RETRY_FIRST_S = 1.0


@shared_task(name=USAGE_TASK_NAME, ignore_result=True, bind=True, max_retries=USAGE_RETRIES)
def record_usage(self: Task, request_id: str) -> bool:
    """Write the usage record of one ended request from the usage ledger, and settle its token
    reservations; nothing when it was recorded already (idempotent per request id). A database
    outage (:func:`gateway.errors.database_unavailable`) retries the task (the ledger keeps the
    entry meanwhile)."""
    try:
        return usage.record(str(request_id))
    except DatabaseError as exc:
        if not database_unavailable(exc):
            raise
        countdown = USAGE_RETRY_FIRST_S * 2 ** self.request.retries
        raise self.retry(exc=exc, countdown=countdown) from exc


@shared_task(name=RECONCILE_TASK, ignore_result=True)
def reconcile_usage() -> int:
    """Record the usage entries whose task was lost (periodic); return how many were written."""
    return usage.reconcile()


# Sent after each round of the queue sweep, whose receivers end what they own that no live
# process will (the Responses API's stored responses whose web process died); a receiver that
# raises is logged and tried again at the next round.
swept = django.dispatch.Signal()

# This process's sight of Redis, kept across the sweep's runs (None until its first run). The
# task does not run while its broker (Redis) is down, so an outage shows as a long gap between
# two runs, and a sweep every few seconds keeps the sight continuous (a break: more than half the
# heartbeat TTL without an answer).
_sight: RedisSight | None = None


@shared_task(name=SWEEP_TASK, ignore_result=True)
def sweep_queue() -> int:
    """Reclaim dead workers' requests and end expired ones, also when no worker or web process
    lives to do it (periodic); record their usage; end the generations whose grace period
    without a reader ran out (:mod:`gateway.grace`). Returns how many requests were ended.

    Heartbeats are judged against this process's own sight of Redis
    (:mod:`inference.protocol.liveness`): a Celery process just started, or one whose runs were
    apart more than half the heartbeat TTL (an outage of Redis, its broker, stops it), or whose
    call failed, reclaims nothing until it has seen Redis answer without a break for a TTL.
    """
    global _sight
    if _sight is None:
        _sight = RedisSight(platform_settings()["WORKER_HEARTBEAT_TTL_S"] / 2)
    try:
        ended = housekeeping.sweep(sight=_sight)
    except redis.exceptions.RedisError:
        _sight.lost()
        raise
    for request_id in ended:
        usage.record(request_id)
    # Generations whose grace period without a reader ran out (the chat's answers), also when
    # no web process lives to end them.
    grace.sweep()
    for receiver, result in swept.send_robust(sender=SWEEP_TASK):
        if isinstance(result, Exception):
            log.warning("sweep receiver %s failed: %s", receiver, result)
    return len(ended)


@shared_task(name=VALIDATE_TASK, ignore_result=True)
def validate_adapter(adapter_id: int) -> str:
    """Check the LoRA adapter ``adapter_id`` and set it ``ready`` or ``refused``
    (:func:`gateway.adapter_validation.validate`); returns its state (``gone``: it no longer
    exists or changed meanwhile)."""
    row = adapter_validation.validate(int(adapter_id))
    return row.state if row is not None else "gone"
