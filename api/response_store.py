"""Stored responses (:class:`api.models.StoredResponse`): written, ended once, read back, chained,
and ended or purged by the sweeps.

Every read is scoped to the caller's tenant: another tenant's response is a 404, also as a
``previous_response_id``. A response is ended by a conditional update (only one still
``in_progress`` changes), so the relay that ends it and the sweep never both do.

A response whose web process died mid-answer (:func:`end_orphans`, run by the periodic queue
sweep, :data:`gateway.tasks.swept`): its web process's heartbeat is gone (as
:func:`gateway.delivery.web_gone` judges it), its request ended in its worker (which stops
answering a dead web process's requests) and was billed; it ends ``failed``, with the output its
client was billed for (the first tokens of its stream) and that usage. A response its relay ended
``cancelled`` or ``failed`` gets the usage its request was billed once that is recorded
(:func:`fill_billed_usage`). One whose usage is never
recorded ends without usage after :data:`ORPHAN_WITHOUT_USAGE_S`; one left ``in_progress`` by a
live process that could not write its end (a database outage) ends the same way once its request
was billed :data:`ORPHAN_AFTER_BILLED_S` ago.
"""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import redis
from django.db.models import Q
from django.utils import timezone

from api.models import StoredResponse
from api.response_events import OutputShape, ended, output_from_events, usage_object
from gateway import grace
from gateway.clients import sync_redis
from gateway.conf import platform_settings, redis_keys
from gateway.delivery import web_gone
from gateway.errors import APIError
from gateway.storable import holds_nul, storable
from inference.protocol.events import Usage
from tenants.models import UsageRecord

log = logging.getLogger(__name__)

ORPHAN_WITHOUT_USAGE_S = 120.0
ORPHAN_AFTER_BILLED_S = 30.0
SWEEP_BATCH = 100
ORPHAN_ERROR = {"code": "server_error", "type": "server_error", "param": None,
                "message": "The server process relaying this response stopped before it ended; "
                           "its output is what was sent before."}


def not_found(response_id: str, param: str | None = None) -> APIError:
    shown = response_id if len(response_id) <= 80 else response_id[:80] + "..."
    return APIError(404, f"No response with id '{shown}' found.", param=param,
                    code="not_found", type="invalid_request_error")


async def get(tenant_id: int, response_id: str, param: str | None = None) -> StoredResponse:
    """The tenant's stored response ``response_id``.

    Raises:
        APIError: 404 when there is none (also when another tenant's).
    """
    found = (None if holds_nul(response_id) else
             await StoredResponse.objects.filter(pk=response_id, tenant_id=tenant_id).afirst())
    if found is None:
        raise not_found(response_id, param)
    return found


async def previous(tenant_id: int, response_id: str) -> StoredResponse:
    """The response a ``previous_response_id`` names, which may be continued.

    Raises:
        APIError: 404 (none of the tenant's); 400 when it has not ended yet, or when its chain
            already holds ``MAX_RESPONSE_CHAIN`` responses.
    """
    found = await get(tenant_id, response_id, "previous_response_id")
    if found.status == StoredResponse.Status.IN_PROGRESS:
        raise APIError(400, f"Invalid value for 'previous_response_id': the response "
                            f"'{response_id}' has not ended yet.",
                       param="previous_response_id", code="invalid_value")
    most = platform_settings()["MAX_RESPONSE_CHAIN"]
    if found.chain >= most:
        raise APIError(400, f"Invalid value for 'previous_response_id': its chain holds "
                            f"{found.chain} responses, the most one may (MAX_RESPONSE_CHAIN, "
                            f"{most}); start a new one.",
                       param="previous_response_id", code="invalid_value")
    return found


def chain_items(last: StoredResponse) -> list[dict[str, Any]]:
    """The items of ``last``'s chain, oldest first: each response's input items, then its
    output (a response deleted or purged ends the chain there)."""
    chain = []
    node: StoredResponse | None = last
    while node is not None:
        chain.append(node)
        node = (StoredResponse.objects.filter(pk=node.previous_id).first()
                if node.previous_id else None)
    items: list[dict[str, Any]] = []
    for response in reversed(chain):
        items += list(response.input_items) + list(response.body.get("output") or [])
    return items


async def create(response_id: str, *, tenant_id: int, api_key_id: int | None,
                 previous: StoredResponse | None, request_id: str, web_id: str,
                 body: dict[str, Any], input_items: list[dict[str, Any]],
                 shape: OutputShape) -> None:
    await StoredResponse.objects.acreate(
        id=response_id, tenant_id=tenant_id, api_key_id=api_key_id, previous=previous,
        chain=(previous.chain + 1) if previous is not None else 1, request_id=request_id,
        web_id=web_id, body=storable(body), input_items=storable(input_items),
        shape=shape.as_dict())


async def finish(response_id: str, body: dict[str, Any]) -> bool:
    """Store how the response ended (``body``, its ``status`` terminal), unless it was already;
    returns whether this call stored it."""
    stored = await StoredResponse.objects.filter(
        pk=response_id, status=StoredResponse.Status.IN_PROGRESS).aupdate(
        status=body["status"], body=storable(body), ended_at=timezone.now())
    return bool(stored)


async def forget(response_id: str) -> None:
    """Drop a response its client never saw (its request was answered with an error)."""
    await StoredResponse.objects.filter(pk=response_id).adelete()


def purge(now: float | None = None) -> int:
    """Delete the stored responses older than ``RESPONSES_RETENTION_S``; returns how many."""
    now = time.time() if now is None else now
    cutoff = datetime.fromtimestamp(now - platform_settings()["RESPONSES_RETENTION_S"], tz=UTC)
    deleted, _ = StoredResponse.objects.filter(created_at__lt=cutoff).delete()
    return deleted


def _beats(client: redis.Redis, web_ids: list[str]) -> tuple[dict[str, float | None],
                                                              float | None]:
    keys = redis_keys()
    pipe = client.pipeline(transaction=False)
    for web_id in web_ids:
        pipe.zscore(keys.web, web_id)
    pipe.zrevrange(keys.web, 0, 0, withscores=True)
    pipe.zrevrange(keys.workers, 0, 0, withscores=True)
    reply = pipe.execute()
    beats = {w: (float(b) if b is not None else None) for w, b in zip(web_ids, reply, strict=False)}
    fresh = [float(r[0][1]) for r in reply[len(web_ids):] if r]
    return beats, max(fresh, default=None)


def end_orphans(client: redis.Redis | None = None, now: float | None = None) -> int:
    """End the stored responses no live process will end (the module docstring); returns how
    many. Raises Redis and database errors (the next sweep tries again)."""
    now = time.time() if now is None else now
    young = timezone.now() - timedelta(seconds=1)
    rows = list(StoredResponse.objects.filter(
        status=StoredResponse.Status.IN_PROGRESS, created_at__lt=young)[:SWEEP_BATCH])
    if not rows:
        return 0
    client = client or sync_redis()
    beats, freshest = _beats(client, sorted({r.web_id for r in rows}))
    records = {r.request_id: r for r in UsageRecord.objects.filter(
        Q(request_id__in=[row.request_id for row in rows]))}
    ttl = platform_settings()["WEB_HEARTBEAT_TTL_S"]
    count = 0
    for row in rows:
        record = records.get(row.request_id)
        started = row.created_at.timestamp()
        gone = web_gone(beats.get(row.web_id), freshest, started, now, ttl)
        billed_long_ago = (record is not None
                           and now - record.created_at.timestamp() > ORPHAN_AFTER_BILLED_S)
        if not (gone and (record is not None or now - started > ORPHAN_WITHOUT_USAGE_S)
                or billed_long_ago):
            continue
        count += _end_orphan(row, record, client)
    return count


def fill_billed_usage(now: float | None = None) -> int:
    """Give the stored responses that ended ``cancelled`` or ``failed`` without usage (their
    request's usage is recorded after they end) the usage their request was billed, once its
    record is written; those ended more than :data:`ORPHAN_WITHOUT_USAGE_S` ago are left as they
    are. Returns how many were filled."""
    now = time.time() if now is None else now
    since = datetime.fromtimestamp(now - ORPHAN_WITHOUT_USAGE_S, tz=UTC)
    rows = list(StoredResponse.objects.filter(
        status__in=[StoredResponse.Status.CANCELLED, StoredResponse.Status.FAILED],
        body__usage=None, ended_at__gte=since)[:SWEEP_BATCH])
    records = {r.request_id: r for r in UsageRecord.objects.filter(
        request_id__in=[row.request_id for row in rows])}
    filled = 0
    for row in rows:
        record = records.get(row.request_id)
        if record is None:
            continue
        usage = Usage(prompt_tokens=record.prompt_tokens,
                      cached_prompt_tokens=record.cached_prompt_tokens,
                      completion_tokens=record.completion_tokens)
        body = {**row.body, "usage": usage_object(usage)}
        filled += StoredResponse.objects.filter(pk=row.pk, body__usage=None).update(body=body)
    return filled


def _end_orphan(row: StoredResponse, record: UsageRecord | None, client: redis.Redis) -> int:
    usage = None
    tokens = 0
    if record is not None:
        usage = Usage(prompt_tokens=record.prompt_tokens,
                      cached_prompt_tokens=record.cached_prompt_tokens,
                      completion_tokens=record.completion_tokens)
        tokens = record.completion_tokens
    output = output_from_events(grace.stream_events(row.request_id, client),
                                OutputShape(**row.shape), tokens, "failed")
    body = ended(row.body, "failed", output, usage=usage, error=ORPHAN_ERROR)
    stored = StoredResponse.objects.filter(
        pk=row.pk, status=StoredResponse.Status.IN_PROGRESS).update(
        status="failed", body=body, ended_at=timezone.now())
    if stored:
        log.info("stored response %s ended by the sweep (its relay is gone)", row.pk)
    return stored
