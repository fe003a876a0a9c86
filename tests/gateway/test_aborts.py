"""Aborts that Redis could not take (gateway/aborts.py): the web monitor sends them when Redis is
back, for up to ``ABORT_RETRY_S``; on the shared Redis, under a key prefix of the test's own."""

from __future__ import annotations

import time
import uuid

import pytest
import redis
import redis.exceptions

from gateway import aborts, monitor
from inference.protocol.keys import Keys

pytestmark = pytest.mark.anyio


@pytest.fixture
def outage(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """While the returned flag holds True, every abort fails as with Redis unreachable."""
    down = [True]
    real_abort = aborts.abort

    async def abort(request_id: str) -> None:
        if down[0]:
            raise redis.exceptions.ConnectionError("Redis unreachable")
        await real_abort(request_id)

    monkeypatch.setattr(aborts, "abort", abort)
    return down


async def test_an_abort_that_failed_in_an_outage_is_sent_by_the_monitor_once_redis_is_back(
        outage: list[bool], keys: Keys, rclient: redis.Redis):
    request_id = f"r-{uuid.uuid4().hex[:8]}"
    await aborts.abort_later(request_id)  # never raises: the monitor takes it over
    assert request_id in aborts.pending()
    watcher = monitor.Monitor()
    with pytest.raises(redis.exceptions.ConnectionError):
        await watcher.beat()  # still unreachable: kept for the next round
    assert request_id in aborts.pending()
    assert not rclient.exists(keys.aborted(request_id))
    outage[0] = False
    await watcher.beat()
    assert rclient.exists(keys.aborted(request_id))  # the worker that holds it drops it
    assert aborts.pending() == {}


async def test_an_abort_that_failed_longer_ago_than_abort_retry_s_is_given_up(
        outage: list[bool], keys: Keys, rclient: redis.Redis):
    old, recent = f"old-{uuid.uuid4().hex[:8]}", f"new-{uuid.uuid4().hex[:8]}"
    await aborts.abort_later(old)
    await aborts.abort_later(recent)
    aborts.pending()[old] = time.monotonic() - aborts.ABORT_RETRY_S - 1
    outage[0] = False
    await aborts.retry_pending()
    assert not rclient.exists(keys.aborted(old))
    assert rclient.exists(keys.aborted(recent))
    assert aborts.pending() == {}
