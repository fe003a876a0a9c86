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

A record bills what its client received (:func:`bill`): the worker's counts as its web process
says the client got them (:mod:`gateway.delivery`). The recording of a request relayed by a web
process waits for that process's end note, or for its death; that process records it itself
when its note comes after a recorder waited (:func:`record_if_ended`), and the reconciliation
records the requests of web processes that died. Its ``billed_tokens`` are the tokens it bills
at the price the request was admitted at (batch work: ``BATCH_TOKEN_PRICE``,
:mod:`gateway.pricing`), the figure its settlement charges the token budget.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import django.dispatch
import redis
from asgiref.sync import sync_to_async
from celery import current_app
from django.db import IntegrityError, transaction

from gateway import admission, budgets, delivery, pricing
from gateway.clients import aredis, sync_redis
from gateway.conf import redis_keys
from gateway.delivery import Delivery
from gateway.errors import CLIENT_CLOSED_STATUS, final_status
from inference.protocol.events import FinalEvent, FinishReason, Usage
from inference.protocol.keys import USAGE_TASK_NAME
from inference.protocol.messages import RequestMessage, UsageReport
from tenants.models import UsageRecord

log = logging.getLogger(__name__)

# The reconciliation records ledger entries older than this (seconds): younger ones are being
# recorded by the task their ender sent.
RECONCILE_AFTER_S = 10.0
# A record that its web process could not write is handed to the Celery task this much later (s).
USAGE_RETRY_FIRST_S = 1.0

# Sent with ``records`` (the :class:`~tenants.models.UsageRecord` rows written) by
# :func:`record_many`, whose one insert sends no ``post_save`` for them.
recorded_many = django.dispatch.Signal()


@dataclass(frozen=True)
class Entry:
    """A ledger entry: the request's final event as its ender wrote it, its message, times."""

    request_id: str
    final: FinalEvent
    message: RequestMessage
    first_at: float | None
    finished_at: float

    @classmethod
    def parse(cls, request_id: str, raw: bytes | str) -> Entry:
        """Raises: ValueError: not valid JSON, or no valid final event or message."""
        entry = json.loads(raw)
        return cls(request_id=request_id,
                   final=FinalEvent.model_validate_json(entry["final"]),
                   message=RequestMessage.from_json(entry["body"]),
                   first_at=entry.get("first_at") or None,
                   finished_at=float(entry.get("finished_at") or time.time()))

    def report(self, usage: Usage) -> UsageReport:
        return UsageReport(
            request_id=self.request_id, meta=self.message.meta, usage=usage,
            finish_reason=self.final.finish_reason, error=self.final.error,
            enqueued_at=self.message.enqueued_at, first_token_at=self.first_at,
            finished_at=self.finished_at)


def report_from_entry(request_id: str, raw: bytes | str) -> UsageReport:
    """The usage report of a ledger entry (JSON: the final event, the request message, times),
    billed as its worker counted it (:func:`billed`).

    Raises:
        ValueError: the entry is not valid JSON or holds no valid final event or message.
    """
    entry = Entry.parse(request_id, raw)
    return entry.report(billed(entry.final, entry.message.meta))


def billed(final: FinalEvent, meta: dict[str, Any]) -> Usage:
    """What a request is billed from its final event and its message's ``meta`` alone (no web
    process said what its client got).

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


@dataclass(frozen=True)
class Bill:
    """A usage record's figures: what it bills, and how the request ended for its client."""

    usage: Usage
    finish_reason: str
    status: int
    error_code: str


def bill(final: FinalEvent, meta: dict[str, Any], got: Delivery | None) -> Bill:
    """What a request's record bills, given what its client ``got`` (None: nothing said, as for
    a chat answer, stored whole for its page: billed as the worker counted, :func:`billed`).

    The worker's counts (``final.usage``) are capped to what the client got
    (``got.tokens``, the token events it was sent; none for an answer not streamed unless it
    went out whole):

    - the client got the end the worker wrote: billed as the worker counted;
    - it left first (499): the prompt tokens computed and the tokens it was sent;
    - it got an error, the worker's or the web tier's, or its web process died (499): its prompt
      and the tokens it was sent, nothing if it was sent none (an answer not streamed: nothing).
    """
    error = final.error
    if got is None:
        return Bill(billed(final, meta), final.finish_reason.value,
                    final_status(final.finish_reason, error), error.code.value if error else "")
    used = final.usage
    if got.end == delivery.COMPLETE:
        return Bill(used, final.finish_reason.value, got.status, "")
    tokens = got.tokens if meta.get("stream") is True else 0
    sent = Usage(prompt_tokens=used.prompt_tokens, cached_prompt_tokens=used.cached_prompt_tokens,
                 completion_tokens=min(used.completion_tokens, tokens))
    if got.end == delivery.LEFT:
        return Bill(sent, FinishReason.ABORT.value, CLIENT_CLOSED_STATUS, "")
    usage = sent if tokens > 0 else Usage()
    if got.end == delivery.GONE:
        return Bill(usage, FinishReason.ABORT.value, CLIENT_CLOSED_STATUS, "")
    return Bill(usage, FinishReason.ERROR.value, got.status, got.end)


def save(report: UsageReport, figures: Bill | None = None) -> bool:
    """Write the usage record of ``report`` (with ``figures``; None: as its worker counted)
    unless one exists; return whether it was written."""
    return _save(report, figures)[0]


def _fields(report: UsageReport, figures: Bill) -> dict[str, Any]:
    """A usage record's fields but its request id."""
    meta = report.meta
    usage = figures.usage
    return {
        "tenant_id": meta["tenant_id"],
        "api_key_id": meta.get("api_key_id"),
        "model": meta.get("model", ""),
        "prompt_tokens": usage.prompt_tokens,
        "cached_prompt_tokens": usage.cached_prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        # Charged at the price the request was admitted at, as its settlement charges it.
        "billed_tokens": pricing.priced(usage.prompt_tokens + usage.completion_tokens,
                                        pricing.price_of(meta)),
        "ttft_s": report.ttft_s,
        "duration_s": report.duration_s,
        "finish_reason": figures.finish_reason,
        "status": figures.status,
        "error_code": figures.error_code,
        "batch_id": str(meta.get("batch_id") or ""),
        "adapter": str(meta.get("adapter") or "")[:200],
    }


def _save(report: UsageReport, figures: Bill | None) -> tuple[bool, int | None]:
    """:func:`save`, and the record's primary key (None: not found)."""
    if figures is None:
        error = report.error
        figures = Bill(report.usage, report.finish_reason.value,
                       final_status(report.finish_reason, error),
                       error.code.value if error else "")
    defaults = _fields(report, figures)
    try:
        with transaction.atomic():
            row, created = UsageRecord.objects.get_or_create(request_id=report.request_id,
                                                             defaults=defaults)
    except IntegrityError:  # written at the same moment by another recorder
        pk = UsageRecord.objects.filter(request_id=report.request_id).values_list(
            "pk", flat=True).first()
        return False, pk
    return created, row.pk


def _save_many(reports: list[tuple[UsageReport, Bill]]) -> tuple[int, dict[str, int]]:
    """:func:`_save` of many reports in one insert: how many rows were written, and each
    report's record's primary key (those found). Sends :data:`recorded_many` with the rows
    written (an insert of many sends no ``post_save``)."""
    ids = [report.request_id for report, _ in reports]
    before = set(UsageRecord.objects.filter(request_id__in=ids)
                 .values_list("request_id", flat=True))
    rows = [UsageRecord(request_id=report.request_id, **_fields(report, figures))
            for report, figures in reports if report.request_id not in before]
    with transaction.atomic():
        UsageRecord.objects.bulk_create(rows, ignore_conflicts=True)  # another recorder's: kept
    pks = dict(UsageRecord.objects.filter(request_id__in=ids).values_list("request_id", "pk"))
    written = [row for row in rows if row.request_id in pks]
    for row in written:
        row.pk = pks[row.request_id]
    if written:
        recorded_many.send(sender=UsageRecord, records=written)
    return len(written), pks


def record_many(request_ids: list[str], client: redis.Redis | None = None) -> int:
    """:func:`record` each of ``request_ids`` (a batch step's lines that ended), in a few round
    trips and one insert; return how many rows this call wrote.

    The requests relayed by a web process (none of a batch's) are recorded one by one, as
    :func:`record` does.

    Raises:
        redis.RedisError: Redis is unreachable (the entries stay for the next try).
    """
    client = client or sync_redis()
    ledger = redis_keys().usage_pending
    ids = list(dict.fromkeys(request_ids))
    if not ids:
        return 0
    entries: list[Entry] = []
    written = 0
    for request_id, raw in zip(ids, client.hmget(ledger, ids), strict=True):
        if raw is None:
            continue
        try:
            entry = Entry.parse(request_id, raw)
        except (ValueError, KeyError, TypeError):
            log.exception("dropping an unreadable usage entry of %s: %r", request_id, raw[:200])
            client.hdel(ledger, request_id)
            continue
        if entry.message.origin:
            written += record(request_id, client)
        else:
            entries.append(entry)
    if not entries:
        return written
    notes = delivery.read_notes(client, [entry.request_id for entry in entries])
    bills = [bill(entry.final, entry.message.meta, got) for entry, got in
             zip(entries, notes, strict=True)]
    count, pks = _save_many([(entry.report(figures.usage), figures)
                             for entry, figures in zip(entries, bills, strict=True)])
    settled = budgets.settle_many(
        [(entry.message.meta, figures.usage.prompt_tokens + figures.usage.completion_tokens,
          entry.request_id, pks.get(entry.request_id),
          entry.message.meta.get(admission.EPOCH_META_KEY))
         for entry, figures in zip(entries, bills, strict=True)], ledger, client)
    delivery.forget_many(client, [entry.request_id for entry, done in
                                  zip(entries, settled, strict=True) if done])
    return written + count


def record(request_id: str, client: redis.Redis | None = None, *,
           only_gone: bool = False) -> bool:
    """Record the usage of ``request_id`` from the ledger; return whether this call wrote it.

    Nothing happens when the ledger holds no entry for it (already recorded), or while the web
    process relaying it has not said what its client got and is alive
    (:func:`gateway.delivery.read`; with ``only_gone``, unless that process is gone). An entry
    that is not a valid report is logged and dropped (it can never be recorded).

    Raises:
        redis.RedisError: Redis is unreachable (the entry stays for the next try).
    """
    client = client or sync_redis()
    ledger = redis_keys().usage_pending
    raw = client.hget(ledger, request_id)
    if raw is None:
        return False
    try:
        entry = Entry.parse(request_id, raw)
    except (ValueError, KeyError, TypeError):
        log.exception("dropping an unreadable usage entry of %s: %r", request_id, raw[:200])
        client.hdel(ledger, request_id)
        return False
    origin = entry.message.origin
    if only_gone and not origin:
        return False
    reading = delivery.read(client, request_id, origin, entry.finished_at)
    if reading.wait or (only_gone and (reading.delivery is None
                                       or reading.delivery.end != delivery.GONE)):
        return False
    meta = entry.message.meta
    figures = bill(entry.final, meta, reading.delivery)
    written, row = _save(entry.report(figures.usage), figures)
    used = figures.usage.prompt_tokens + figures.usage.completion_tokens
    # Removing the entry and settling the reservations are one atomic step: exactly once.
    if budgets.settle(meta, used, client, ledger=(ledger, request_id), record=row,
                      epoch=meta.get(admission.EPOCH_META_KEY)):
        delivery.forget(client, request_id, origin)
    return written


async def record_if_ended(request_id: str) -> None:
    """:func:`record` ``request_id`` now, on a thread, if it ended (its ledger entry is there):
    the web process that wrote its end note does when a recorder came first and waited for it
    (:mod:`gateway.delivery`). Never raises: a write that fails here is handed to the Celery task
    :func:`gateway.tasks.record_usage` (which retries a database outage), and what that cannot
    record, the reconciliation does."""
    try:
        if await aredis().hexists(redis_keys().usage_pending, request_id):
            await sync_to_async(record)(request_id)
    except Exception:  # noqa: BLE001 - the task or the reconciliation records it
        log.warning("could not record the usage of %s now; handing it to the usage task",
                    request_id, exc_info=True)
        try:
            await sync_to_async(current_app.send_task)(
                USAGE_TASK_NAME, args=[request_id], countdown=USAGE_RETRY_FIRST_S, retry=False)
        except Exception:  # noqa: BLE001 - the reconciliation records it
            log.warning("could not hand the usage of %s to its task", request_id)


def reconcile(older_than_s: float = RECONCILE_AFTER_S, client: redis.Redis | None = None,
              limit: int = 1000) -> int:
    """Record every ledger entry older than ``older_than_s``, and the younger ones whose web
    process is gone (no task would record them sooner); return how many rows were written.

    Run periodically (Celery beat): the entries left are those whose task was lost, or that
    waited for a web process.
    """
    client = client or sync_redis()
    ledger = redis_keys().usage_pending
    cutoff = time.time() - older_than_s
    written = 0
    for seen, (request_id, raw) in enumerate(client.hscan_iter(ledger, count=500), 1):
        try:
            finished_at = float(json.loads(raw).get("finished_at") or 0)
        except (ValueError, TypeError, AttributeError):
            finished_at = 0.0
        rid = request_id.decode() if isinstance(request_id, bytes) else request_id
        written += record(rid, client, only_gone=finished_at > cutoff)
        if seen >= limit:
            break
    if written:
        log.warning("reconciliation recorded the usage of %d request(s) that no task recorded "
                    "in time (a task lost or failing, a database that refused the write) or whose "
                    "web process is gone", written)
    return written


def pending(client: redis.Redis | None = None) -> int:
    """Usage entries not yet recorded (for stats and tests)."""
    return int((client or sync_redis()).hlen(redis_keys().usage_pending))
