"""Each web process's background duties, one task per event loop (:func:`ensure_started`).

Every ``MONITOR_INTERVAL_S`` (more often when half the workers' heartbeat TTL is shorter, so that
its sight of Redis, a break in which is a stretch of half that TTL without an answer, stays
continuous) it:

- publishes the process's heartbeat (``{prefix}:web``): a worker stops generating the answers of
  a web process whose heartbeat lapsed (``WEB_HEARTBEAT_TTL_S``), since their clients went with it
  (killed, restarted);
- reads the deployment's epoch (``{prefix}:epoch``): a request queued under another epoch was
  lost with Redis's data, and its reader ends it with a clear error instead of waiting;
- sweeps the shared queue (:func:`gateway.housekeeping.asweep`): a dead worker's streams end
  within its heartbeat TTL even when no worker lives to reclaim them, and expired requests end;
  their usage is recorded (:mod:`gateway.usage`). Heartbeats are judged against the event loop's
  own sight of Redis (:func:`gateway.clients.sight`, fed by each round): a round that hung behind
  Redis, or a process that was paused, judges no heartbeat for a TTL after;
- retries the aborts that failed while Redis was unreachable
  (:func:`gateway.aborts.retry_pending`), so a worker never generates for a client that left
  during an outage.

A Redis outage is logged and ridden out: the loop goes on when Redis is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
import time
import uuid
import weakref

import redis.exceptions
from asgiref.sync import sync_to_async

from gateway import aborts, housekeeping, usage
from gateway.clients import aredis, raise_if_cancelled, sight
from gateway.conf import redis_keys

log = logging.getLogger(__name__)

MONITOR_INTERVAL_S = 1.0
# Heartbeats of web processes silent this long are dropped from the sorted set (seconds).
FORGET_WEB_AFTER_S = 3600.0

WEB_ID = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
# Set while this web process drains (SIGTERM, llm_platform.serve): /readyz answers 503.
DRAINING = threading.Event()


class Monitor:
    """The monitor of one event loop; see the module docstring."""

    def __init__(self) -> None:
        self.web_id = WEB_ID
        self.epoch: str | None = None  # the deployment's epoch as last read
        self._task: asyncio.Task | None = None
        self._started = asyncio.Event()

    async def beat(self) -> None:
        """One round of the duties (raises Redis errors)."""
        client = aredis()
        keys = redis_keys()
        now = time.time()
        pipe = client.pipeline(transaction=False)
        pipe.zadd(keys.web, {self.web_id: now})
        pipe.zremrangebyscore(keys.web, "-inf", now - FORGET_WEB_AFTER_S)
        # A Redis that lost its data has no epoch: the first process to see that sets a new one.
        pipe.set(keys.epoch, uuid.uuid4().hex, nx=True)
        pipe.get(keys.epoch)
        reply = await pipe.execute()
        epoch = reply[3]
        self.epoch = epoch.decode() if isinstance(epoch, bytes) else epoch
        # A stale heartbeat may be a live worker's that Redis did not let beat: judged against
        # this loop's own sight of Redis (a round that hung behind it breaks the sight).
        seen = sight()
        seen.answered()
        ended = await housekeeping.asweep(client, sight=seen)
        if ended:
            await sync_to_async(_record_all)(ended)
        await aborts.retry_pending()

    async def _run(self) -> None:
        failing_since: float | None = None
        while True:
            try:
                await self.beat()
                raise_if_cancelled()
                if failing_since is not None:
                    log.warning("Redis is reachable again after %.1f s",
                                time.monotonic() - failing_since)
                failing_since = None
            except asyncio.CancelledError:
                raise
            except redis.exceptions.RedisError as exc:
                sight().lost()
                if failing_since is None:
                    failing_since = time.monotonic()
                    log.warning("web monitor: Redis unreachable (%s); retrying", exc)
            except Exception:  # noqa: BLE001 - the monitor must outlive any one failure
                log.exception("web monitor round failed")
            finally:
                self._started.set()
            raise_if_cancelled()  # a round that failed may have swallowed it too
            await asyncio.sleep(min(MONITOR_INTERVAL_S, sight().gap_s / 2))

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="web-monitor")


def _record_all(request_ids: list[str]) -> None:
    for request_id in request_ids:
        try:
            usage.record(request_id)
        except Exception:  # noqa: BLE001 - the reconciliation records it later
            log.exception("could not record the usage of %s now", request_id)


_monitors: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Monitor] = (
    weakref.WeakKeyDictionary())


def current() -> Monitor:
    """The monitor of the running event loop (created, not started)."""
    loop = asyncio.get_running_loop()
    monitor = _monitors.get(loop)
    if monitor is None:
        monitor = _monitors[loop] = Monitor()
    return monitor


async def ensure_started(timeout_s: float = 2.0) -> Monitor:
    """Start the running loop's monitor if needed; wait (bounded) for its first round, so the
    process's heartbeat is published before it sends a request to the workers."""
    monitor = current()
    monitor.start()
    if not monitor._started.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(monitor._started.wait()), timeout_s)
    return monitor
