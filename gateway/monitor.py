"""Each web process's background duties, one task per event loop (:func:`ensure_started`).

Every ``MONITOR_INTERVAL_S`` it:

- publishes the process's heartbeat (``{prefix}:web``): a worker stops generating the answers of
  a web process whose heartbeat lapsed (``WEB_HEARTBEAT_TTL_S``), since their clients went with it
  (killed, restarted);
- reads the deployment's epoch (``{prefix}:epoch``): a request queued under another epoch was
  lost with Redis's data, and its reader ends it with a clear error instead of waiting;
- sweeps the shared queue (:func:`gateway.housekeeping.asweep`): a dead worker's streams end
  within its heartbeat TTL even when no worker lives to reclaim them, and expired requests end;
  their usage is recorded (:mod:`gateway.usage`);
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
from gateway.clients import aredis
from gateway.conf import platform_settings, redis_keys

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
        self.redis_ok_at = 0.0  # monotonic time of the last successful round
        self._task: asyncio.Task | None = None
        self.back_since = float("-inf")  # monotonic time Redis answered again after an outage
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
        self.redis_ok_at = time.monotonic()
        # Just after an outage, a stale heartbeat may be a live worker's: judge them only once
        # every process could have written its own for a whole TTL.
        ended = await housekeeping.asweep(client, reclaim=not self.recovering())
        if ended:
            await sync_to_async(_record_all)(ended)
        await aborts.retry_pending()

    def recovering(self) -> bool:
        """Whether Redis came back from an outage less than a heartbeat TTL ago."""
        ttl = platform_settings()["WORKER_HEARTBEAT_TTL_S"]
        return time.monotonic() - self.back_since < ttl

    async def _run(self) -> None:
        failing_since: float | None = None
        while True:
            try:
                if failing_since is not None:
                    self.back_since = float("inf")  # set when the round below succeeds
                await self.beat()
                if failing_since is not None:
                    self.back_since = time.monotonic()
                    log.warning("Redis is reachable again after %.1f s",
                                time.monotonic() - failing_since)
                failing_since = None
            except asyncio.CancelledError:
                raise
            except redis.exceptions.RedisError as exc:
                if failing_since is None:
                    failing_since = time.monotonic()
                    log.warning("web monitor: Redis unreachable (%s); retrying", exc)
            except Exception:  # noqa: BLE001 - the monitor must outlive any one failure
                log.exception("web monitor round failed")
            finally:
                self._started.set()
            await asyncio.sleep(MONITOR_INTERVAL_S)

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
