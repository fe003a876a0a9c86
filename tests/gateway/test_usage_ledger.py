"""Usage is recorded exactly once per request, whatever dies when (``gateway.usage``).

A request's end writes its usage entry to the ledger in the same atomic step as its final event;
the entry leaves the ledger only with the settlement of its reservations, after its row is
written. These tests stop the recording at each point a process could die and check the bill.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import pytest

from gateway import admission, usage
from gateway.admission import Principal
from gateway.tasks import record_usage
from inference.protocol.events import (
    ErrorCode,
    ErrorInfo,
    FinalEvent,
    FinishReason,
    TokenEvent,
    Usage,
)
from inference.protocol.messages import RequestMessage
from inference.worker.fair_queue import FairQueue
from tenants.models import UsageRecord

pytestmark = pytest.mark.django_db


def admitted(key, cost: int, **meta) -> RequestMessage:
    """A request of ``key`` admitted (reserving ``cost`` tokens) and waiting in the queue."""
    message = RequestMessage(request_id=uuid.uuid4().hex, tenant=key.tenant.slug,
                             fairness_key=key.tenant.slug, prompt="hi",
                             meta={"tenant_id": key.tenant.pk, "api_key_id": key.pk, **meta})
    return asyncio.run(admission.admit(Principal.for_api_key(key), message, cost))


def run_to_end(rclient, keys, message: RequestMessage, prompt: int, completion: int) -> None:
    """A worker takes the request, streams ``completion`` tokens and ends it."""
    end_with(rclient, keys, message, completion, FinalEvent(
        request_id=message.request_id, seq=completion, finish_reason=FinishReason.LENGTH,
        usage=Usage(prompt_tokens=prompt, completion_tokens=completion)), prompt)


def end_with(rclient, keys, message: RequestMessage, tokens: int, final: FinalEvent,
             prompt: int = 30) -> None:
    """A worker takes the request, writes ``tokens`` token events, then ``final``."""
    queue = FairQueue(rclient, keys, "w1", "vtc")
    [taken] = queue.take(1)
    assert taken.request_id == message.request_id
    events = [TokenEvent(request_id=message.request_id, seq=i, token_id=97, text="a")
              for i in range(tokens)]
    owned = [(event, taken.take) for event in [*events, final]]
    assert queue.write_events(owned, 60, {message.request_id: prompt}) == set()


@pytest.fixture
def metered(make_tenant, live_worker):
    """A tenant with a token budget of 1,000 and 500 tokens per minute, and its key."""
    _, key, _ = make_tenant(token_budget=1000, tokens_per_minute=500)
    return key


def budget_used(rclient, message: RequestMessage) -> int:
    return int(rclient.get(message.meta["admission"]["budgets"][0]["key"]))


def test_a_request_is_billed_once_when_its_task_runs_twice(metered, rclient, keys):
    message = admitted(metered, 300)  # reserves prompt + max_tokens
    run_to_end(rclient, keys, message, prompt=4, completion=6)
    assert budget_used(rclient, message) == 300  # still the reservation
    assert record_usage(message.request_id) is True
    assert record_usage(message.request_id) is False  # a redelivered task
    record = UsageRecord.objects.get(request_id=message.request_id)
    assert (record.prompt_tokens, record.completion_tokens, record.status) == (4, 6, 200)
    assert budget_used(rclient, message) == 10  # settled to the real use, once
    assert not rclient.hexists(keys.usage_pending, message.request_id)


def test_a_recorder_that_died_after_writing_the_row_is_settled_once_by_the_next(
        metered, rclient, keys):
    message = admitted(metered, 300)
    run_to_end(rclient, keys, message, prompt=4, completion=6)
    raw = rclient.hget(keys.usage_pending, message.request_id)
    usage.save(usage.report_from_entry(message.request_id, raw))  # ... then it died
    assert budget_used(rclient, message) == 300
    assert usage.record(message.request_id) is False  # the row was there already
    assert UsageRecord.objects.filter(request_id=message.request_id).count() == 1
    assert budget_used(rclient, message) == 10
    assert usage.record(message.request_id) is False
    assert budget_used(rclient, message) == 10


def test_the_reconciliation_records_what_no_task_did_and_leaves_the_young(metered, rclient,
                                                                         keys):
    lost, young = admitted(metered, 100), admitted(metered, 100)
    run_to_end(rclient, keys, lost, prompt=2, completion=3)
    run_to_end(rclient, keys, young, prompt=2, completion=3)
    # The task of `lost` never ran (its Celery worker died with it) and it ended 60 s ago.
    entry = json.loads(rclient.hget(keys.usage_pending, lost.request_id))
    entry["finished_at"] = time.time() - 60
    rclient.hset(keys.usage_pending, lost.request_id, json.dumps(entry))
    assert usage.reconcile(older_than_s=10) == 1
    assert UsageRecord.objects.filter(request_id=lost.request_id).exists()
    assert not UsageRecord.objects.filter(request_id=young.request_id).exists()
    assert usage.pending() == 1  # its own task records it
    assert usage.reconcile(older_than_s=0) == 1 and usage.pending() == 0


@pytest.mark.django_db(transaction=True)  # the web tier records it on a thread of its own
def test_a_request_withdrawn_while_waiting_is_billed_nothing_and_frees_its_slot(
        make_tenant, live_worker, rclient, keys):
    from asgiref.sync import sync_to_async
    from django.db import connections

    from gateway.aborts import abort

    tenant, key, _ = make_tenant(max_concurrent_requests=1)
    message = admitted(key, 50)
    lease_key = message.meta["admission"]["concurrency_keys"][0]
    assert rclient.zcard(lease_key) == 1

    async def client_leaves() -> None:
        await abort(message.request_id)
        await sync_to_async(connections.close_all)()

    asyncio.run(client_leaves())
    assert rclient.zcard(lease_key) == 0  # the end of the request releases its slot
    record = UsageRecord.objects.get(request_id=message.request_id)
    assert record.finish_reason == "abort" and record.completion_tokens == 0
    assert usage.pending() == 0
    admitted(key, 50)  # the slot is free for the next one


def lost(message: RequestMessage, completion: int) -> FinalEvent:
    return FinalEvent(request_id=message.request_id, seq=completion,
                      finish_reason=FinishReason.ERROR,
                      error=ErrorInfo(code=ErrorCode.WORKER_LOST, message="stopped",
                                      retryable=True),
                      usage=Usage(prompt_tokens=30, completion_tokens=completion))


@pytest.mark.parametrize("stream, billed", [(False, (0, 0)), (True, (30, 5))])
def test_an_error_bills_only_what_the_client_got(metered, rclient, keys, stream, billed):
    # A worker died after 5 tokens: a stream got them; an answer not streamed got nothing (it
    # goes out only whole), so it is billed nothing, and its budget gets back its reservation.
    message = admitted(metered, 300, stream=stream)
    end_with(rclient, keys, message, 5, lost(message, 5))
    assert record_usage(message.request_id) is True
    row = UsageRecord.objects.get(request_id=message.request_id)
    assert (row.prompt_tokens, row.completion_tokens) == billed
    assert row.status == 503 and row.error_code == "worker_lost"
    assert budget_used(rclient, message) == sum(billed)


def test_a_stream_that_ends_with_an_error_before_any_token_is_billed_nothing(metered, rclient,
                                                                            keys):
    message = admitted(metered, 300, stream=True)
    end_with(rclient, keys, message, 0, lost(message, 0))
    record_usage(message.request_id)
    row = UsageRecord.objects.get(request_id=message.request_id)
    assert (row.prompt_tokens, row.completion_tokens) == (0, 0)
    assert budget_used(rclient, message) == 0


def test_a_stop_before_the_first_token_has_no_ttft(metered, rclient, keys):
    # The worker's first event for it is its final one: no token was ever produced.
    message = admitted(metered, 300, stream=True)
    end_with(rclient, keys, message, 0, FinalEvent(
        request_id=message.request_id, finish_reason=FinishReason.ABORT,
        usage=Usage(prompt_tokens=12)))
    record_usage(message.request_id)
    row = UsageRecord.objects.get(request_id=message.request_id)
    assert row.ttft_s is None and row.finish_reason == "abort" and row.prompt_tokens == 12
    # One whose final event carries its only token has one.
    other = admitted(metered, 300, stream=True)
    end_with(rclient, keys, other, 0, FinalEvent(
        request_id=other.request_id, finish_reason=FinishReason.LENGTH,
        usage=Usage(prompt_tokens=12, completion_tokens=1)))
    record_usage(other.request_id)
    assert UsageRecord.objects.get(request_id=other.request_id).ttft_s is not None


def test_a_batch_steps_lines_are_recorded_in_one_go_each_once(metered, rclient, keys):
    from dashboard.recorder import usage_key

    lines = [admitted(metered, 100, stream=False, batch_id="batch_1") for _ in range(4)]
    for i, line in enumerate(lines):
        run_to_end(rclient, keys, line, prompt=2, completion=3 + i)
    ids = [line.request_id for line in lines]
    assert usage.record(ids[0]) is True  # recorded before the step came (the reconciliation)
    assert usage.record_many([*ids, ids[1]]) == 3  # a line named twice is recorded once
    assert usage.record_many(ids) == 0  # a step that runs again: nothing more
    rows = UsageRecord.objects.filter(request_id__in=ids)
    assert sorted((r.completion_tokens, r.billed_tokens, r.batch_id) for r in rows) == [
        (3 + i, 5 + i, "batch_1") for i in range(4)]
    assert budget_used(rclient, lines[0]) == 5 + 6 + 7 + 8  # each settled once, to its use
    assert usage.pending() == 0
    slug = metered.tenant.slug
    counted = rclient.hgetall(usage_key())
    assert int(counted[f"{slug}|requests|200".encode()]) == 4  # in the metrics once each
    assert int(counted[f"{slug}|completion_tokens".encode()]) == 3 + 4 + 5 + 6
    assert int(counted[f"{slug}|billed_tokens|batch".encode()]) == 5 + 6 + 7 + 8
