"""Faults a worker rides out, on a real Redis of the test's own (killed and restarted here) and an
in-process worker running the worker process's own loop (``inference.worker.main.serve``).

Each test is a fault an operator met: Redis restarting under a generation, an abort sent while
the worker's pub/sub connection was down, a web process that died mid-stream, a reply lost after
Redis ran a take, a worker told to stop while it serves.
"""

from __future__ import annotations

import json
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from benchmarks.harness.redis_server import PrivateRedis
from inference.protocol.events import FinalEvent, TokenEvent
from inference.protocol.keys import Keys, queue_script
from inference.protocol.messages import RequestMessage
from inference.worker.fair_queue import FairQueue
from inference.worker.main import beat_while_loading
from tests.support.e2e import wait_for
from tests.support.platform import InProcessWorker

pytestmark = pytest.mark.slow


def own_redis(tmp_path, persistence: str) -> Iterator[PrivateRedis]:
    """A redis-server of the test's own (killed at its end)."""
    server = PrivateRedis(tmp_path, tmp_path / "redis.log", persistence)
    server.start()
    yield server
    server.kill(signal.SIGKILL)


@pytest.fixture
def private_redis(tmp_path) -> Iterator[PrivateRedis]:
    """A redis-server of this test's own, with every write on disk before it is answered."""
    yield from own_redis(tmp_path, "aof")


@pytest.fixture
def keys() -> Keys:
    return Keys(f"faults-{uuid.uuid4().hex[:8]}")


def request(max_tokens: int, **fields: Any) -> RequestMessage:
    return RequestMessage(request_id=uuid.uuid4().hex, tenant="acme", fairness_key="acme",
                          prompt="once upon a time",
                          sampling={"max_tokens": max_tokens, "ignore_eos": True}, **fields)


def stream(client: redis.Redis, keys: Keys, request_id: str) -> list[dict]:
    return [json.loads(f[b"data"]) for _, f in client.xrange(keys.events(request_id))]


def final_of(client: redis.Redis, keys: Keys, request_id: str) -> FinalEvent | None:
    events = stream(client, keys, request_id)
    if events and events[-1]["type"] == "final":
        return FinalEvent.model_validate(events[-1])
    return None


def assert_one_run(events: list[dict]) -> None:
    """Tokens 0..n-1 once each, in order, then exactly one final event."""
    seqs = [e["seq"] for e in events if e["type"] == "token"]
    assert seqs == list(range(len(seqs))), f"tokens lost or doubled: {seqs}"
    assert [e["type"] for e in events].count("final") == 1 and events[-1]["type"] == "final"


def worker_on(server: PrivateRedis, keys: Keys, **settings: Any) -> InProcessWorker:
    defaults = dict(max_model_len=1024, max_batch_size=4, reference_step_delay_s=0.02)
    return InProcessWorker(keys.prefix, server.url, **{**defaults, **settings}).start()


def streaming(client: redis.Redis, keys: Keys, max_tokens: int) -> RequestMessage:
    """A request queued and streaming: its first 10 events are in Redis."""
    message = request(max_tokens)
    FairQueue(client, keys, "tool", "vtc").enqueue(message)
    assert wait_for(lambda: client.xlen(keys.events(message.request_id)) >= 10, 10)
    return message


def served_once(client: redis.Redis, keys: Keys, message: RequestMessage) -> FinalEvent:
    """Wait for the request's end: every token once, in order, then one final event."""
    assert wait_for(lambda: final_of(client, keys, message.request_id), 20)
    events = stream(client, keys, message.request_id)
    assert_one_run(events)
    assert len(events) == message.sampling.max_tokens + 1
    return FinalEvent.model_validate(events[-1])


def gate1(client: redis.Redis, keys: Keys) -> int:
    return int(client.eval(queue_script("gate1"), 0, keys.prefix))


def test_a_redis_restart_mid_generation_loses_and_doubles_no_token(private_redis, keys):
    worker = worker_on(private_redis, keys)
    client = redis.Redis.from_url(private_redis.url)
    try:
        message = streaming(client, keys, 150)
        private_redis.kill(signal.SIGKILL)  # Redis dies mid-stream ...
        time.sleep(0.8)  # ... the engine goes on generating meanwhile ...
        private_redis.start()  # ... and it is back, with its data
        end = served_once(client, keys, message)
        assert end.finish_reason == "length" and end.usage.completion_tokens == 150
        # The worker lives on and serves the next request.
        after = request(5)
        FairQueue(client, keys, "tool", "vtc").enqueue(after)
        assert wait_for(lambda: final_of(client, keys, after.request_id), 10)
        assert gate1(client, keys) == 0
        assert client.hlen(keys.usage_pending) == 2  # both ended, each once in the ledger
    finally:
        worker.stop()


def test_a_redis_that_stalls_writes_never_stalls_the_engine(private_redis, keys):
    worker = worker_on(private_redis, keys)
    client = redis.Redis.from_url(private_redis.url)
    try:
        message = streaming(client, keys, 200)
        client.client_pause(1500, all=False)  # every write (the events' script) waits 1.5 s
        written = client.xlen(keys.events(message.request_id))
        generated = worker.engine.stats()["tokens_generated"]
        time.sleep(1.0)
        # Nothing reached Redis, yet the engine went on: 50 ticks a second, less a tick or two.
        assert client.xlen(keys.events(message.request_id)) == written
        assert worker.engine.stats()["tokens_generated"] - generated >= 25
        served_once(client, keys, message)  # the writes held back went out once each, in order
        assert gate1(client, keys) == 0
        assert client.hlen(keys.usage_pending) == 1
    finally:
        worker.stop()


def test_a_failed_event_write_loses_no_event_and_keeps_the_publisher_writing(private_redis, keys):
    worker = worker_on(private_redis, keys)
    client = redis.Redis.from_url(private_redis.url)
    write, failures = worker.bridge.queue.write_events, []

    def flaky(*args, **kwargs):  # a write that fails other than on Redis, three times
        if len(failures) < 3:
            failures.append(1)
            raise ValueError("an unexpected write failure")
        return write(*args, **kwargs)

    try:
        message = streaming(client, keys, 60)
        worker.bridge.queue.write_events = flaky
        served_once(client, keys, message)  # the events of the failed writes went out later
        assert len(failures) == 3
    finally:
        worker.stop()


def test_a_worker_loading_its_model_beats_so_a_restart_refuses_nothing(private_redis, keys):
    # Loading and calibrating took 26 s on a loaded 2-core machine, past the heartbeat TTL: the
    # web tier then saw no worker alive and refused requests. The new process beats meanwhile.
    client = redis.Redis.from_url(private_redis.url)
    loaded = threading.Event()
    beat = threading.Thread(target=beat_while_loading,
                            args=(client, keys, "w-new", 0.05, loaded))
    beat.start()
    scores = []
    for _ in range(6):
        time.sleep(0.1)
        scores.append(client.zscore(keys.workers, "w-new"))
    assert None not in scores and scores == sorted(scores) and scores[-1] > scores[0]
    assert time.time() - scores[-1] < 0.5  # what the web tier's alive_workers() reads
    loaded.set()
    beat.join(2)
    assert not beat.is_alive()
    last = client.zscore(keys.workers, "w-new")
    time.sleep(0.3)
    assert client.zscore(keys.workers, "w-new") == last  # serve() beats from here on


def test_an_abort_published_while_the_worker_did_not_listen_still_stops_it(private_redis,
                                                                          keys):
    worker = worker_on(private_redis, keys)
    client = redis.Redis.from_url(private_redis.url)
    try:
        message = request(1000)
        FairQueue(client, keys, "tool", "vtc").enqueue(message)
        assert wait_for(lambda: client.xlen(keys.events(message.request_id)) >= 3, 10)
        client.set(keys.aborted(message.request_id), 1)  # the mark, without a pub/sub message
        end = wait_for(lambda: final_of(client, keys, message.request_id), 5)
        assert end and end.finish_reason == "abort"
        assert end.usage.completion_tokens < 200
    finally:
        worker.stop()


def test_a_stop_waiting_for_a_slow_tick_is_ordered_at_each_audit_but_logged_once(
        private_redis, keys, caplog):
    # A tick slower than a heartbeat: the abort ordered at one audit has not taken effect by the
    # next, which orders it again; the worker's log said so at every heartbeat.
    worker = worker_on(private_redis, keys)
    client = redis.Redis.from_url(private_redis.url)
    engine = worker.bridge.engine
    real_abort, ordered = engine.abort, []
    try:
        message = request(1000)
        FairQueue(client, keys, "tool", "vtc").enqueue(message)
        assert wait_for(lambda: client.xlen(keys.events(message.request_id)) >= 3, 10)
        engine.abort = ordered.append  # the stop is not carried out yet: the tick is slow
        client.set(keys.aborted(message.request_id), 1)
        with caplog.at_level("INFO", logger="inference.worker.recovery"):
            for _ in range(3):
                worker.bridge.audit()
        assert ordered.count(message.request_id) >= 3
        logged = [r for r in caplog.records if "has an abort mark" in r.getMessage()]
        assert len(logged) == 1
        engine.abort = real_abort  # the tick ends: the next audit's order takes effect
        end = wait_for(lambda: final_of(client, keys, message.request_id), 5)
        assert end and end.finish_reason == "abort"
    finally:
        engine.abort = real_abort
        worker.stop()


def test_a_generation_stops_when_the_web_process_streaming_it_dies(private_redis, keys):
    worker = worker_on(private_redis, keys, web_ttl_s=1)
    client = redis.Redis.from_url(private_redis.url)
    try:
        client.zadd(keys.web, {"web-1": time.time()})
        message = request(1000, origin="web-1")
        FairQueue(client, keys, "tool", "vtc").enqueue(message)
        assert wait_for(lambda: client.xlen(keys.events(message.request_id)) >= 3, 10)
        # web-1 stops beating (killed): within its TTL and a heartbeat, the answer stops.
        end = wait_for(lambda: final_of(client, keys, message.request_id), 5)
        assert end and end.finish_reason == "abort"
        events = stream(client, keys, message.request_id)
        assert_one_run(events)
        assert end.usage.completion_tokens == len(events) - 1 < 300  # billed what it streamed
        # A request of a dead web process still waiting is not even started.
        queued = request(1000, origin="web-1")
        FairQueue(client, keys, "tool", "vtc").enqueue(queued)
        end = wait_for(lambda: final_of(client, keys, queued.request_id), 5)
        assert end and end.finish_reason == "abort" and end.usage.completion_tokens == 0
    finally:
        worker.stop()


def test_a_request_taken_whose_reply_was_lost_goes_back_and_is_served(private_redis, keys):
    worker = worker_on(private_redis, keys)
    client = redis.Redis.from_url(private_redis.url)
    message = request(5)
    poll = worker.bridge.poll
    worker.bridge.poll = lambda block_ms=50: time.sleep(block_ms / 1000) or 0  # takes nothing
    try:
        # Redis ran the worker's take, but the worker never saw the reply: it holds nothing,
        # while the queue says it took the request (and counts it in gate 1).
        stray = FairQueue(client, keys, worker.bridge.worker_id, "vtc")
        stray.enqueue(message)
        assert [q.request_id for q in stray.take(1)] == [message.request_id]
        # Its next audit hands it back to the queue ...
        assert wait_for(lambda: client.hexists(keys.fq("wait"), message.request_id), 5)
        assert gate1(client, keys) == 1
        worker.bridge.poll = poll  # ... where it is taken for real and served.
        end = wait_for(lambda: final_of(client, keys, message.request_id), 10)
        assert end and end.finish_reason == "length" and end.usage.completion_tokens == 5
        assert_one_run(stream(client, keys, message.request_id))
        assert wait_for(lambda: gate1(client, keys) == 0, 5)
    finally:
        worker.bridge.poll = poll
        worker.stop()


def test_a_worker_restarted_under_the_same_id_ends_what_the_dead_one_left(private_redis, keys):
    client = redis.Redis.from_url(private_redis.url)
    queue = FairQueue(client, keys, "w-fixed", "vtc")
    running, taken = request(50), request(50)
    queue.enqueue(running)
    queue.enqueue(taken)
    first, _ = queue.take(2)  # the dead process took both and was streaming the first
    queue.write_events([(TokenEvent(request_id=running.request_id, seq=0, token_id=97,
                                    text="a"), first.take)], 60)
    client.zadd(keys.workers, {"w-fixed": time.time()})  # its heartbeat is still fresh
    worker = InProcessWorker(keys.prefix, private_redis.url, worker_id="w-fixed",
                             max_model_len=1024).start()
    try:
        end = final_of(client, keys, running.request_id)
        assert end and end.error.code == "worker_lost" and end.usage.completion_tokens == 1
        served = wait_for(lambda: final_of(client, keys, taken.request_id), 10)
        assert served and served.finish_reason == "length"
        assert served.usage.completion_tokens == 50
    finally:
        worker.stop()


def test_a_stopping_worker_hands_back_what_waits_and_finishes_what_runs(private_redis, keys):
    worker = worker_on(private_redis, keys, max_batch_size=1, prefetch=1, drain_s=10)
    client = redis.Redis.from_url(private_redis.url)
    queue = FairQueue(client, keys, "tool", "vtc")
    running, waiting = request(40), request(40)
    queue.enqueue(running)
    assert wait_for(lambda: client.xlen(keys.events(running.request_id)) >= 1, 10)
    queue.enqueue(waiting)
    assert wait_for(lambda: worker.engine.num_queued() == 1, 5)  # in its engine, not started
    worker.stop(timeout_s=15)  # SIGTERM: drain
    end = final_of(client, keys, running.request_id)
    assert end and end.finish_reason == "length" and end.usage.completion_tokens == 40
    # The waiting one is back in the shared queue, for another worker, with no event.
    assert client.hexists(keys.fq("wait"), waiting.request_id)
    assert client.xlen(keys.events(waiting.request_id)) == 0
    assert gate1(client, keys) == 1
    # Its heartbeat ages out instead of vanishing: requests keep queueing for the next worker.
    assert client.zscore(keys.workers, worker.bridge.worker_id)
    assert not client.exists(keys.stats(worker.bridge.worker_id))


@pytest.fixture
def volatile_redis(tmp_path) -> Iterator[PrivateRedis]:
    """A redis-server of this test's own that keeps nothing across a restart."""
    yield from own_redis(tmp_path, "none")


def test_redis_losing_its_data_stops_the_workers_requests_and_bills_what_they_computed(
        volatile_redis, keys):
    worker = worker_on(volatile_redis, keys)
    client = redis.Redis.from_url(volatile_redis.url)
    try:
        message = request(1000)
        FairQueue(client, keys, "tool", "vtc").enqueue(message)
        assert wait_for(lambda: client.xlen(keys.events(message.request_id)) >= 5, 10)
        volatile_redis.kill(signal.SIGKILL)
        volatile_redis.start()  # empty: the queue, the streams and the epoch are gone
        entry = wait_for(lambda: client.hget(keys.usage_pending, message.request_id), 10)
        assert entry, "the lost request was never billed"
        end = FinalEvent.model_validate_json(json.loads(entry)["final"])
        assert end.error.code == "state_lost" and end.error.retryable
        assert 5 <= end.usage.completion_tokens < 1000
        after = request(5)  # the worker registered again and serves
        FairQueue(client, keys, "tool", "vtc").enqueue(after)
        served = wait_for(lambda: final_of(client, keys, after.request_id), 10)
        assert served and served.usage.completion_tokens == 5
    finally:
        worker.stop()


@pytest.mark.django_db
def test_a_reader_whose_request_redis_lost_ends_with_a_retryable_error(volatile_redis,
                                                                       settings, keys):
    import asyncio

    from gateway import monitor
    from gateway.errors import APIError
    from gateway.events import events

    settings.LLM_PLATFORM = {**settings.LLM_PLATFORM, "REDIS_PREFIX": keys.prefix}
    client = redis.Redis.from_url(volatile_redis.url)
    client.set(keys.epoch, "before")

    async def read() -> tuple[float, APIError]:
        await monitor.ensure_started()
        reader = events("some-request", idle_timeout_s=300, epoch="before")
        pending = asyncio.ensure_future(anext(reader))
        await asyncio.sleep(0.5)
        volatile_redis.kill(signal.SIGKILL)
        volatile_redis.start()
        started = time.monotonic()
        try:
            await pending
        except APIError as exc:
            return time.monotonic() - started, exc
        raise AssertionError("the reader got an event")

    shared = settings.REDIS_URL
    settings.REDIS_URL = volatile_redis.url
    try:
        waited, error = asyncio.run(read())
    finally:
        settings.REDIS_URL = shared  # the shared Redis, for the fixtures' cleanup
    assert error.status == 503 and error.code == "service_unavailable"
    assert error.retry_after_s and "lost this request" in error.message
    assert waited < 5  # not REQUEST_IDLE_TIMEOUT_S


@pytest.mark.django_db
def test_a_draining_web_process_refuses_new_requests_on_open_connections(
        make_tenant, live_worker, client):
    from gateway import monitor

    _, _, raw = make_tenant()
    monitor.DRAINING.set()
    try:
        reply = client.post("/v1/completions", content_type="application/json",
                            HTTP_AUTHORIZATION=f"Bearer {raw}",
                            data={"model": "SmolLM2-135M-Instruct", "prompt": "hi",
                                  "max_tokens": 3})
        ready = client.get("/readyz")
    finally:
        monitor.DRAINING.clear()
    assert reply.status_code == 503 and reply["Retry-After"]
    assert reply.json()["error"]["code"] == "service_unavailable"
    assert ready.status_code == 503 and "draining" in ready.json()["checks"]["web"]
