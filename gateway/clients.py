"""The web tier's Redis clients: one async pool per event loop, one blocking pool per process."""

from __future__ import annotations

import asyncio
import functools
import weakref

import redis as redis_sync
import redis.asyncio as aioredis
from django.conf import settings

from gateway.conf import platform_settings

_async_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, aioredis.Redis] = (
    weakref.WeakKeyDictionary()
)


def aredis() -> aioredis.Redis:
    """The async Redis client of the running event loop (one connection pool per loop).

    Every streaming request holds a connection while it waits for events (``XREAD BLOCK``), so
    the pool holds ``REDIS_MAX_CONNECTIONS``: the whole gate-1 queue plus the running batch.
    """
    loop = asyncio.get_running_loop()
    client = _async_clients.get(loop)
    if client is None:
        client = aioredis.Redis.from_url(
            settings.REDIS_URL, max_connections=platform_settings()["REDIS_MAX_CONNECTIONS"])
        _async_clients[loop] = client
    return client


@functools.cache
def _sync_client(url: str) -> redis_sync.Redis:
    return redis_sync.Redis.from_url(url)


def sync_redis() -> redis_sync.Redis:
    """The blocking Redis client of this process (Celery tasks, management commands, metrics)."""
    return _sync_client(settings.REDIS_URL)
