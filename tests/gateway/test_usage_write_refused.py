"""A usage record whose database write fails or contends is never lost nor late by minutes: many
requests ending at once are all recorded by their web process, and one whose write the database
refused is handed to the Celery usage task, which tries again while the database is out.

Real refusals of the database the suite runs on (:mod:`tests.support.database`), a real Celery
message on the real broker."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
import redis
from celery import current_app

from gateway import usage
from gateway.errors import database_unavailable
from gateway.tasks import record_usage
from inference.protocol.keys import USAGE_TASK_NAME
from tenants.models import UsageRecord
from tests.gateway.test_usage_ledger import admitted, run_to_end
from tests.support.database import database_fault  # noqa: F401 - a fixture

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def metered(make_tenant, live_worker):
    _, key, _ = make_tenant(token_budget=100_000)
    return key


def test_requests_ending_at_once_are_all_recorded_by_their_web_process(metered, rclient, keys):
    messages = [admitted(metered, 50) for _ in range(12)]
    for message in messages:
        run_to_end(rclient, keys, message, prompt=3, completion=4)
    start = threading.Barrier(len(messages))
    failures: list[BaseException] = []

    def record(request_id: str) -> None:
        from django.db import connection

        start.wait()
        try:
            usage.record(request_id)
        except BaseException as exc:  # noqa: BLE001 - reported below
            failures.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=record, args=(m.request_id,)) for m in messages]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert failures == []
    assert UsageRecord.objects.filter(request_id__in=[m.request_id for m in messages]).count() == 12
    assert usage.pending() == 0


def usage_tasks_queued(request_id: str) -> list[dict]:
    """The usage-task messages for ``request_id`` waiting on the broker (removed as read)."""
    broker = redis.Redis.from_url(current_app.conf.broker_url)
    queue = current_app.conf.task_default_queue
    found = []
    for raw in broker.lrange(queue, 0, -1):
        message = json.loads(raw)
        headers = message.get("headers", {})
        if headers.get("task") == USAGE_TASK_NAME and request_id in headers.get("argsrepr", ""):
            found.append(message)
            broker.lrem(queue, 1, raw)
    return found


def test_a_write_the_database_refused_goes_to_the_usage_task_which_retries(
        metered, rclient, keys, database_fault):  # noqa: F811
    from asgiref.sync import sync_to_async

    message = admitted(metered, 50)
    run_to_end(rclient, keys, message, prompt=3, completion=4)
    rid = message.request_id
    asyncio.run(sync_to_async(database_fault.read_only)())
    database_fault.read_only()
    asyncio.run(usage.record_if_ended(rid))  # never raises
    assert rclient.hexists(keys.usage_pending, rid)  # kept for whoever records it
    [queued] = usage_tasks_queued(rid)  # handed to the task, to run a second later
    assert queued["headers"]["eta"]
    # The task, while the database still refuses: it retries, then leaves it to the
    # reconciliation (the ledger keeps it).
    result = record_usage.apply(args=[rid])
    assert result.failed() and database_unavailable(result.result)
    assert rclient.hexists(keys.usage_pending, rid)
    database_fault.restore()
    asyncio.run(sync_to_async(database_fault.restore)())
    assert record_usage.apply(args=[rid]).get() is True
    row = UsageRecord.objects.get(request_id=rid)
    assert (row.prompt_tokens, row.completion_tokens) == (3, 4)
    assert not rclient.hexists(keys.usage_pending, rid)
