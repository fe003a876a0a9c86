"""The web tier judges the workers' heartbeats against its own sight of Redis
(:mod:`inference.protocol.liveness`): the web monitor's sweep and the admission's count of live
workers (per event loop), and the Celery beat sweep (per Celery process, across its runs). A
Redis that hangs longer than a heartbeat TTL (``kill -STOP`` of a redis-server of the test's own)
or a sweep that did not run for as long makes every heartbeat stale at once: no judge takes that
for deaths, and a worker that really stopped is still reclaimed, within a bounded time.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
import uuid
from collections.abc import Iterator

import pytest
import redis

from benchmarks.harness.redis_server import PrivateRedis
from inference.protocol.keys import Keys
from inference.protocol.liveness import RedisSight, declares_dead
from inference.protocol.messages import RequestMessage
from inference.worker.fair_queue import FairQueue

TTL_S = 1.0


@pytest.fixture
def short_ttl(settings) -> float:
    settings.LLM_PLATFORM = {**settings.LLM_PLATFORM, "WORKER_HEARTBEAT_TTL_S": TTL_S}
    return TTL_S


def held_by(client: redis.Redis, keys: Keys, worker: str) -> str:
    """A request the worker ``worker`` took (its id): a reclaim puts it back in the queue."""
    message = RequestMessage(request_id=uuid.uuid4().hex, tenant="acme", fairness_key="acme",
                             prompt="hi")
    queue = FairQueue(client, keys, worker, "vtc")
    queue.enqueue(message)
    assert [q.request_id for q in queue.take(1)] == [message.request_id]
    return message.request_id


def reclaimed(client: redis.Redis, keys: Keys, worker: str, request_id: str) -> bool:
    """Whether ``worker`` was reclaimed: the request it took is no longer its own."""
    return not client.hexists(keys.fq("taken", worker), request_id)


def test_the_rule_declares_no_death_without_a_ttl_of_sight_nor_an_outage_for_deaths():
    assert not declares_dead(age_s=5, freshest_age_s=0, sight_s=9, ttl_s=10)  # fresh
    assert not declares_dead(age_s=60, freshest_age_s=0, sight_s=9, ttl_s=10)  # no sight
    assert declares_dead(age_s=60, freshest_age_s=0, sight_s=10, ttl_s=10)
    # Every heartbeat stale at once: an outage, unless the judge saw the whole silence, or at
    # least twice the TTL.
    assert not declares_dead(age_s=15, freshest_age_s=15, sight_s=12, ttl_s=10)
    assert declares_dead(age_s=15, freshest_age_s=15, sight_s=15, ttl_s=10)
    assert declares_dead(age_s=600, freshest_age_s=600, sight_s=20, ttl_s=10)


def test_a_sight_breaks_on_a_stretch_without_an_answer_and_a_failed_call():
    now = [0.0]
    sight = RedisSight(gap_s=1.0, clock=lambda: now[0])
    assert sight.seconds() == 0  # a process just started has none
    for _ in range(5):
        sight.answered()
        now[0] += 0.8
    assert sight.seconds() == pytest.approx(4.0)
    now[0] += 0.5  # no answer for 1.3 s: a call may be hanging
    assert sight.seconds() == 0
    sight.answered()  # it came back: the sight starts again
    assert sight.seconds() == 0
    now[0] += 0.5
    sight.answered()
    assert sight.seconds() == pytest.approx(0.5)
    sight.lost()
    assert sight.seconds() == 0


@pytest.mark.django_db
def test_the_celery_sweep_judges_against_its_own_sight_kept_across_its_runs(
        monkeypatch, short_ttl, rclient, keys):
    from gateway import tasks

    monkeypatch.setattr(tasks, "_sight", None)  # a Celery process just started
    held, mine = held_by(rclient, keys, "stale"), held_by(rclient, keys, "alive")
    rclient.zadd(keys.workers, {"alive": time.time(), "stale": time.time() - 60})
    tasks.sweep_queue()
    assert not reclaimed(rclient, keys, "stale", held)  # no sight yet: no death declared
    started = time.monotonic()
    while not reclaimed(rclient, keys, "stale", held):  # beat runs it every 0.2 s
        assert time.monotonic() - started < 10 * TTL_S
        rclient.zadd(keys.workers, {"alive": time.time()})
        time.sleep(0.2)
        tasks.sweep_queue()
    assert time.monotonic() - started >= TTL_S and rclient.hexists(keys.fq("wait"), held)
    # Its broker (Redis) hung: no run, and no worker could beat, for twice the TTL.
    time.sleep(2 * TTL_S)
    tasks.sweep_queue()  # the first run after: its sight broke
    assert rclient.zscore(keys.workers, "alive") and not reclaimed(rclient, keys, "alive", mine)


@pytest.fixture
def private_redis(tmp_path) -> Iterator[PrivateRedis]:
    server = PrivateRedis(tmp_path, tmp_path / "redis.log", "none")
    server.start()
    yield server
    server.proc.send_signal(signal.SIGCONT)  # (if a test stopped it there)
    server.kill(signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.process
def test_the_web_monitor_and_the_admission_take_a_hung_redis_for_no_worker_death(
        private_redis, settings, short_ttl, keys):
    from gateway import monitor, workers

    client = redis.Redis.from_url(private_redis.url)
    beating, stopped = threading.Event(), threading.Event()
    beating.set()

    def beat() -> None:  # a live worker's heartbeat, every 0.1 s while it can
        beater = redis.Redis.from_url(private_redis.url)
        while not stopped.is_set():
            if beating.is_set():
                beater.zadd(keys.workers, {"alive": time.time()})
            time.sleep(0.1)

    threading.Thread(target=beat, daemon=True).start()
    held = held_by(client, keys, "alive")

    async def scenario() -> tuple[list[str], bool, bool]:
        await monitor.ensure_started()
        await asyncio.sleep(TTL_S + 1)  # the monitor's sight of Redis covers a TTL
        beating.clear()  # Redis hangs: no process beats, the monitor's round hangs too
        private_redis.proc.send_signal(signal.SIGSTOP)
        await asyncio.sleep(3 * TTL_S)
        private_redis.proc.send_signal(signal.SIGCONT)
        # Right after: the worker has not beaten yet, and is not taken for gone.
        alive = await workers.alive_workers()
        await asyncio.sleep(0.5)
        beating.set()
        await asyncio.sleep(TTL_S)
        survived = not reclaimed(client, keys, "alive", held)
        # A worker that really stops is reclaimed by the monitor, within a bounded time.
        stopped.set()
        deadline = time.monotonic() + 4 * TTL_S + 2
        while not reclaimed(client, keys, "alive", held) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        return alive, survived, reclaimed(client, keys, "alive", held)

    shared = settings.REDIS_URL
    settings.REDIS_URL = private_redis.url
    try:
        alive, survived, reclaimed_at_last = asyncio.run(scenario())
    finally:
        stopped.set()
        settings.REDIS_URL = shared  # the shared Redis, for the fixtures' cleanup
    assert alive == ["alive"]  # admission would not answer 503 no_worker_available
    assert survived, "a live worker was reclaimed after a Redis hang"
    assert reclaimed_at_last and client.hexists(keys.fq("wait"), held)
