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


def test_a_reclaim_sent_as_redis_stops_declares_no_death_when_it_runs_after(private_redis,
                                                                             keys):
    """A judge measured a long sight of Redis and sent its reclaim just as Redis stopped: the
    script runs when Redis goes on, every heartbeat older than the TTL by then. The sight it
    carries is of before the outage, so it declares nobody dead (a worker whose call had hung
    that way reclaimed every other worker at once)."""
    client = redis.Redis.from_url(private_redis.url)
    client.zadd(keys.workers, {"other": time.time()})
    judge = FairQueue(redis.Redis.from_url(private_redis.url), keys, "judge", "vtc")
    replies: list = []
    private_redis.proc.send_signal(signal.SIGSTOP)
    try:
        call = threading.Thread(target=lambda: replies.append(
            judge.reclaim(ttl_s=TTL_S, events_ttl_s=60, sight_s=1e6)), daemon=True)
        call.start()
        time.sleep(OUTAGE_S)  # "other" beats no more: Redis is stopped
    finally:
        private_redis.proc.send_signal(signal.SIGCONT)
    call.join(timeout=10)
    assert replies == [(0, [], [])]
    assert client.zscore(keys.workers, "other") is not None
    # Measured now, the same sight declares the silent worker dead (it beat no more after).
    assert judge.reclaim(ttl_s=TTL_S, events_ttl_s=60, sight_s=1e6)[1] == ["other"]


def test_a_web_process_judged_across_a_redis_stop_is_not_taken_for_gone(private_redis, keys):
    """The worker's judge of web processes: its sight measured, its calls sent as Redis stopped
    and answered after, every web heartbeat stale by then: the web process stays alive."""
    from inference.worker.live import WorkerState
    from inference.worker.origins import WebOrigins

    client = redis.Redis.from_url(private_redis.url)
    client.zadd(keys.web, {"web-1": time.time()})
    state = WorkerState(sight_gap_s=TTL_S / 2)
    clock = [0.0]
    state.sight = type(state.sight)(TTL_S / 2, clock=lambda: clock[0])
    for step in range(41):  # an unbroken sight of 10 TTLs up to now
        clock[0] = step * TTL_S / 4
        state.sight.answered()
    origins = WebOrigins(state, redis.Redis.from_url(private_redis.url), keys, TTL_S)
    answers: list[bool] = []
    private_redis.proc.send_signal(signal.SIGSTOP)
    try:
        call = threading.Thread(target=lambda: answers.append(origins.alive("web-1")),
                                daemon=True)
        call.start()
        time.sleep(OUTAGE_S)
    finally:
        private_redis.proc.send_signal(signal.SIGCONT)
    call.join(timeout=10)
    assert answers == [True]
    # Asked now, with the same sight, the web process that beat no more is gone.
    assert origins.alive("web-1") is False
