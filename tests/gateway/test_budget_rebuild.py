"""A token budget survives the loss of Redis: a missing counter is rebuilt from usage records.

Real Redis and a real database. The tests commit what they write (``transaction=True``): the
rebuild reads the usage records from the async ORM's thread, outside a test transaction.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from datetime import timedelta

import pytest
from django.conf import settings

from gateway import admission, budgets
from gateway.admission import Principal
from gateway.errors import APIError
from inference.protocol.messages import RequestMessage
from tenants.models import UsageRecord

pytestmark = pytest.mark.django_db(transaction=True)


def message(key) -> RequestMessage:
    tenant = key.tenant
    return RequestMessage(request_id=uuid.uuid4().hex, tenant=tenant.slug,
                          fairness_key=tenant.slug, prompt="hi",
                          meta={"tenant_id": tenant.pk, "api_key_id": key.pk,
                                "model": settings.LLM_PLATFORM["SERVED_MODEL_NAME"]})


async def _admit(key, cost: int) -> RequestMessage | APIError:
    try:
        return await admission.admit(Principal.for_api_key(key), message(key), cost)
    except APIError as exc:
        return exc


def admit_many(key, n: int, cost: int) -> list[RequestMessage | APIError]:
    """Admit ``n`` requests at once on one event loop: the message or the refusal of each."""

    async def all_at_once():
        return await asyncio.gather(*(_admit(key, cost) for _ in range(n)))

    return asyncio.run(all_at_once())


def finish(msg: RequestMessage, prompt: int, completion: int) -> None:
    """What recording a finished request's usage does: its usage record, then the settlement of
    its reservations to the real usage."""
    UsageRecord.objects.create(request_id=msg.request_id, tenant_id=msg.meta["tenant_id"],
                               api_key_id=msg.meta["api_key_id"], model="m",
                               prompt_tokens=prompt, completion_tokens=completion)
    admission.settle(msg.meta, prompt + completion)


def record(tenant, tokens: int, at=None) -> UsageRecord:
    """A usage record of ``tokens`` (prompt and completion), created at ``at`` if given."""
    row = UsageRecord.objects.create(request_id=uuid.uuid4().hex, tenant=tenant, model="m",
                                     prompt_tokens=tokens // 2,
                                     completion_tokens=tokens - tokens // 2)
    if at is not None:
        UsageRecord.objects.filter(pk=row.pk).update(created_at=at)
    return row


def counter_key(tenant, prefix: str) -> str:
    return budgets.budget_period(tenant, prefix, time.time()).key


def current_period(tenant, prefix: str, margin_s: float = 10) -> budgets.BudgetPeriod:
    """The tenant's period now, after waiting out its last ``margin_s`` seconds if need be (so
    that the test's admissions fall in the period it computed)."""
    period = budgets.budget_period(tenant, prefix, time.time())
    left = period.end.timestamp() - time.time()
    if left < margin_s:
        time.sleep(left + 0.1)
        period = budgets.budget_period(tenant, prefix, time.time())
    return period


def test_lost_counter_refuses_and_admits_as_if_it_had_been_kept(make_tenant, live_worker,
                                                                rclient, redis_prefix):
    tenant, key, _ = make_tenant(token_budget=300)
    first, second = admit_many(key, 2, cost=150)
    finish(first, 60, 40)
    finish(second, 100, 50)
    name = counter_key(tenant, redis_prefix)
    assert int(rclient.get(name)) == 250
    [kept] = admit_many(key, 1, cost=100)

    rclient.delete(name)  # Redis restarted: the counter is gone
    [refused] = admit_many(key, 1, cost=100)
    assert isinstance(refused, APIError)
    assert (refused.status, refused.code) == (429, "token_budget_exhausted")
    # The same refusal, but for when the period ends (a second may pass between the two).
    resets = refused.details.pop("resets_in_s"), kept.details.pop("resets_in_s")
    assert abs(resets[0] - resets[1]) <= 1
    assert refused.details == kept.details == {"limit": 300, "used": 250, "requested": 100,
                                               "scope": "token budget per month"}
    assert refused.message.split(" The budget")[0] == kept.message.split(" The budget")[0]
    assert "250 of 300" in refused.message
    # Rebuilt with the period's expiry, and the refusal reserved nothing.
    assert int(rclient.get(name)) == 250
    assert 0 < rclient.ttl(name) <= tenant.budget_period_seconds

    [admitted] = admit_many(key, 1, cost=50)
    assert isinstance(admitted, RequestMessage)
    assert int(rclient.get(name)) == 300
    [refused] = admit_many(key, 1, cost=1)
    assert refused.code == "token_budget_exhausted" and refused.details["used"] == 300


def test_flushed_redis_rebuilds_from_the_records_of_the_tenant_only(make_tenant, live_worker,
                                                                    rclient, redis_prefix):
    tenant, key, _ = make_tenant(token_budget=1000)
    other, _, _ = make_tenant(token_budget=1000)
    record(tenant, 700)
    record(other, 500)
    results = admit_many(key, 3, cost=200)
    assert [isinstance(r, RequestMessage) for r in results].count(True) == 1
    assert {r.details["used"] for r in results if isinstance(r, APIError)} == {900}
    assert int(rclient.get(counter_key(tenant, redis_prefix))) == 900


def test_an_existing_counter_is_not_read_from_the_database_again(make_tenant, live_worker,
                                                                 rclient, redis_prefix):
    tenant, key, _ = make_tenant(token_budget=1000)
    [msg] = admit_many(key, 1, cost=100)
    finish(msg, 50, 50)
    # A record the counter does not hold (written behind its back): while the counter exists it
    # is the figure admission uses, so the database is not asked again.
    record(tenant, 800)
    [admitted] = admit_many(key, 1, cost=800)
    assert isinstance(admitted, RequestMessage)
    assert int(rclient.get(counter_key(tenant, redis_prefix))) == 900


def test_records_of_another_period_do_not_count(make_tenant, live_worker, rclient,
                                                redis_prefix):
    tenant, key, _ = make_tenant(token_budget=300, budget_period="hour")
    period = current_period(tenant, redis_prefix)
    record(tenant, 200, at=period.start - timedelta(microseconds=1))  # the previous period
    record(tenant, 120, at=period.start)  # the first instant of this one
    record(tenant, 90, at=period.end)  # the next one
    assert asyncio.run(budgets.used_in_period(period)) == 120

    [admitted] = admit_many(key, 1, cost=180)
    assert isinstance(admitted, RequestMessage)
    assert int(rclient.get(period.key)) == 300
    [refused] = admit_many(key, 1, cost=1)
    assert refused.code == "token_budget_exhausted" and refused.details["used"] == 300
    assert refused.details["scope"] == "token budget per hour"


def test_concurrent_admissions_rebuild_once(make_tenant, live_worker, rclient, redis_prefix):
    tenant, key, _ = make_tenant(token_budget=1000)
    record(tenant, 400)
    # 20 at once, the counter missing: 400 + 12 * 50 = 1000, so exactly 12 fit. Counting the
    # records twice would admit fewer; a rebuild overwriting others' reservations, more.
    results = admit_many(key, 20, cost=50)
    admitted = [r for r in results if isinstance(r, RequestMessage)]
    refused = [r for r in results if isinstance(r, APIError)]
    assert len(admitted) == 12
    assert {r.code for r in refused} == {"token_budget_exhausted"}
    assert int(rclient.get(counter_key(tenant, redis_prefix))) == 1000


def test_rebuilds_from_several_web_processes_at_once(make_tenant, live_worker, rclient,
                                                     redis_prefix):
    tenant, key, _ = make_tenant(token_budget=1000)
    record(tenant, 400)
    results: list[RequestMessage | APIError] = []
    lock = threading.Lock()
    start = threading.Barrier(4)

    def web_process() -> None:  # its own event loop and Redis pool
        start.wait()
        mine = admit_many(key, 5, cost=50)
        with lock:
            results.extend(mine)

    threads = [threading.Thread(target=web_process) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(results) == 20
    assert [isinstance(r, RequestMessage) for r in results].count(True) == 12
    assert int(rclient.get(counter_key(tenant, redis_prefix))) == 1000


def test_concurrent_rebuilds_set_the_counter_once(make_tenant, rclient, redis_prefix):
    tenant, _, _ = make_tenant(token_budget=1000)
    record(tenant, 400)
    period = budgets.budget_period(tenant, redis_prefix, time.time())

    async def rebuild_at_once() -> list[bool]:
        from gateway.clients import aredis

        return await asyncio.gather(*(budgets.ensure_counter(aredis(), period)
                                      for _ in range(10)))

    assert asyncio.run(rebuild_at_once()).count(True) == 1
    assert int(rclient.get(period.key)) == 400
    assert 0 < rclient.ttl(period.key) <= period.seconds
    # Present: nothing is set again.
    rclient.incrby(period.key, 5)
    assert asyncio.run(rebuild_at_once()).count(True) == 0
    assert int(rclient.get(period.key)) == 405


def test_no_budget_no_counter(make_tenant, live_worker, rclient, redis_prefix):
    tenant, key, _ = make_tenant()
    record(tenant, 400)
    [admitted] = admit_many(key, 1, cost=50)
    assert isinstance(admitted, RequestMessage)
    assert not list(rclient.scan_iter(f"{redis_prefix}:budget:*"))
