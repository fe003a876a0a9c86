"""Rate limits, concurrency, token budget and gate 1 hold exactly under concurrency."""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest

from gateway import admission
from gateway.admission import Principal
from gateway.errors import APIError
from inference.protocol.keys import queue_script
from inference.protocol.messages import RequestMessage

pytestmark = pytest.mark.django_db


def gate1(rclient, keys) -> int:
    """Gate 1's figure: requests accepted and not yet admitted by any worker."""
    return int(rclient.eval(queue_script("gate1"), 0, keys.prefix))


def message(tenant_slug: str = "t") -> RequestMessage:
    return RequestMessage(request_id=uuid.uuid4().hex, tenant=tenant_slug,
                          fairness_key=tenant_slug, prompt="hi")


def admit_many(key, n: int, cost: int = 10) -> list[APIError | None]:
    """Admit ``n`` requests at once; the refusal of each (None when admitted)."""

    async def one() -> APIError | None:
        try:
            await admission.admit(Principal.for_api_key(key), message(key.tenant.slug), cost)
        except APIError as exc:
            return exc
        return None

    async def all_at_once() -> list[APIError | None]:
        return await asyncio.gather(*(one() for _ in range(n)))

    return asyncio.run(all_at_once())


def shift_window(rclient, name: str, seconds: float) -> None:
    """Move every entry of a moving window ``seconds`` into the past."""
    for member, score in rclient.zrange(name, 0, -1, withscores=True):
        rclient.zadd(name, {member: score - seconds * 1000})


def test_twenty_at_once_against_five_per_minute_admit_exactly_five(make_tenant, live_worker):
    _, key, _ = make_tenant(requests_per_minute=5)
    results = admit_many(key, 20)
    refused = [r for r in results if r is not None]
    assert len(refused) == 15
    assert {r.code for r in refused} == {"rate_limit_exceeded"}
    assert all(r.status == 429 and 1 <= r.retry_after_s <= 60 for r in refused)
    assert all(r.headers()["Retry-After"] for r in refused)


def test_the_window_moves_no_boundary_burst(make_tenant, live_worker, rclient, redis_prefix):
    tenant, key, _ = make_tenant(requests_per_minute=5)
    assert admit_many(key, 5).count(None) == 5
    window = f"{redis_prefix}:rl:tenant:{tenant.pk}:rpm"
    # 59 s later all five are still inside the last 60 s: nothing more may pass.
    shift_window(rclient, window, 59)
    assert admit_many(key, 3).count(None) == 0
    # Once they are older than 60 s, the next five pass.
    shift_window(rclient, window, 2)
    assert admit_many(key, 8).count(None) == 5


def test_per_key_limit_applies_besides_the_tenant_limit(make_tenant, live_worker):
    from tenants.services import create_api_key

    tenant, key, _ = make_tenant(requests_per_minute=6)
    key.requests_per_minute = 2
    key.save()
    other, _ = create_api_key(tenant, "second")
    assert admit_many(key, 5).count(None) == 2
    assert admit_many(other, 10).count(None) == 4


def test_tokens_per_minute_reserve_worst_case_and_settle(make_tenant, live_worker):
    _, key, _ = make_tenant(tokens_per_minute=100)
    results = admit_many(key, 5, cost=40)
    assert results.count(None) == 2


def test_settle_replaces_the_reservation(make_tenant, live_worker, rclient, redis_prefix):
    tenant, key, _ = make_tenant(tokens_per_minute=100, token_budget=1000)
    msg = asyncio.run(admission.admit(Principal.for_api_key(key), message(tenant.slug), 90))
    assert admit_many(key, 1, cost=20) != [None]
    admission.settle(msg.meta, 30)
    assert admit_many(key, 1, cost=20) == [None]
    budget_key = msg.meta["admission"]["budgets"][0]["key"]
    assert int(rclient.get(budget_key)) == 30 + 20


def test_budget_exhausted_is_not_retryable(make_tenant, live_worker):
    _, key, _ = make_tenant(token_budget=100)
    assert admit_many(key, 1, cost=60) == [None]
    [refused] = admit_many(key, 1, cost=60)
    assert refused.code == "token_budget_exhausted"
    headers = refused.headers()
    assert headers["x-should-retry"] == "false"  # not before the period ends ...
    # ... which the refusal names: the budget counter starts again then.
    resets = refused.details["resets_in_s"]
    assert 1 <= resets <= key.tenant.budget_period_seconds
    assert int(headers["Retry-After"]) == resets and f"again in {resets} s" in refused.message


def test_request_larger_than_the_token_limit_can_never_pass(make_tenant, live_worker):
    _, key, _ = make_tenant(tokens_per_minute=50)
    [refused] = admit_many(key, 1, cost=60)
    assert refused.code == "rate_limit_exceeded" and "Retry-After" not in refused.headers()


def test_max_concurrent_requests(make_tenant, live_worker):
    tenant, key, _ = make_tenant(max_concurrent_requests=2)
    msgs = [asyncio.run(admission.admit(Principal.for_api_key(key), message(tenant.slug), 5))
            for _ in range(2)]
    [refused] = admit_many(key, 1)
    assert refused.code == "concurrency_limit_exceeded"
    asyncio.run(admission.release(msgs[0].meta))
    assert admit_many(key, 3).count(None) == 1


def test_gate1_never_admits_past_max_queue_size(settings, tenant_key, live_worker, rclient,
                                                keys):
    settings.LLM_PLATFORM = {**settings.LLM_PLATFORM, "MAX_QUEUE_SIZE": 8}
    _, key, _ = tenant_key
    results = admit_many(key, 30)
    assert results.count(None) == 8
    assert {r.code for r in results if r} == {"queue_full"}
    assert gate1(rclient, keys) == 8
    waiting = [json.loads(r) for r in rclient.hvals(keys.fq("wait"))]
    assert len(waiting) == 8
    assert {json.loads(r["body"])["tenant"] for r in waiting} == {key.tenant.slug}


def test_refused_request_consumes_nothing(settings, make_tenant, live_worker, rclient, keys):
    settings.LLM_PLATFORM = {**settings.LLM_PLATFORM, "MAX_QUEUE_SIZE": 1}
    _, key, _ = make_tenant(requests_per_minute=3)
    assert admit_many(key, 3).count(None) == 1  # two refused by gate 1
    rclient.delete(keys.fq("wait"))  # as if a worker had admitted it
    assert admit_many(key, 1) == [None]  # the refused ones did not use the rate limit


def test_no_live_worker_answers_503_at_once(tenant_key):
    _, key, _ = tenant_key
    [refused] = admit_many(key, 1)
    assert refused.status == 503 and refused.code == "no_worker_available"


def test_batch_lines_are_neither_counted_nor_refused_by_gate1(settings, tenant_key, live_worker,
                                                              rclient, keys):
    settings.LLM_PLATFORM = {**settings.LLM_PLATFORM, "MAX_QUEUE_SIZE": 2}
    _, key, _ = tenant_key
    principal = Principal.for_api_key(key)
    slug = key.tenant.slug

    async def admit(batch: bool) -> APIError | None:
        line = message(slug).model_copy(update={"batch": True}) if batch else message(slug)
        line = RequestMessage.model_validate(line.model_dump())  # its key: the batch one
        try:
            await admission.admit(principal, line, 10)
        except APIError as exc:
            return exc
        return None

    assert [asyncio.run(admit(True)) for _ in range(5)] == [None] * 5
    assert gate1(rclient, keys) == 0
    assert [asyncio.run(admit(False)) for _ in range(2)] == [None, None]
    refused = asyncio.run(admit(False))
    assert refused is not None and refused.code == "queue_full"
    waiting = [json.loads(r) for r in rclient.hvals(keys.fq("wait"))]
    assert sorted(r["key"] for r in waiting) == [slug] * 2 + [f"{slug}:batch"] * 5


def test_batch_work_has_a_fairness_key_of_its_own(settings, tenant_key):
    from gateway.lifecycle import fairness_key

    tenant, key, _ = tenant_key
    assert fairness_key(tenant, batch=True) == f"{tenant.slug}:batch"
    assert fairness_key(tenant) == tenant.slug
    settings.LLM_PLATFORM = {**settings.LLM_PLATFORM, "FAIRNESS_KEY": "api_key"}
    assert fairness_key(tenant, api_key_id=key.id, batch=True) == (
        f"{tenant.slug}/key-{key.id}:batch")
