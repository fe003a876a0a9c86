"""The web tier's Redis clients: one async pool per event loop, one blocking pool per process;
and each event loop's sight of Redis (:func:`sight`).

Both retry a call on a lost connection for a few seconds
(:func:`inference.protocol.keys.redis_retry_options`)."""

from __future__ import annotations

import asyncio
import functools
import weakref
from collections.abc import Coroutine
from typing import Any, TypeVar

import redis as redis_sync
import redis.asyncio as aioredis
from django.conf import settings

from gateway.conf import platform_settings
from inference.protocol.keys import redis_retry_options
from inference.protocol.liveness import RedisSight

_async_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, aioredis.Redis] = (
    weakref.WeakKeyDictionary()
)
_sights: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, RedisSight] = (
    weakref.WeakKeyDictionary()
)
_own_loop: asyncio.AbstractEventLoop | None = None

T = TypeVar("T")


def raise_if_cancelled() -> None:
    """Re-raise a cancellation of the running task that a Redis call swallowed.

    On Python 3.11, ``asyncio.wait_for`` (used inside redis-py) loses a cancellation that
    arrives just as the awaited operation completes. A loop that then goes on would never end:
    a client's disconnect would leave its request generating for nobody, and a background loop
    (the web monitor, the event reader) would hold its event loop's shutdown forever. So every
    such loop checks the task's own pending-cancellation count after each Redis call.

    Raises:
        asyncio.CancelledError: the task was asked to stop.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


def aredis() -> aioredis.Redis:
    """The async Redis client of the running event loop (one connection pool per loop).

    Its calls are short (events are read on a connection of their own:
    :mod:`gateway.event_reader`); the pool holds up to ``REDIS_MAX_CONNECTIONS``.
    """
    loop = asyncio.get_running_loop()
    client = _async_clients.get(loop)
    if client is None:
        client = aioredis.Redis.from_url(
            settings.REDIS_URL, max_connections=platform_settings()["REDIS_MAX_CONNECTIONS"],
            **redis_retry_options(asyncio=True))
        _async_clients[loop] = client
    return client


@functools.cache
def _sync_client(url: str) -> redis_sync.Redis:
    return redis_sync.Redis.from_url(url, **redis_retry_options())


def sync_redis() -> redis_sync.Redis:
    """The blocking Redis client of this process (Celery tasks, management commands, metrics)."""
    return _sync_client(settings.REDIS_URL)


def sight() -> RedisSight:
    """How long Redis has answered the running event loop without a break (its monitor's rounds
    and its reads of the workers' heartbeats feed it): the web tier judges heartbeats against it
    (:mod:`inference.protocol.liveness`). A break: more than half ``WORKER_HEARTBEAT_TTL_S``
    without an answer."""
    loop = asyncio.get_running_loop()
    seen = _sights.get(loop)
    if seen is None:
        seen = _sights[loop] = RedisSight(platform_settings()["WORKER_HEARTBEAT_TTL_S"] / 2)
    return seen


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to its end on this process's own event loop, for synchronous callers (the
    Celery batch steps); the loop is kept between calls, so its Redis pool (:func:`aredis`) is
    too. Not for a thread that runs an event loop already."""
    global _own_loop
    if _own_loop is None or _own_loop.is_closed():
        _own_loop = asyncio.new_event_loop()
    return _own_loop.run_until_complete(coro)
