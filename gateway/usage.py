"""Usage records, exactly once per request whatever process dies when.

Every end of every request (a worker's final event, a reclaim, an expiry, a withdrawal) is written
by one Lua function (``fq_finish`` in ``inference/protocol/lua/fair_queue.lua``) that, in the same
atomic step, adds the request's usage entry to the ledger ``{prefix}:usage:pending``. An entry
leaves the ledger only in :func:`record`, after its database row is written, in the same atomic step
as the settlement of the request's token reservations (``inference/protocol/lua/settle.lua``). So:

- the row is written at least once: the ledger keeps the entry until it is; whoever ends a request
  asks the Celery task :func:`gateway.tasks.record_usage` for it (by request id), and the periodic
  :func:`reconcile` (Celery beat) records whatever is left: a lost task message, a Celery worker
  killed mid-task, a worker that died between ending a request and sending the task;
- the row is written at most once: ``request_id`` is unique and the write is a get-or-create;
- the reservations are settled exactly once: by the one call that removes the ledger entry.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import redis
from django.db import IntegrityError, transaction

from gateway import admission
from gateway.clients import sync_redis
from gateway.conf import redis_keys
from gateway.errors import final_status
from inference.protocol.events import FinalEvent, Usage
from inference.protocol.messages import RequestMessage, UsageReport
from tenants.models import UsageRecord

log = logging.getLogger(__name__)

# The reconciliation records ledger entries older than this (seconds): younger ones are being
# recorded by the task their ender sent.
RECONCILE_AFTER_S = 10.0


def report_from_entry(request_id: str, raw: bytes | str) -> UsageReport:
    """The usage report of a ledger entry (JSON: the final event, the request message, times).

    Raises:
        ValueError: the entry is not valid JSON or holds no valid final event or message.
    """
    entry = json.loads(raw)
    final = FinalEvent.model_validate_json(entry["final"])
    message = RequestMessage.from_json(entry["body"])
    return UsageReport(
        request_id=request_id, meta=message.meta, usage=billed(final, message.meta),
        finish_reason=final.finish_reason, error=final.error, enqueued_at=message.enqueued_at,
        first_token_at=entry.get("first_at") or None,
        finished_at=float(entry.get("finished_at") or time.time()))


def billed(final: FinalEvent, meta: dict[str, Any]) -> Usage:
    """What a request is billed, from its final event and its message's ``meta``.

    A request that ends with an error is billed only when its client got tokens of it: a stream
    its prompt and the tokens it was sent; a stream sent none, and a request not streamed
    (``meta["stream"]`` false: its answer goes out only whole, so an error leaves the client
    nothing), are billed nothing. Every other end is billed as the worker counted it (an abort:
    the prompt tokens computed and the tokens generated).
    """
    if final.error is not None and (meta.get("stream") is False
                                    or final.usage.completion_tokens == 0):
        return Usage()
    return final.usage


def save(report: UsageReport) -> bool:
    """Write the usage record of ``report`` unless one exists; return whether it was written."""
    meta, usage = report.meta, report.usage
    defaults: dict[str, Any] = {
        "tenant_id": meta["tenant_id"],
        "api_key_id": meta.get("api_key_id"),
        "model": meta.get("model", ""),
        "prompt_tokens": usage.prompt_tokens,
        "cached_prompt_tokens": usage.cached_prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "ttft_s": report.ttft_s,
        "duration_s": report.duration_s,
        "finish_reason": report.finish_reason.value,
        "status": final_status(report.finish_reason, report.error),
        "error_code": report.error.code.value if report.error else "",
    }
    try:
        with transaction.atomic():
            _, created = UsageRecord.objects.get_or_create(request_id=report.request_id,
                                                           defaults=defaults)
    except IntegrityError:  # written at the same moment by another recorder
        return False
    return created


def record(request_id: str, client: redis.Redis | None = None) -> bool:
    """Record the usage of ``request_id`` from the ledger; return whether this call wrote it.

    Nothing happens when the ledger holds no entry for it (already recorded). An entry that is not
    a valid report is logged and dropped (it can never be recorded).
    """
    client = client or sync_redis()
    ledger = redis_keys().usage_pending
    raw = client.hget(ledger, request_id)
    if raw is None:
        return False
    try:
        report = report_from_entry(request_id, raw)
    except (ValueError, KeyError, TypeError):
        log.exception("dropping an unreadable usage entry of %s: %r", request_id, raw[:200])
        client.hdel(ledger, request_id)
        return False
    written = save(report)
    # Removing the entry and settling the reservations are one atomic step: exactly once.
    admission.settle(report.meta, report.usage.prompt_tokens + report.usage.completion_tokens,
                     client, ledger=(ledger, request_id))
    return written


def reconcile(older_than_s: float = RECONCILE_AFTER_S, client: redis.Redis | None = None,
              limit: int = 1000) -> int:
    """Record every ledger entry older than ``older_than_s``; return how many rows were written.

    Run periodically (Celery beat): the entries left are those whose task was lost.
    """
    client = client or sync_redis()
    ledger = redis_keys().usage_pending
    cutoff = time.time() - older_than_s
    written = seen = 0
    for request_id, raw in client.hscan_iter(ledger, count=500):
        try:
            finished_at = float(json.loads(raw).get("finished_at") or 0)
        except (ValueError, TypeError, AttributeError):
            finished_at = 0.0
        if finished_at > cutoff:
            continue
        rid = request_id.decode() if isinstance(request_id, bytes) else request_id
        written += record(rid, client)
        seen += 1
        if seen >= limit:
            break
    if written:
        log.warning("reconciliation recorded the usage of %d request(s) whose task was lost",
                    written)
    return written


def pending(client: redis.Redis | None = None) -> int:
    """Usage entries not yet recorded (for stats and tests)."""
    return int((client or sync_redis()).hlen(redis_keys().usage_pending))
