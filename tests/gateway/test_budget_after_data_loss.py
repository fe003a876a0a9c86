"""A token budget rebuilt after Redis lost its data stays equal to the usage records of the
period plus the live reservations, whatever order the requests admitted before the loss are
recorded in (``gateway.budgets``, ``inference/protocol/lua/settle.lua``).

Real Redis and a real database (committed: the rebuild reads the records from another thread).
"""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from django.db.models import F, Sum

from gateway import admission, budgets, usage
from gateway.admission import Principal
from gateway.errors import APIError
from inference.protocol.events import FinalEvent, FinishReason, Usage
from inference.protocol.messages import RequestMessage
from tenants.models import UsageRecord

pytestmark = pytest.mark.django_db(transaction=True)

LIMIT = 2000


def admit(key, cost: int) -> RequestMessage:
    message = RequestMessage(request_id=uuid.uuid4().hex, tenant=key.tenant.slug,
                             fairness_key=key.tenant.slug, prompt="hi",
                             meta={"tenant_id": key.tenant.pk, "api_key_id": key.pk,
                                   "stream": True})
    return asyncio.run(admission.admit(Principal.for_api_key(key), message, cost))


def lose_redis_data(rclient, prefix: str) -> None:
    """Redis restarted without its data (this deployment's keys, its epoch included)."""
    stale = list(rclient.scan_iter(f"{prefix}:*", count=1000))
    if stale:
        rclient.delete(*stale)


def ended_by_its_worker(message: RequestMessage, prompt: int, completion: int, rclient,
                        keys) -> None:
    """The worker that ran it through the loss ends it (its real path: ``state_lost``)."""
    from inference.worker.live import LiveRequest, WorkerState
    from inference.worker.publisher import EventPublisher

    final = FinalEvent(request_id=message.request_id, seq=completion,
                       finish_reason=FinishReason.ABORT,
                       usage=Usage(prompt_tokens=prompt, completion_tokens=completion))
    EventPublisher(WorkerState(), None, None, rclient, keys).write_unowned_final(
        final, LiveRequest(message, take="t", streamed=completion))


def records_of(tenant) -> int:
    totals = UsageRecord.objects.filter(tenant=tenant).aggregate(
        n=Sum(F("prompt_tokens") + F("completion_tokens")))
    return int(totals["n"] or 0)


def counter(rclient, tenant, prefix: str) -> int:
    return int(rclient.get(budgets.budget_period(tenant, prefix, time.time()).key))


def recorded_in_two_steps(request_id: str, rclient, keys) -> None:
    """A recorder that wrote the row and died before settling; the next one settles."""
    entry = usage.Entry.parse(request_id, rclient.hget(keys.usage_pending, request_id))
    figures = usage.bill(entry.final, entry.message.meta, None)
    usage.save(entry.report(figures.usage), figures)


@pytest.mark.parametrize("order", ["rebuilt, then recorded", "recorded, then rebuilt",
                                   "row written, rebuilt, then settled"])
def test_reservations_made_before_the_loss_never_lower_the_rebuilt_counter(
        make_tenant, live_worker, rclient, keys, redis_prefix, order):
    tenant, key, _ = make_tenant(token_budget=LIMIT)
    UsageRecord.objects.create(request_id=uuid.uuid4().hex, tenant=tenant, model="m",
                               prompt_tokens=100, completion_tokens=200)
    running = admit(key, 700)  # prompt + max_tokens, reserved; it runs through the loss
    assert counter(rclient, tenant, redis_prefix) == 300 + 700
    lose_redis_data(rclient, redis_prefix)
    live_worker_again(rclient, keys)

    ended_by_its_worker(running, prompt=40, completion=60, rclient=rclient, keys=keys)
    if order == "rebuilt, then recorded":
        after = admit(key, 300)  # the counter is rebuilt from the records: 300
        assert usage.record(running.request_id) is True
    elif order == "recorded, then rebuilt":
        assert usage.record(running.request_id) is True
        after = admit(key, 300)
    else:
        recorded_in_two_steps(running.request_id, rclient, keys)
        after = admit(key, 300)  # its row is among those the rebuild counts
        assert usage.record(running.request_id) is False  # the row was there: settled only
    assert usage.pending() == 0
    # The records of the period (300 + 100) plus the live reservation (after's 300).
    assert records_of(tenant) == 300 + 100
    assert counter(rclient, tenant, redis_prefix) == records_of(tenant) + 300
    # And the next admission sees it: 1,300 more fit, not one token over.
    with pytest.raises(APIError) as refused:
        admit(key, LIMIT - 700 + 1)
    assert refused.value.details["used"] == 700
    assert isinstance(admit(key, LIMIT - 700), RequestMessage)
    assert after.meta["epoch"] != running.meta["epoch"]


def test_a_request_admitted_after_the_rebuild_settles_as_before(make_tenant, live_worker,
                                                                rclient, keys, redis_prefix):
    tenant, key, _ = make_tenant(token_budget=LIMIT)
    lose_redis_data(rclient, redis_prefix)
    live_worker_again(rclient, keys)
    first = admit(key, 500)
    ended_by_its_worker(first, prompt=20, completion=30, rclient=rclient, keys=keys)
    assert usage.record(first.request_id) is True
    assert counter(rclient, tenant, redis_prefix) == records_of(tenant) == 50


def live_worker_again(rclient, keys) -> None:
    """A worker's heartbeat, as the live workers beat again once Redis is back."""
    rclient.zadd(keys.workers, {"fake-worker": time.time() + 3600})
