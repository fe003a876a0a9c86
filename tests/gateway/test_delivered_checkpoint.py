"""The delivered checkpoint (``gateway.delivery``): what each streaming request's client was sent,
written by the loop's event reader in the round trips of its reads, a few times a second for
the whole process whatever the number of tokens, never ahead of what was sent.

On a redis-server of the test's own, so that its command counts are the test's.
"""

from __future__ import annotations

import asyncio
import signal
import time
import uuid
from collections.abc import Iterator

import pytest
import redis.asyncio as aioredis

from benchmarks.harness.redis_server import PrivateRedis
from gateway import delivery, event_reader, lifecycle, monitor
from inference.protocol.events import TokenEvent, encode_event
from inference.protocol.messages import RequestMessage

pytestmark = [pytest.mark.anyio, pytest.mark.process]

STREAMS = 4
TICKS = 150
EVERY_S = 0.01


@pytest.fixture
def quiet_redis(tmp_path, settings) -> Iterator[PrivateRedis]:
    """A redis-server of the test's own, the web tier's Redis for the test's duration."""
    server = PrivateRedis(tmp_path, tmp_path / "redis.log", "none")
    server.start()
    shared = settings.REDIS_URL
    settings.REDIS_URL = server.url
    yield server
    settings.REDIS_URL = shared  # the shared Redis, for the fixtures' cleanup
    server.kill(signal.SIGKILL)


def generation() -> lifecycle.Generation:
    message = RequestMessage(request_id=uuid.uuid4().hex, tenant="t", fairness_key="t",
                             prompt="hi", meta={"tenant_id": 1, "stream": True})
    return lifecycle.Generation(message)


async def relay(gen: lifecycle.Generation, sent: dict[str, int]) -> None:
    """Relay the stream as the REST API does, marking each token sent once handed over."""
    async for event in gen.events():
        if isinstance(event, TokenEvent):
            await asyncio.sleep(0)  # the client's connection takes it
            gen.sent(event.seq)
            sent[gen.request_id] = event.seq + 1


async def test_checkpoints_are_few_writes_and_never_ahead_of_what_was_sent(keys, quiet_redis,
                                                                         settings):
    gens = [generation() for _ in range(STREAMS)]
    sent: dict[str, int] = {}
    key = delivery.checkpoint_key(monitor.WEB_ID)
    ahead: list[tuple[str, int, int]] = []
    async with aioredis.Redis.from_url(settings.REDIS_URL) as redis:

        async def watch() -> None:
            while True:
                marked = dict(sent)  # what was sent before the checkpoint was read
                for rid, value in (await redis.hgetall(key)).items():
                    rid = rid.decode()
                    if int(value) > sent.get(rid, 0):
                        ahead.append((rid, int(value), marked.get(rid, 0)))
                await asyncio.sleep(0.01)

        relays = [asyncio.ensure_future(relay(gen, sent)) for gen in gens]
        watcher = asyncio.ensure_future(watch())
        started = time.monotonic()
        for seq in range(TICKS):  # one token for each stream per worker tick
            pipe = redis.pipeline(transaction=False)
            for gen in gens:
                pipe.xadd(keys.events(gen.request_id), encode_event(TokenEvent(
                    request_id=gen.request_id, seq=seq, token_id=1, text="a")))
            await pipe.execute()
            await asyncio.sleep(EVERY_S)
        took = time.monotonic() - started
        # The streams went quiet: the reader's next read, once its block ends, carries the last
        # marks.
        await asyncio.sleep(event_reader.BLOCK_S + 2 * delivery.CHECKPOINT_INTERVAL_S)
        checkpoints = {k.decode(): int(v) for k, v in (await redis.hgetall(key)).items()}
        stats = await redis.info("commandstats")
        watcher.cancel()
        for task in relays:
            task.cancel()
        assert 0 < await redis.ttl(key) <= delivery.KEEP_S
    assert not ahead, f"a checkpoint ran ahead of what its client was sent: {ahead[:3]}"
    assert checkpoints == {gen.request_id: TICKS for gen in gens}
    writes = int(stats.get("cmdstat_hset", {}).get("calls", 0))
    # One HSET per checkpoint period for the whole loop, not one per token (600 here).
    assert 0 < writes <= (took + 3 * delivery.CHECKPOINT_INTERVAL_S) / \
        delivery.CHECKPOINT_INTERVAL_S + 2, writes


async def test_the_checkpoint_of_a_response_that_ended_is_dropped(keys, quiet_redis,
                                                                 settings):
    ended, going = generation(), generation()
    key = delivery.checkpoint_key(monitor.WEB_ID)
    async with aioredis.Redis.from_url(settings.REDIS_URL) as redis:
        sent: dict[str, int] = {}
        tasks = [asyncio.ensure_future(relay(g, sent)) for g in (ended, going)]
        for seq in range(3):
            for gen in (ended, going):
                await redis.xadd(keys.events(gen.request_id), encode_event(TokenEvent(
                    request_id=gen.request_id, seq=seq, token_id=1, text="a")))
            await asyncio.sleep(delivery.CHECKPOINT_INTERVAL_S)
        assert await redis.hget(key, ended.request_id) is not None
        tasks[0].cancel()
        await ended.close()  # its response ended (the client left)
        for seq in range(3, 6):
            await redis.xadd(keys.events(going.request_id), encode_event(TokenEvent(
                request_id=going.request_id, seq=seq, token_id=1, text="a")))
            await asyncio.sleep(delivery.CHECKPOINT_INTERVAL_S)
        assert await redis.hget(key, ended.request_id) is None
        assert int(await redis.hget(key, going.request_id)) >= 4
        tasks[1].cancel()
