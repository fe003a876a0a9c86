"""Aborts: a request stopped wherever it is, and the aborts Redis could not take, retried.

An abort withdraws the request from the shared queue while it still waits there (it ends there,
as no worker will see it); once a worker took it, an abort mark (``{prefix}:aborted:{id}``) and
a :class:`~inference.protocol.messages.ControlMessage` on ``{prefix}:control`` stop it in
whichever worker holds it, and in one that reads it later.

An abort that fails while Redis is unreachable (:func:`abort_later`) waits in a table of the
event loop it was asked on; that loop's web monitor (:mod:`gateway.monitor`) sends it again each
round (:func:`retry_pending`) for up to :data:`ABORT_RETRY_S`, so a worker never generates for
a client that left during an outage.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref

import redis
import redis.exceptions
from asgiref.sync import sync_to_async

from gateway import usage
from gateway.clients import aredis
from gateway.conf import redis_keys
from gateway.scripts import LuaScript
from inference.protocol.keys import ABORT_MARK_TTL_S, EVENTS_TTL_S, queue_script
from inference.protocol.messages import ControlMessage

log = logging.getLogger(__name__)

WITHDRAW_LUA = LuaScript(queue_script("withdraw"))
# Aborts that could not be sent are retried for this long (seconds).
ABORT_RETRY_S = 600.0

# Per event loop: request id -> monotonic time its abort failed.
_pending: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, float]] = (
    weakref.WeakKeyDictionary())


async def abort(request_id: str) -> None:
    """Stop ``request_id`` wherever it is.

    Still waiting in the shared queue, it is withdrawn from it and ends there (final event
    ``abort``, its usage recorded: nothing generated), as no worker will see it. Taken by a
    worker, every worker is asked to abort it, and an abort mark tells a worker that missed the
    message (or reads the request later) to drop it.

    Raises:
        redis.RedisError: Redis is unreachable (the web monitor retries it: :func:`abort_later`).
    """
    keys = redis_keys()
    client = aredis()
    withdrawn = await WITHDRAW_LUA.arun(client, 0, keys.prefix, EVENTS_TTL_S, "ids", request_id)
    if withdrawn:
        await sync_to_async(usage.record)(request_id)
        return
    pipe = client.pipeline(transaction=False)
    pipe.set(keys.aborted(request_id), 1, ex=ABORT_MARK_TTL_S)
    pipe.publish(keys.control, ControlMessage(type="abort", request_id=request_id).to_json())
    await pipe.execute()


def abort_sync(request_id: str, client: redis.Redis) -> None:
    """:func:`abort` on a blocking client (Celery tasks, sweeps run in a thread).

    Raises:
        redis.RedisError: Redis is unreachable.
    """
    keys = redis_keys()
    if WITHDRAW_LUA.run(client, 0, keys.prefix, EVENTS_TTL_S, "ids", request_id):
        usage.record(request_id, client)
        return
    pipe = client.pipeline(transaction=False)
    pipe.set(keys.aborted(request_id), 1, ex=ABORT_MARK_TTL_S)
    pipe.publish(keys.control, ControlMessage(type="abort", request_id=request_id).to_json())
    pipe.execute()


def pending() -> dict[str, float]:
    """The running event loop's aborts waiting to be sent again: request id -> monotonic time
    (seconds) its abort failed. Must be called on an event loop."""
    loop = asyncio.get_running_loop()
    table = _pending.get(loop)
    if table is None:
        table = _pending[loop] = {}
    return table


async def abort_later(request_id: str) -> None:
    """:func:`abort`, and when Redis is unreachable, leave it to the web monitor to retry
    (:func:`retry_pending`). Never raises a Redis error."""
    try:
        await abort(request_id)
    except redis.exceptions.RedisError:
        log.warning("could not abort %s now (Redis unreachable): retrying in the background",
                    request_id)
        pending()[request_id] = time.monotonic()


async def retry_pending() -> None:
    """Send again the running loop's aborts that failed (:func:`abort_later`); one that failed
    more than :data:`ABORT_RETRY_S` ago is given up. Each sent is forgotten.

    Raises:
        redis.RedisError: Redis is unreachable (the rest wait for the next call).
    """
    table = pending()
    for request_id, failed_at in list(table.items()):
        if time.monotonic() - failed_at > ABORT_RETRY_S:
            table.pop(request_id, None)
            continue
        await abort(request_id)
        table.pop(request_id, None)
