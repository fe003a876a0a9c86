"""The web tier's event reader (gateway/event_reader.py): one ``XREAD`` at a time reads the event
streams of all the requests of an event loop; on a real Redis (the shared one, or a redis-server
of the test's own where the test kills it or counts its commands)."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
import redis
import redis.asyncio as aioredis

from benchmarks.harness.redis_server import PrivateRedis
from gateway import event_reader
from gateway.errors import APIError
from gateway.events import Waiting, events
from inference.protocol.events import FinalEvent, FinishReason, TokenEvent, encode_event
from inference.protocol.keys import Keys

pytestmark = pytest.mark.anyio


def token(request_id: str, seq: int) -> TokenEvent:
    return TokenEvent(request_id=request_id, seq=seq, token_id=1, text=f"{seq} ")


def final(request_id: str, seq: int) -> FinalEvent:
    return FinalEvent(request_id=request_id, seq=seq, finish_reason=FinishReason.LENGTH)


async def collect(request_id: str, **options) -> tuple[list[int], int]:
    """The seqs of the request's events up to its final, and how many Waiting came."""
    seqs, waits = [], 0
    async for event in events(request_id, options.pop("idle_timeout_s", 30), **options):
        if isinstance(event, Waiting):
            waits += 1
            continue
        assert event.request_id == request_id, "another request's event"
        seqs.append(event.seq)
    return seqs, waits


async def tick(client: aioredis.Redis, keys: Keys, request_ids: list[str], seq: int, *,
               last: bool = False) -> None:
    """One worker tick: an event for each request, in one pipeline."""
    pipe = client.pipeline(transaction=False)
    for request_id in request_ids:
        event = final(request_id, seq) if last else token(request_id, seq)
        pipe.xadd(keys.events(request_id), encode_event(event))
    await pipe.execute()


async def run_ticks(client: aioredis.Redis, keys: Keys, request_ids: list[str], start: int,
                    stop: int, every_s: float = 0.01, *, end: bool = False) -> None:
    for seq in range(start, stop):
        await tick(client, keys, request_ids, seq)
        await asyncio.sleep(every_s)
    if end:
        await tick(client, keys, request_ids, stop, last=True)


def new_ids(n: int) -> list[str]:
    return [uuid.uuid4().hex for _ in range(n)]


async def until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


@pytest.fixture
async def writer(settings) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(settings.REDIS_URL)
    yield client
    await client.aclose()


def own_redis(tmp_path, settings, persistence: str) -> Iterator[PrivateRedis]:
    """A redis-server of the test's own, the web tier's Redis for the test's duration."""
    server = PrivateRedis(tmp_path, tmp_path / "redis.log", persistence)
    server.start()
    shared = settings.REDIS_URL
    settings.REDIS_URL = server.url
    yield server
    settings.REDIS_URL = shared  # the shared Redis, for the fixtures' cleanup
    server.kill(signal.SIGKILL)


@pytest.fixture
def durable_redis(tmp_path, settings) -> Iterator[PrivateRedis]:
    """Every write on disk before it is answered: a restart keeps the streams."""
    yield from own_redis(tmp_path, settings, "aof")


@pytest.fixture
def quiet_redis(tmp_path, settings) -> Iterator[PrivateRedis]:
    """Only this test's commands: its command counts are the test's."""
    yield from own_redis(tmp_path, settings, "none")


async def test_many_streams_each_get_their_own_events_in_order_once(keys, writer):
    ids = new_ids(50)
    await tick(writer, keys, ids[:25], 0)  # half of them have an event before they are read
    await tick(writer, keys, ids[25:], 0)
    readers = [asyncio.ensure_future(collect(request_id)) for request_id in ids]
    await run_ticks(writer, keys, ids, 1, 20, end=True)
    results = await asyncio.wait_for(asyncio.gather(*readers), 30)
    assert [seqs for seqs, _ in results] == [list(range(21))] * 50
    assert event_reader.current().streams() == set()  # every subscription ended with its final


async def test_more_streams_than_one_read_names_are_all_read(keys, writer, monkeypatch):
    monkeypatch.setattr(event_reader, "MAX_KEYS_PER_READ", 4)
    ids = new_ids(10)
    readers = [asyncio.ensure_future(collect(request_id)) for request_id in ids]
    await run_ticks(writer, keys, ids, 0, 10, end=True)
    results = await asyncio.wait_for(asyncio.gather(*readers), 30)
    assert [seqs for seqs, _ in results] == [list(range(11))] * 10


async def test_a_stream_subscribed_while_the_reader_blocks_is_read_at_once(keys, writer):
    quiet = asyncio.ensure_future(collect(uuid.uuid4().hex))  # keeps the reader in its block
    reader = event_reader.current()
    try:
        for _ in range(3):
            await until(lambda: reader._sent_at is not None)
            await asyncio.sleep(0.05)  # well inside the reader's 1 s block
            request_id = uuid.uuid4().hex
            await tick(writer, keys, [request_id], 0, last=True)
            started = time.monotonic()
            stream = events(request_id, 30)
            first = await anext(stream)
            # Not after the block in flight ends: the new subscription woke the reader.
            assert time.monotonic() - started < 0.5
            assert first.request_id == request_id and first.type == "final"
            await stream.aclose()
    finally:
        quiet.cancel()


async def test_a_cancelled_or_closed_reader_leaves_the_others_alone(keys, writer):
    ids = new_ids(4)
    readers = [asyncio.ensure_future(collect(request_id)) for request_id in ids]
    await run_ticks(writer, keys, ids, 0, 3)
    reader = event_reader.current()
    await until(lambda: reader.streams() == {keys.events(i) for i in ids})
    readers[0].cancel()  # a client disconnect
    with pytest.raises(asyncio.CancelledError):
        await readers[0]
    assert keys.events(ids[0]) not in reader.streams()
    closed = events(ids[1], 30)  # a second reader of a stream
    assert (await anext(closed)).seq == 0
    assert len(reader._subs[keys.events(ids[1]).encode()]) == 2
    await closed.aclose()
    assert len(reader._subs[keys.events(ids[1]).encode()]) == 1  # its collect() reads it still
    await run_ticks(writer, keys, ids, 3, 8, end=True)
    results = await asyncio.wait_for(asyncio.gather(*readers[1:]), 30)
    assert [seqs for seqs, _ in results] == [list(range(9))] * 3
    assert reader.streams() == set()


async def test_a_lagging_subscription_is_read_again_once_it_catches_up(keys, writer,
                                                                        monkeypatch):
    monkeypatch.setattr(event_reader, "MAX_BACKLOG", 3)
    request_id = uuid.uuid4().hex
    subscription = event_reader.subscribe(keys.events(request_id))
    try:
        await run_ticks(writer, keys, [request_id], 0, 8, every_s=0)
        await until(lambda: subscription.skipped)
        lag = subscription.backlog
        await asyncio.sleep(0.1)
        assert 3 <= lag < 8 and subscription.backlog == lag  # not read while its taker lags
        seqs = []
        while len(seqs) < 8:
            started = time.monotonic()
            entries = await subscription.read(1)  # taken: its stream is read again at once
            assert entries and time.monotonic() - started < 0.5
            seqs += [TokenEvent.model_validate_json(fields[b"data"]).seq for _, fields in entries]
        assert seqs == list(range(8))
    finally:
        subscription.close()
    assert event_reader.current().streams() == set()


async def test_a_killed_reader_connection_loses_and_repeats_nothing(keys, writer, rclient):
    ids = new_ids(5)
    readers = [asyncio.ensure_future(collect(request_id)) for request_id in ids]
    await run_ticks(writer, keys, ids, 0, 5)
    name = event_reader.current().client_name
    [mine] = [c for c in rclient.client_list() if c["name"] == name]
    assert rclient.client_kill_filter(_id=mine["id"]) == 1
    await run_ticks(writer, keys, ids, 5, 10, end=True)
    results = await asyncio.wait_for(asyncio.gather(*readers), 30)
    assert [seqs for seqs, _ in results] == [list(range(11))] * 5
    assert [c for c in rclient.client_list() if c["name"] == name]  # reconnected


async def test_a_reader_that_dies_is_restarted_and_loses_nothing(keys, writer, monkeypatch,
                                                                 caplog):
    ids = new_ids(3)
    readers = [asyncio.ensure_future(collect(request_id)) for request_id in ids]
    await run_ticks(writer, keys, ids, 0, 3)
    real = event_reader.EventReader._dispatch
    broken = {"once": True}

    def dispatch_once_broken(self, reads, replies):
        if broken.pop("once", False):
            raise RuntimeError("a bug")
        real(self, reads, replies)

    monkeypatch.setattr(event_reader.EventReader, "_dispatch", dispatch_once_broken)
    with caplog.at_level(logging.ERROR, logger="gateway.event_reader"):
        await run_ticks(writer, keys, ids, 3, 8, end=True)
        results = await asyncio.wait_for(asyncio.gather(*readers), 30)
    assert not broken, "the reader never met the bug"
    assert [seqs for seqs, _ in results] == [list(range(9))] * 3
    assert any("event reader failed" in r.getMessage() for r in caplog.records)


async def test_the_reads_of_many_streams_are_few(keys, quiet_redis, settings):
    ids = new_ids(20)
    async with aioredis.Redis.from_url(settings.REDIS_URL) as writer:
        before = xread_calls(await writer.info("commandstats"))
        readers = [asyncio.ensure_future(collect(request_id)) for request_id in ids]
        await run_ticks(writer, keys, ids, 0, 30, every_s=0.02, end=True)
        results = await asyncio.wait_for(asyncio.gather(*readers), 30)
        reads = xread_calls(await writer.info("commandstats")) - before
        await asyncio.sleep(1.5)  # no stream left: the reader idles without reading
        idle_reads = xread_calls(await writer.info("commandstats")) - before - reads
    assert [seqs for seqs, _ in results] == [list(range(31))] * 20
    written = 20 * 31
    assert reads < written / 4, f"{reads} XREAD for {written} events"
    assert idle_reads <= 1  # at most the read in flight when the last stream ended


def xread_calls(stats: dict) -> int:
    return int(stats.get("cmdstat_xread", {}).get("calls", 0))


@pytest.mark.slow
async def test_a_redis_outage_is_seen_by_every_stream_and_loses_nothing(keys, durable_redis,
                                                                        settings):
    ids = new_ids(3)
    # Events come every 10 ms but during the outage: a Waiting comes only then.
    readers = [asyncio.ensure_future(collect(request_id, keepalive_s=0.5,
                                             outage_tolerance_s=60))
               for request_id in ids]
    probe = event_reader.subscribe(keys.events("probe"))
    errors: list[Exception] = []

    async def watch() -> None:
        while True:
            try:
                await probe.read(1.0)
            except redis.exceptions.RedisError as exc:
                errors.append(exc)

    watcher = asyncio.ensure_future(watch())
    async with aioredis.Redis.from_url(settings.REDIS_URL) as writer:
        await run_ticks(writer, keys, ids, 0, 5)
    durable_redis.kill(signal.SIGKILL)
    await asyncio.sleep(7)  # past the client's retries (about 5 s): the readers see it
    durable_redis.start()
    async with aioredis.Redis.from_url(settings.REDIS_URL) as writer:
        await run_ticks(writer, keys, ids, 5, 10, end=True)
    results = await asyncio.wait_for(asyncio.gather(*readers), 30)
    watcher.cancel()
    probe.close()
    assert [seqs for seqs, _ in results] == [list(range(11))] * 3
    assert errors and all(isinstance(e, redis.exceptions.ConnectionError) for e in errors)
    assert all(waits >= 1 for _, waits in results)  # the clients heard from us meanwhile


@pytest.mark.slow
async def test_redis_unreachable_past_the_tolerance_ends_the_stream_with_503(keys,
                                                                            durable_redis):
    reader = asyncio.ensure_future(collect(uuid.uuid4().hex, outage_tolerance_s=1))
    await until(lambda: event_reader.current()._sent_at is not None)
    durable_redis.kill(signal.SIGKILL)
    with pytest.raises(APIError) as caught:
        await asyncio.wait_for(reader, 30)
    assert caught.value.status == 503 and caught.value.code == "service_unavailable"
    assert event_reader.current().streams() == set()


async def test_keepalives_go_out_on_time_while_redis_does_not_answer(keys, quiet_redis,
                                                                     settings):
    # A stopped (not killed) Redis: the reader's read hangs until the client's timeout, and a
    # streaming response must still send its keep-alive comments on schedule meanwhile.
    request_id = uuid.uuid4().hex
    seen: list[tuple[float, str]] = []

    async def consume() -> None:
        async for event in events(request_id, 60, keepalive_s=0.5, outage_tolerance_s=60):
            seen.append((time.monotonic(), "wait" if isinstance(event, Waiting) else "event"))
            if not isinstance(event, Waiting) and event.type == "final":
                return

    consumer = asyncio.ensure_future(consume())
    async with aioredis.Redis.from_url(settings.REDIS_URL) as writer:
        await run_ticks(writer, keys, [request_id], 0, 3)
        await until(lambda: len(seen) >= 3)
        stopped = time.monotonic()
        quiet_redis.proc.send_signal(signal.SIGSTOP)
        try:
            await asyncio.sleep(3.5)
        finally:
            quiet_redis.proc.send_signal(signal.SIGCONT)
        resumed = time.monotonic()
        await run_ticks(writer, keys, [request_id], 3, 5, end=True)
    await asyncio.wait_for(consumer, 30)
    waits = [t for t, kind in seen if kind == "wait" and stopped <= t <= resumed]
    assert len(waits) >= 4, f"keep-alives during a 3.5 s stall: {len(waits)}"
    assert max(b - a for a, b in zip([stopped, *waits], [*waits, resumed], strict=True)) < 1.5
    assert sum(kind == "event" for _, kind in seen) == 6  # nothing lost or repeated


async def test_what_one_read_finds_comes_as_one_list_and_an_invalid_entry_after_it(keys, writer):
    """A worker's write of two ticks at once is read as one list (one SSE write); an entry that
    is not an event fails the read, after the events before it were handed over."""
    import pydantic

    from gateway.events import event_batches

    [request_id] = new_ids(1)
    await tick(writer, keys, [request_id], 0)
    await tick(writer, keys, [request_id], 1)
    await writer.xadd(keys.events(request_id), {"data": b'{"type": "token"}'})
    got = []
    with pytest.raises(pydantic.ValidationError):
        async for batch in event_batches(request_id, 30):
            got.append([event.seq for event in batch])
    assert got == [[0, 1]]
