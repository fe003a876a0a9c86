"""A request's events, read from its Redis stream.

A worker appends each request's events to ``{prefix}:events:{request_id}``:
:class:`~inference.protocol.events.TokenEvent` ... then exactly one
:class:`~inference.protocol.events.FinalEvent`, each validated here as it is read. The streams of
all the requests of an event loop are read together by its one reader (:mod:`gateway.event_reader`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass

import redis.exceptions

from gateway import event_reader, monitor
from gateway.clients import raise_if_cancelled
from gateway.conf import redis_keys
from gateway.errors import APIError
from inference.protocol.events import Event, decode_event

# A request waits this long at most for its next entries before it looks again at its deadlines
# and epoch: a lost request (Redis lost its data) is noticed within a second or so (seconds).
XREAD_BLOCK_S = 1.0
# Backoff between reads while Redis is unreachable (seconds).
OUTAGE_BACKOFF_S = (0.1, 0.2, 0.5, 1.0)


@dataclass(frozen=True)
class Waiting:
    """No event for a while: the first-event timeout passed (a streaming response commits to its
    status), or a keepalive period passed (a streaming response sends a comment)."""


def lost_error() -> APIError:
    """The error of a request whose state Redis lost (restarted without its data)."""
    return APIError(503, "The server's request store restarted and lost this request; retry "
                    "it.", code="service_unavailable", retry_after_s=1)


def events(
    request_id: str, idle_timeout_s: float, first_timeout_s: float | None = None, *,
    keepalive_s: float | None = None, epoch: str | None = None,
    outage_tolerance_s: float = 10.0,
) -> AsyncIterator[Event | Waiting]:
    """The request's events in order, up to and including the final one, one at a time
    (:func:`event_batches` flattened; the same arguments and errors)."""
    return flattened(event_batches(request_id, idle_timeout_s, first_timeout_s,
                                   keepalive_s=keepalive_s, epoch=epoch,
                                   outage_tolerance_s=outage_tolerance_s))


async def flattened(batches: AsyncGenerator[list[Event] | Waiting, None],
                    ) -> AsyncIterator[Event | Waiting]:
    """The events of ``batches`` one at a time (its :class:`Waiting` as they come); closing
    this closes ``batches``."""
    async with contextlib.aclosing(batches):
        async for batch in batches:
            if isinstance(batch, Waiting):
                yield batch
            else:
                for event in batch:
                    yield event


async def event_batches(
    request_id: str, idle_timeout_s: float, first_timeout_s: float | None = None, *,
    keepalive_s: float | None = None, epoch: str | None = None,
    outage_tolerance_s: float = 10.0,
) -> AsyncIterator[list[Event] | Waiting]:
    """The request's events in order, up to and including the final one, as they come: each
    list what one read found (never empty; a streaming response sends it in one write).

    Args:
        idle_timeout_s: how long to wait for any event (seconds).
        first_timeout_s: yield one :class:`Waiting` if the first event has not arrived by then.
        keepalive_s: after the first :class:`Waiting` or event, yield a :class:`Waiting` each time
            this long passes without an event.
        epoch: the deployment's epoch when the request was queued: when the web monitor reads
            another, Redis lost the request, and waiting would never end.
        outage_tolerance_s: how long Redis may stay unreachable before the request ends; the
            read resumes after the last event received, so no event is lost or repeated.

    Raises:
        APIError: 504 ``worker_timeout`` when no event arrives for ``idle_timeout_s`` seconds;
            503 ``service_unavailable`` when Redis stays unreachable past ``outage_tolerance_s``
            or lost the request.
        pydantic.ValidationError: an entry that is not a valid event.
    """
    stream = redis_keys().events(request_id)
    watcher = monitor.current()
    start = time.monotonic()
    deadline = start + idle_timeout_s
    # When to yield the next Waiting: the first-event timeout, then every keepalive period.
    beat_at = start + first_timeout_s if first_timeout_s is not None else None
    failures = 0
    failing_since: float | None = None
    # The loop's one reader reads every request's stream; this request waits for its entries.
    subscription = event_reader.subscribe(stream)
    try:
        while True:
            wake = deadline if beat_at is None else min(deadline, beat_at)
            now = time.monotonic()
            block_ms = max(1, int(min(XREAD_BLOCK_S, wake - now) * 1000))
            # While Redis does not answer, the client's own retries take seconds before they
            # fail: wait no longer than the next Waiting is due, so it goes out on time.
            patience_s = max(block_ms / 1000, beat_at - now) if beat_at is not None else None
            try:
                entries = await subscription.read(block_ms / 1000, patience_s)
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
                raise_if_cancelled()
                now = time.monotonic()
                failing_since = failing_since or now
                if now - failing_since > outage_tolerance_s:
                    raise APIError(503, "The server lost its connection to the request store; "
                                   "retry the request.", code="service_unavailable",
                                   retry_after_s=1) from exc
                await asyncio.sleep(OUTAGE_BACKOFF_S[min(failures, len(OUTAGE_BACKOFF_S) - 1)])
                failures += 1
                deadline += time.monotonic() - now  # an outage is not the worker's silence
                if beat_at is not None and time.monotonic() >= beat_at:
                    beat_at = time.monotonic() + keepalive_s if keepalive_s else None
                    yield Waiting()  # the client's connection stays open through the outage
                continue
            raise_if_cancelled()
            failures, failing_since = 0, None
            now = time.monotonic()
            if not entries:
                if epoch is not None and watcher.epoch is not None and watcher.epoch != epoch:
                    raise lost_error()
                if beat_at is not None and now >= beat_at:
                    beat_at = now + keepalive_s if keepalive_s else None
                    yield Waiting()
                if now >= deadline:
                    raise APIError(504, f"No answer from the inference worker within "
                                   f"{idle_timeout_s:g} s.", code="worker_timeout")
                continue
            deadline = now + idle_timeout_s
            if keepalive_s:
                beat_at = now + keepalive_s
            elif first_timeout_s is not None:
                beat_at = None
            batch: list[Event] = []
            for _entry_id, fields in entries:
                try:
                    batch.append(decode_event(fields))
                except ValueError:  # pydantic's: the events before it are still handed over
                    if batch:
                        yield batch
                    raise
                if batch[-1].type == "final":
                    break
            yield batch
            if batch[-1].type == "final":
                return
    finally:
        # Also on a cancellation (client disconnect) or a closed generator: stop reading it.
        subscription.close()
