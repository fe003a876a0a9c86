"""Token budgets: the counter of a tenant's period, and its rebuild after Redis lost it.

A tenant's budget counter (``{prefix}:budget:{tenant_pk}:{period_index}``) holds the tokens
charged for the reservations and the usage of the current period (batch work at its price per
token, :mod:`gateway.pricing`; interactive work in full), where the period index is
``int(unix_time // period)`` (:attr:`tenants.models.Tenant.budget_period_seconds`).
``inference/protocol/lua/admit.lua`` reads it, reserves into it and sets its expiry;
``inference/protocol/lua/settle.lua`` settles it to the real usage.

Redis is not persistent, but the usage records in the database are billing's source of truth: a
counter that is missing (a Redis restart, a flush, or simply the period's first request) is
rebuilt by :func:`ensure_counter` from the tenant's usage records of the period (the sum of their
``billed_tokens``: each charged as its settlement charged it), before admission reads it.
Where the counter exists this costs one ``EXISTS``; the database is asked once per tenant and
period, and once after each loss of Redis.

A rebuilt counter holds the records it counted and the reservations made since; the requests
admitted before Redis lost its data still run, and their reservations went with it. So the
rebuild leaves a marker beside the counter (:func:`marker_key`: the deployment's epoch then,
and the largest primary key of the records counted), and :func:`settle` settles a request
admitted in another epoch by adding its usage if its record was not counted, instead of lowering
the counter from a reservation it never held. After any sequence the counter is the records of
the period plus the live reservations.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import redis
from asgiref.sync import sync_to_async
from django.db import connections
from django.db.models import Max, Sum

from gateway import pricing
from gateway.clients import sync_redis
from gateway.conf import redis_keys
from gateway.scripts import LuaScript
from inference.protocol.keys import lua_script
from tenants.models import Tenant, UsageRecord

REBUILD_LUA = LuaScript(lua_script("rebuild"))
SETTLE_LUA = LuaScript(lua_script("settle"))


@dataclass(frozen=True)
class BudgetPeriod:
    """One budget period of one tenant: its counter's key and its span in unix seconds."""

    tenant_pk: int
    index: int
    seconds: int
    key: str

    @property
    def start(self) -> datetime:
        return datetime.fromtimestamp(self.index * self.seconds, tz=UTC)

    @property
    def end(self) -> datetime:
        """The first instant of the next period (excluded)."""
        return datetime.fromtimestamp((self.index + 1) * self.seconds, tz=UTC)


def budget_period(tenant: Tenant, prefix: str, now: float) -> BudgetPeriod:
    """The budget period of ``tenant`` that holds unix time ``now``."""
    seconds = tenant.budget_period_seconds
    index = int(now // seconds)
    return BudgetPeriod(tenant_pk=tenant.pk, index=index, seconds=seconds,
                        key=f"{prefix}:budget:{tenant.pk}:{index}")


def _tokens_used(period: BudgetPeriod) -> tuple[int, int]:
    records = UsageRecord.objects.filter(
        tenant_id=period.tenant_pk, created_at__gte=period.start, created_at__lt=period.end)
    connection = connections[records.db]
    opened_here = connection.connection is None
    try:
        totals = records.aggregate(tokens=Sum("billed_tokens"), upto=Max("pk"))
        return int(totals["tokens"] or 0), int(totals["upto"] or 0)
    finally:
        # Leave the thread's connection as found: outside a request (the chat, tests) the
        # thread that runs this may be asgiref's shared one, which nothing else closes.
        if opened_here and not connection.in_atomic_block:
            connection.close()


async def used_in_period(period: BudgetPeriod) -> int:
    """Tokens charged (``billed_tokens``: prompt + completion, batch work at its price) of the
    tenant's usage records created within ``period``.

    The query runs off the event loop (``sync_to_async``).
    """
    return (await sync_to_async(_tokens_used)(period))[0]


async def ensure_counter(client, period: BudgetPeriod) -> bool:
    """Rebuild the budget counter of ``period`` from the database if Redis no longer has it.

    The rebuilt value is set only if the key is still missing (``SET NX``), so web processes
    rebuilding at once never add up, with the expiry ``admit.lua`` gives it (the period's length),
    and with its marker (``inference/protocol/lua/rebuild.lua``). The database query runs off the
    event loop.

    Args:
        client: an asyncio Redis client.
        period: from :func:`budget_period`.

    Returns:
        Whether this call set the counter.
    """
    if await client.exists(period.key):
        return False
    used, upto = await sync_to_async(_tokens_used)(period)
    return bool(await REBUILD_LUA.arun(client, 3, period.key, marker_key(period.key),
                                  redis_keys().epoch, used, period.seconds, upto,
                                  uuid.uuid4().hex))


def marker_key(counter_key: str) -> str:
    """The key of the marker a rebuild leaves for the counter ``counter_key``
    (``{prefix}:budget:{tenant}:{period}`` -> ``{prefix}:budget-rebuilt:{tenant}:{period}``:
    outside the counters' own pattern, so that a scan of the counters finds none)."""
    head, sep, tail = counter_key.rpartition(":budget:")
    if not sep:
        raise ValueError(f"not a budget counter's key: {counter_key!r}")
    return f"{head}:budget-rebuilt:{tail}"


def settle(meta: dict[str, Any], actual_tokens: int, client: redis.Redis | None = None, *,
           ledger: tuple[str, str] | None = None, epoch: str | None = None,
           record: int | None = None) -> bool:
    """Replace the tokens reserved at admission by ``actual_tokens`` (prompt + completion).

    Token windows are settled to ``actual_tokens``; budgets to what they cost at the price the
    request was admitted at (:func:`gateway.pricing.priced`, the ``billed_tokens`` of its usage
    record), as they were reserved.

    Args:
        meta: the request's ``meta`` (``meta["admission"]``: what it reserved, at what price).
        ledger: (the usage ledger's key, the request id): settle only if this call removes the
            request's ledger entry, in the same atomic step (:mod:`gateway.usage`), so that a
            request is settled exactly once.
        epoch: the deployment's epoch the request was admitted in (None: not known).
        record: the primary key of its usage record (None: not known): a counter rebuilt after
            its admission holds its usage if the record was counted.

    Returns:
        Whether this call settled them (False when the ledger entry was already gone).

    Raises:
        redis.RedisError: Redis is unreachable.
    """
    call = _settle_call(meta, actual_tokens, ledger, epoch, record)
    if call is None:
        return True
    return int(SETTLE_LUA.run(client or sync_redis(), *call)) >= 0


def settle_many(settlements: list[tuple[dict[str, Any], int, str, int | None, str | None]],
                ledger: str, client: redis.Redis | None = None) -> list[bool]:
    """:func:`settle` of many requests, each against its usage ledger entry, in one round trip.

    Args:
        settlements: per request: its ``meta``, its actual tokens, its request id, its usage
            record's primary key (None: not known) and its epoch (None: not known).
        ledger: the usage ledger's key.

    Returns:
        For each, whether this call settled it.

    Raises:
        redis.RedisError: Redis is unreachable.
    """
    if not settlements:
        return []
    client = client or sync_redis()
    pipe = client.pipeline(transaction=False)
    calls = []
    for meta, actual, request_id, record, epoch in settlements:
        call = _settle_call(meta, actual, (ledger, request_id), epoch, record)
        assert call is not None  # against a ledger entry: always a call
        calls.append(SETTLE_LUA.queue(pipe, *call))
    replies = SETTLE_LUA.finish(client, calls, pipe.execute(raise_on_error=False))
    return [int(reply) >= 0 for reply in replies]


def _settle_call(meta: dict[str, Any], actual_tokens: int, ledger: tuple[str, str] | None,
                 epoch: str | None, record: int | None) -> tuple | None:
    """The arguments of ``settle.lua`` after the script (None: nothing to settle)."""
    admission = meta.get("admission") or {}
    windows = admission.get("token_windows") or []
    budgets = admission.get("budgets") or []
    if ledger is None and not windows and not budgets:
        return None
    spec: dict[str, Any] = {
        "member": admission.get("member", ""), "actual": int(actual_tokens),
        "billed": pricing.priced(int(actual_tokens), pricing.price_of(meta)),
        "windows": [{"cost": w["cost"]} for w in windows],
        "budgets": [{"cost": b["cost"]} for b in budgets]}
    if ledger is not None:
        spec["ledger"], spec["request_id"] = ledger
    if epoch is not None:
        spec["epoch"] = epoch
    if record is not None:
        spec["record"] = record
    names = ([w["key"] for w in windows] + [b["key"] for b in budgets]
             + [marker_key(b["key"]) for b in budgets])
    return (len(names), *names, json.dumps(spec))
