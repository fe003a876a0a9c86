"""Token budgets: the counter of a tenant's period, and its rebuild after Redis lost it.

A tenant's budget counter (``{prefix}:budget:{tenant_pk}:{period_index}``) holds the tokens
reserved and used in the current period, where the period index is ``int(unix_time // period)``
(:attr:`tenants.models.Tenant.budget_period_seconds`). ``inference/protocol/lua/admit.lua`` reads
it, reserves into it and sets its expiry; ``inference/protocol/lua/settle.lua`` settles it to the
real usage.

Redis is not persistent, but the usage records in the database are billing's source of truth: a
counter that is missing (a Redis restart, a flush, or simply the period's first request) is
rebuilt by :func:`ensure_counter` from the tenant's usage records of the period, before admission
reads it. Where the counter exists this costs one ``EXISTS``; the database is asked once per
tenant and period, and once after each loss of Redis.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from asgiref.sync import sync_to_async
from django.db import connections
from django.db.models import F, Sum

from tenants.models import Tenant, UsageRecord


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


def _tokens_used(period: BudgetPeriod) -> int:
    records = UsageRecord.objects.filter(
        tenant_id=period.tenant_pk, created_at__gte=period.start, created_at__lt=period.end)
    connection = connections[records.db]
    opened_here = connection.connection is None
    try:
        totals = records.aggregate(tokens=Sum(F("prompt_tokens") + F("completion_tokens")))
        return int(totals["tokens"] or 0)
    finally:
        # Leave the thread's connection as found: outside a request (the chat, tests) the
        # thread that runs this may be asgiref's shared one, which nothing else closes.
        if opened_here and not connection.in_atomic_block:
            connection.close()


async def used_in_period(period: BudgetPeriod) -> int:
    """Tokens (prompt + completion) of the tenant's usage records created within ``period``.

    The query runs off the event loop (``sync_to_async``).
    """
    return await sync_to_async(_tokens_used)(period)


async def ensure_counter(client, period: BudgetPeriod) -> bool:
    """Rebuild the budget counter of ``period`` from the database if Redis no longer has it.

    The rebuilt value is set only if the key is still missing (``SET NX``), so web processes
    rebuilding at once never add up, with the expiry ``admit.lua`` gives it (the period's length).
    The database query runs off the event loop.

    Args:
        client: an asyncio Redis client.
        period: from :func:`budget_period`.

    Returns:
        Whether this call set the counter.
    """
    if await client.exists(period.key):
        return False
    used = await used_in_period(period)
    return bool(await client.set(period.key, used, nx=True, ex=period.seconds))
