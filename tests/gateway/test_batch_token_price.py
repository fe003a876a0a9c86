"""Batch work is charged ``BATCH_TOKEN_PRICE`` of a token in token budgets and usage records
(``gateway.pricing``): reserved at ``ceil(price * (prompt + max_tokens))``, settled and recorded
at ``ceil(price * tokens used)``, at the price in force when it was admitted; an interactive
request is charged in full, and tokens per minute count every request in full.

Real Redis and a real database (committed: a rebuild reads the records from another thread).
"""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from gateway import admission, budgets, pricing, usage
from gateway.admission import Principal
from gateway.clients import aredis
from gateway.errors import APIError
from inference.protocol.messages import RequestMessage, batch_fairness_key
from tenants.models import UsageRecord
from tests.gateway.test_budget_after_data_loss import live_worker_again, lose_redis_data
from tests.gateway.test_usage_ledger import run_to_end

pytestmark = pytest.mark.django_db(transaction=True)


def admit(key, cost: int, *, batch: bool) -> RequestMessage:
    """A request of ``key`` reserving ``cost`` tokens (prompt + max_tokens): a batch line's
    (as the Batch API sends it) or an interactive one."""
    tenant = key.tenant
    meta = {"tenant_id": tenant.pk, "api_key_id": key.pk, "stream": False}
    if batch:
        meta["batch_id"] = "batch_test"
    message = RequestMessage(
        request_id=uuid.uuid4().hex, tenant=tenant.slug, prompt="hi", batch=batch,
        fairness_key=batch_fairness_key(tenant.slug) if batch else tenant.slug,
        batch_deadline_at=time.time() + 3600 if batch else 0.0, meta=meta)
    return asyncio.run(admission.admit(Principal.for_api_key(key), message, cost))


def refused(key, cost: int, *, batch: bool) -> APIError:
    with pytest.raises(APIError) as caught:
        admit(key, cost, batch=batch)
    return caught.value


def charged(rclient, tenant, prefix: str) -> int:
    """The tenant's budget counter now."""
    return int(rclient.get(budgets.budget_period(tenant, prefix, time.time()).key) or 0)


def finish(rclient, keys, message: RequestMessage, prompt: int, completion: int) -> UsageRecord:
    """A worker runs the request to its end, and its usage is recorded (and settled)."""
    run_to_end(rclient, keys, message, prompt=prompt, completion=completion)
    assert usage.record(message.request_id) is True
    return UsageRecord.objects.get(request_id=message.request_id)


def rebuilt(rclient, tenant, prefix: str) -> int:
    """The counter as rebuilt from the usage records once Redis lost it."""
    period = budgets.budget_period(tenant, prefix, time.time())
    rclient.delete(period.key)

    async def rebuild() -> bool:
        return await budgets.ensure_counter(aredis(), period)

    assert asyncio.run(rebuild()) is True
    return int(rclient.get(period.key))


def test_a_batch_line_is_charged_half_its_tokens_an_interactive_request_all_of_them(
        make_tenant, live_worker, rclient, keys, redis_prefix):
    tenant, key, _ = make_tenant(token_budget=10_000, tokens_per_minute=10_000)
    line = admit(key, 101, batch=True)
    assert charged(rclient, tenant, redis_prefix) == 51  # ceil(0.5 * 101)
    interactive = admit(key, 101, batch=False)
    assert charged(rclient, tenant, redis_prefix) == 51 + 101

    # The worker takes the interactive request first (batch work waits behind it).
    interactive_record = finish(rclient, keys, interactive, prompt=7, completion=20)
    assert charged(rclient, tenant, redis_prefix) == 51 + 27
    line_record = finish(rclient, keys, line, prompt=7, completion=20)
    assert charged(rclient, tenant, redis_prefix) == 14 + 27  # ceil(0.5 * 27) + 27

    # The records keep the tokens processed and the tokens charged, the batch line marked.
    assert (line_record.total_tokens, line_record.billed_tokens) == (27, 14)
    assert line_record.batch_id == "batch_test" and line_record.is_batch
    assert (interactive_record.total_tokens, interactive_record.billed_tokens) == (27, 27)
    assert not interactive_record.is_batch
    # Tokens per minute protect capacity: both count their 27 tokens in full.
    window = line.meta["admission"]["token_windows"][0]["key"]
    assert sorted(m.decode().rsplit(":", 1)[1] for m in rclient.zrange(window, 0, -1)) == \
        ["27", "27"]
    # Redis lost the counter: rebuilt from the records, it is what it was.
    assert rebuilt(rclient, tenant, redis_prefix) == 14 + 27


def test_a_budget_a_line_fits_only_at_its_price_admits_it(make_tenant, live_worker):
    _, key, _ = make_tenant(token_budget=60)
    full = refused(key, 100, batch=False)
    assert (full.code, full.details["requested"]) == ("token_budget_exhausted", 100)
    assert "token_price" not in full.details and "batch price" not in full.message

    admit(key, 100, batch=True)  # reserves 50 of the 60
    over = refused(key, 21, batch=True)  # ceil(10.5) = 11 more: 61
    assert over.code == "token_budget_exhausted" and over.status == 429
    assert over.details["used"] == 50 and over.details["requested"] == 11
    assert over.details["token_price"] == 0.5
    assert "reserves 11 (prompt + max_tokens at the batch price of 0.5 per token)" in \
        over.message
    admit(key, 20, batch=True)  # 10 more: exactly 60


def test_the_price_a_line_was_admitted_at_is_the_price_it_is_charged(
        settings, make_tenant, live_worker, rclient, keys, redis_prefix):
    tenant, key, _ = make_tenant(token_budget=10_000)
    line = admit(key, 100, batch=True)
    assert line.meta["admission"]["token_price"] == 0.5
    assert charged(rclient, tenant, redis_prefix) == 50
    # The setting changes while the line runs: its settlement and record keep its price.
    settings.LLM_PLATFORM = {**settings.LLM_PLATFORM, "BATCH_TOKEN_PRICE": 0.25}
    record = finish(rclient, keys, line, prompt=9, completion=10)
    assert record.billed_tokens == 10  # ceil(0.5 * 19), not ceil(0.25 * 19)
    assert charged(rclient, tenant, redis_prefix) == 10
    later = admit(key, 100, batch=True)  # admitted now: the new price
    assert later.meta["admission"]["token_price"] == 0.25
    assert charged(rclient, tenant, redis_prefix) == 10 + 25
    assert finish(rclient, keys, later, prompt=9, completion=10).billed_tokens == 5
    assert charged(rclient, tenant, redis_prefix) == rebuilt(rclient, tenant, redis_prefix) == 15


def test_prices_round_up_once_per_request_from_the_price_as_written(
        settings, make_tenant, live_worker, rclient, keys, redis_prefix):
    # 0.1 * 30 is 3.0000000000000004 in binary floating point: charged 3, not 4.
    assert (pricing.priced(30, 0.1), pricing.priced(31, 0.1), pricing.priced(1, 0.5)) == (3, 4, 1)
    settings.LLM_PLATFORM = {**settings.LLM_PLATFORM, "BATCH_TOKEN_PRICE": 0.1}
    tenant, key, _ = make_tenant(token_budget=1000)
    lines = [admit(key, 30, batch=True) for _ in range(3)]
    assert charged(rclient, tenant, redis_prefix) == 9
    for message, (prompt, completion) in zip(lines, [(10, 20), (10, 11), (1, 0)], strict=True):
        finish(rclient, keys, message, prompt, completion)
    # ceil(3.0) + ceil(2.1) + ceil(0.1), each rounded up on its own.
    assert charged(rclient, tenant, redis_prefix) == 3 + 3 + 1
    assert rebuilt(rclient, tenant, redis_prefix) == 7


def test_a_line_admitted_before_redis_lost_its_data_adds_its_price_to_the_rebuilt_counter(
        make_tenant, live_worker, rclient, keys, redis_prefix):
    tenant, key, _ = make_tenant(token_budget=10_000)
    UsageRecord.objects.create(request_id=uuid.uuid4().hex, tenant=tenant, model="m",
                               prompt_tokens=100, completion_tokens=200)  # charged in full
    line = admit(key, 400, batch=True)
    assert charged(rclient, tenant, redis_prefix) == 300 + 200
    lose_redis_data(rclient, redis_prefix)
    live_worker_again(rclient, keys)
    admit(key, 100, batch=True)  # the counter is rebuilt from the record: 300, then 50 more
    assert charged(rclient, tenant, redis_prefix) == 300 + 50
    # Its settlement (no record of it counted) adds what its tokens cost: ceil(0.5 * 101).
    assert budgets.settle(line.meta, 101, epoch=line.meta["epoch"]) is True
    assert charged(rclient, tenant, redis_prefix) == 300 + 50 + 51
