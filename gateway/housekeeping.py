"""Housekeeping of the protocol's Redis keys: what would otherwise be kept, or waited on, for ever.

:func:`sweep` (and :func:`asweep`, its async twin for the web tier's monitor) ends the waiting
requests past their admission deadline and reclaims the requests of workers whose heartbeat
lapsed, as the sweeping process's own sight of Redis allows (:mod:`inference.protocol.liveness`:
a process that has not seen Redis answer without a break for a whole TTL declares no death, and
every heartbeat stale at once is taken for an outage). The workers run the same Lua scripts; the
web tiers and a Celery beat task run them too, so that a dead worker's streams end within its
heartbeat TTL even when no worker lives. Each script is atomic: whoever runs it first does the
work, once. The same rounds end the generations
whose grace period without a reader ran out (:mod:`gateway.grace`, the chat's answers).

:func:`trim_redis` deletes an events stream whose expiry was never set (a writer that died
between its two commands).
"""

from __future__ import annotations

import logging
import time

import redis
import redis.asyncio as aioredis
from asgiref.sync import sync_to_async

from gateway import grace
from gateway.clients import sync_redis
from gateway.conf import platform_settings, redis_keys
from gateway.scripts import LuaScript
from inference.protocol.keys import EVENTS_TTL_S, queue_script
from inference.protocol.liveness import RedisSight

log = logging.getLogger(__name__)

RECLAIM_LUA = LuaScript(queue_script("reclaim"))
WITHDRAW_LUA = LuaScript(queue_script("withdraw"))
# Requests expired per sweep (the rest go in the next one).
EXPIRE_BATCH = 256


def _ids(values: list) -> list[str]:
    return [v.decode() if isinstance(v, bytes) else str(v) for v in values]


def _reclaimed(reply: list) -> list[str]:
    workers = _ids([reply[1]])[0]
    ended = _ids(reply[2:])
    if workers not in ("{}", "[]"):
        log.warning("reclaimed dead worker(s) %s: %s request(s) back in the queue, %d ended",
                    workers, reply[0], len(ended))
    return ended


def sweep(client: redis.Redis | None = None, *, sight: RedisSight) -> list[str]:
    """End expired requests, then reclaim dead workers as a judge with ``sight`` (the calling
    process's sight of Redis, fed here by the first call's answer) judges them; return the ids
    of the requests ended.

    Raises:
        redis.RedisError: Redis is unreachable.
    """
    client = client or sync_redis()
    prefix, ttl = redis_keys().prefix, platform_settings()["WORKER_HEARTBEAT_TTL_S"]
    expired = _ids(WITHDRAW_LUA.run(client, 0, prefix, EVENTS_TTL_S, "expired", EXPIRE_BATCH))
    sight.answered()
    return _reclaimed(RECLAIM_LUA.run(client, 0, prefix, ttl, EVENTS_TTL_S,
                                  sight.seconds(), time.time())) + expired


async def asweep(client: aioredis.Redis, *, sight: RedisSight) -> list[str]:
    """:func:`sweep` on an async client; then :func:`end_unattended`."""
    prefix, ttl = redis_keys().prefix, platform_settings()["WORKER_HEARTBEAT_TTL_S"]
    expired = _ids(await WITHDRAW_LUA.arun(client, 0, prefix, EVENTS_TTL_S, "expired",
                                     EXPIRE_BATCH))
    sight.answered()
    ended = _reclaimed(await RECLAIM_LUA.arun(client, 0, prefix, ttl, EVENTS_TTL_S,
                                         sight.seconds(), time.time())) + expired
    await end_unattended(client)
    return ended


async def end_unattended(client: aioredis.Redis) -> int:
    """End the generations whose grace period without a reader ran out (:func:`grace.sweep`,
    in a thread: their owners store them in the database). Never raises: a failure is logged
    and the next round goes on. Returns how many were stored."""
    try:
        if not await grace.due(client):
            return 0
        return await sync_to_async(grace.sweep)()
    except Exception:  # noqa: BLE001 - the next round retries; the monitor's duties go on
        log.warning("could not end the generations whose grace period ran out",
                    exc_info=True)
        return 0


def _stream_id_ms(entry_id: bytes | str) -> int:
    """The milliseconds part of a stream entry id (``ms-seq``)."""
    value = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(value.partition("-")[0])


def trim_redis(client: redis.Redis) -> dict[str, int]:
    """Delete events streams left without an expiry whose last event is older than their TTL.

    Returns:
        ``{"event_streams": how many were deleted}``.
    """
    keys = redis_keys()
    now_ms = int(time.time() * 1000)
    deleted = 0
    for name in client.scan_iter(match=keys.events("*"), count=500, _type="stream"):
        if client.ttl(name) != -1:
            continue  # expires on its own
        last = client.xrevrange(name, count=1)
        if not last or now_ms - _stream_id_ms(last[0][0]) > EVENTS_TTL_S * 1000:
            client.delete(name)
            deleted += 1
    return {"event_streams": deleted}
