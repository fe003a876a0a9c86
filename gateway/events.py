"""A request's events, read from its Redis stream; aborts.

A worker appends each request's events to ``{prefix}:events:{request_id}``:
:class:`~inference.protocol.TokenEvent` ... then exactly one
:class:`~inference.protocol.FinalEvent`, each validated here as it is read.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from asgiref.sync import sync_to_async

from gateway.clients import aredis
from gateway.conf import redis_keys
from gateway.errors import APIError
from gateway.tasks import record_usage
from inference.protocol import (
    ABORT_MARK_TTL_S,
    EVENTS_TTL_S,
    ControlMessage,
    Event,
    FinalEvent,
    FinishReason,
    RequestMessage,
    UsageReport,
    decode_event,
    encode_event,
    queue_script,
)

# Blocks stay well below the client's socket timeout (5 s by default in redis-py 8).
XREAD_BLOCK_S = 2.0
WITHDRAW_LUA = queue_script("withdraw")


@dataclass(frozen=True)
class Waiting:
    """No event yet after the first-event timeout: a streaming response commits to its status."""


async def abort(request_id: str) -> None:
    """Stop ``request_id`` wherever it is.

    Still waiting in the shared queue, it is withdrawn from it: its final event (``abort``) is
    written here and its usage recorded (nothing generated), as no worker will see it. Taken by a
    worker, every worker is asked to abort it (a worker that reads it later drops it).
    """
    keys = redis_keys()
    client = aredis()
    withdrawn = await client.eval(WITHDRAW_LUA, 0, keys.prefix, "ids", request_id)
    if withdrawn:
        await _end_withdrawn(json.loads(withdrawn[0]))
        return
    pipe = client.pipeline(transaction=False)
    pipe.set(keys.aborted(request_id), 1, ex=ABORT_MARK_TTL_S)
    pipe.publish(keys.control, ControlMessage(type="abort", request_id=request_id).to_json())
    await pipe.execute()


async def _end_withdrawn(record: dict[str, Any]) -> None:
    """The final event and the usage of a request withdrawn before any worker took it."""
    event = FinalEvent(request_id=record["id"], finish_reason=FinishReason.ABORT)
    stream = redis_keys().events(record["id"])
    pipe = aredis().pipeline(transaction=False)
    pipe.xadd(stream, encode_event(event))
    pipe.expire(stream, EVENTS_TTL_S)
    await pipe.execute()
    message = RequestMessage.from_json(record["body"])
    report = UsageReport(request_id=message.request_id, meta=message.meta, usage=event.usage,
                         finish_reason=event.finish_reason, enqueued_at=message.enqueued_at,
                         finished_at=time.time())
    await sync_to_async(record_usage)(report.model_dump(mode="json"))


def _raise_if_cancelled() -> None:
    """Re-raise a cancellation that a Redis call swallowed.

    On Python 3.11, ``asyncio.wait_for`` (used inside redis-py) loses a cancellation that
    arrives just as the awaited operation completes. A client disconnect is delivered as such a
    cancellation, and losing it would leave the request generating for nobody, so the task's own
    pending-cancellation count is checked after every read.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def events(
    request_id: str, idle_timeout_s: float, first_timeout_s: float | None = None
) -> AsyncIterator[Event | Waiting]:
    """The request's events in order, up to and including the final one.

    With ``first_timeout_s``, yields one :class:`Waiting` if the first event has not arrived by
    then (seconds), and goes on waiting.

    Raises:
        APIError: 504 ``worker_timeout`` when no event arrives for ``idle_timeout_s`` seconds.
        pydantic.ValidationError: an entry that is not a valid event.
    """
    client = aredis()
    stream = redis_keys().events(request_id)
    last_id = "0-0"
    start = time.monotonic()
    deadline = start + idle_timeout_s
    first_deadline = start + first_timeout_s if first_timeout_s is not None else None
    while True:
        wake = deadline if first_deadline is None else min(deadline, first_deadline)
        block_ms = max(1, int(min(XREAD_BLOCK_S, wake - time.monotonic()) * 1000))
        reply = await client.xread({stream: last_id}, block=block_ms, count=256)
        _raise_if_cancelled()
        if not reply:
            now = time.monotonic()
            if first_deadline is not None and now >= first_deadline:
                first_deadline = None
                yield Waiting()
            if now >= deadline:
                raise APIError(504, f"No answer from the inference worker within "
                               f"{idle_timeout_s:g} s.", code="worker_timeout")
            continue
        first_deadline = None
        deadline = time.monotonic() + idle_timeout_s
        for entry_id, fields in reply[0][1]:
            last_id = entry_id
            event = decode_event(fields)
            yield event
            if event.type == "final":
                return
