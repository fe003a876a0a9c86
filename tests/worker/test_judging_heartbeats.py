"""A worker judges other processes' heartbeats against its own sight of Redis: a Redis that hangs
(``kill -STOP`` of a redis-server of the test's own) longer than a heartbeat TTL makes every
heartbeat stale at once, and the worker, resumed with it, must take none of them for a death.

The worker here is in-process (``inference.worker.main.serve``, as the worker process runs it);
the other processes are heartbeats beaten by the test, which pauses them as the outage would.
"""

from __future__ import annotations

import signal
import threading
import time
import uuid
from collections.abc import Iterator

import pytest
import redis

from benchmarks.harness.redis_server import PrivateRedis
from inference.protocol.keys import Keys
from inference.protocol.messages import RequestMessage
from inference.worker.fair_queue import FairQueue
from tests.support.e2e import wait_for
from tests.support.platform import InProcessWorker

pytestmark = [pytest.mark.slow, pytest.mark.process]

TTL_S = 2.0
OUTAGE_S = 1.5 * TTL_S


@pytest.fixture
def private_redis(tmp_path) -> Iterator[PrivateRedis]:
    server = PrivateRedis(tmp_path, tmp_path / "redis.log", "none")
    server.start()
    yield server
    server.proc.send_signal(signal.SIGCONT)  # (if a test stopped it there)
    server.kill(signal.SIGKILL)


@pytest.fixture
def keys() -> Keys:
    return Keys(f"judging-{uuid.uuid4().hex[:8]}")


class Beater:
    """A process's heartbeat in the sorted set ``key``, every 0.1 s while :attr:`beating`."""

    def __init__(self, url: str, key: str, member: str):
        self.client = redis.Redis.from_url(url)
        self.key, self.member = key, member
        self.beating = threading.Event()
        self.beating.set()
        self.stopped = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopped:
            if self.beating.is_set():
                self.client.zadd(self.key, {self.member: time.time()})
            time.sleep(0.1)


def hang_redis(server: PrivateRedis, *beaters: Beater, back_after_s: float = 0.5) -> None:
    """Redis hangs for OUTAGE_S (longer than the TTL); the other processes beat again
    ``back_after_s`` after it answers (they were behind it too)."""
    for beater in beaters:
        beater.beating.clear()
    server.proc.send_signal(signal.SIGSTOP)
    time.sleep(OUTAGE_S)
    server.proc.send_signal(signal.SIGCONT)
    time.sleep(back_after_s)
    for beater in beaters:
        beater.beating.set()


def worker_on(server: PrivateRedis, keys: Keys, **settings) -> InProcessWorker:
    return InProcessWorker(keys.prefix, server.url, heartbeat_ttl_s=TTL_S, web_ttl_s=TTL_S,
                           max_model_len=2048, reference_step_delay_s=0.01,
                           **settings).start()


def test_a_worker_resumed_with_a_hung_redis_reclaims_no_live_worker(private_redis, keys):
    client = redis.Redis.from_url(private_redis.url)
    other = Beater(private_redis.url, keys.workers, "other")
    held = RequestMessage(request_id=uuid.uuid4().hex, tenant="acme", fairness_key="acme",
                          prompt="hi")
    queue = FairQueue(client, keys, "other", "vtc")
    queue.enqueue(held)
    assert [q.request_id for q in queue.take(1)] == [held.request_id]  # the other worker's
    worker = worker_on(private_redis, keys)
    try:
        time.sleep(TTL_S + 0.5)  # the worker's sight of Redis covers a TTL: it judges
        hang_redis(private_redis, other)
        time.sleep(TTL_S / 2)
        # The other worker beat late after the outage, and was never taken for dead.
        assert client.zscore(keys.workers, "other")
        assert client.hexists(keys.fq("taken", "other"), held.request_id)
        assert not client.exists(keys.fq("reclaimed", "other"))
        # A worker that really stops beating is still reclaimed, within a bounded time.
        other.stopped = True
        assert wait_for(lambda: client.hexists(keys.fq("wait"), held.request_id)
                        or client.exists(keys.events(held.request_id)), 4 * TTL_S)
        assert client.exists(keys.fq("reclaimed", "other"))
    finally:
        other.stopped = True
        worker.stop()


def test_a_worker_resumed_with_a_hung_redis_stops_no_answer_of_a_live_web_process(
        private_redis, keys):
    client = redis.Redis.from_url(private_redis.url)
    web = Beater(private_redis.url, keys.web, "web-1")
    worker = worker_on(private_redis, keys)
    message = RequestMessage(request_id=uuid.uuid4().hex, tenant="acme", fairness_key="acme",
                             prompt="once upon a time", origin="web-1",
                             sampling={"max_tokens": 800, "ignore_eos": True})
    try:
        FairQueue(client, keys, "tool", "vtc").enqueue(message)
        assert wait_for(lambda: client.xlen(keys.events(message.request_id)) >= 5, 10)
        time.sleep(TTL_S)  # the worker's sight of Redis covers a TTL: it judges
        hang_redis(private_redis, web)
        last = wait_for(lambda: client.hexists(keys.usage_pending, message.request_id), 30)
        assert last, "the answer did not end"
        events = [e for _, e in client.xrange(keys.events(message.request_id))]
        assert len(events) == 801  # every token, then its end: not stopped as an orphan
        assert b'"finish_reason":"length"' in events[-1][b"data"]
    finally:
        web.stopped = True
        worker.stop()
