"""What each client got of its answer, as the web process relaying it saw it.

A usage record bills what its client received (:mod:`gateway.usage`, ``docs/design.md``,
section 10). The worker knows what it generated; only the web process that relays a request (the
message's ``origin``) knows what its client was sent, and it says so in Redis twice:

- **The delivered checkpoint** of each streaming request it relays: ``{prefix}:delivery:{web
  id}`` (hash: request id -> the tokens its client was sent, the last ``seq`` sent + 1). The
  event loop's reader (:mod:`gateway.event_reader`) writes the fields that changed in the
  round trip of an ``XREAD`` it sends anyway, at most every :data:`CHECKPOINT_INTERVAL_S` for the
  whole loop (one ``HSET`` of the changed fields, whatever the number of streams and tokens), and
  drops the fields of the requests that ended. The hash expires :data:`KEEP_S` after its last
  write. A checkpoint never runs ahead of what was handed to the client's connection: it lags
  it by at most the tokens sent in the last :data:`CHECKPOINT_INTERVAL_S` and one read's.
- **The end note** of each request (:func:`write_note`, from
  :func:`gateway.lifecycle.end_request`): ``{prefix}:delivered:{request id}`` (hash), its field
  ``note`` a :class:`Delivery`: the tokens its client was sent, how the response ended for it,
  and the HTTP status it got; kept :data:`KEEP_S`.

:func:`read` tells the recorder what a request's client got: its end note; else, once its web
process is gone (:func:`web_gone`), the checkpoint, as a client cut off (status 499); else
nothing yet, and the recording waits (the web process is still relaying it, or has not written
its note). A request without an origin (a chat answer: it is stored whole for its page, whoever
reads it) and without a note is billed as its worker counted it.

A recorder that waits says so in the same hash (field ``waited``), in the transaction that found
no note; the web process writes its note in a transaction that reads that field, and records
the request itself when a recorder waited. So exactly one of them sees the other: the request is
recorded as soon as both its end and its note are in Redis.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

import redis
import redis.asyncio as aioredis

from gateway.conf import platform_settings, redis_keys
from gateway.errors import CLIENT_CLOSED_STATUS, APIError, final_status
from inference.protocol.events import ErrorCode, ErrorInfo, FinalEvent, FinishReason
from inference.protocol.keys import EVENTS_TTL_S

# The loop's checkpoints are written at most this often (seconds).
CHECKPOINT_INTERVAL_S = 0.2
# Checkpoints and end notes are kept this long after their last write (seconds): as long as the
# events a web process could still relay. A request whose live web process has not written its
# note after this long (the write failed) is billed as cut off at its checkpoint.
KEEP_S = EVENTS_TTL_S

# How a response ended for its client (Delivery.end), besides the code of an error it got.
COMPLETE = "complete"  # it got the end the worker wrote: its last token and final event, or the
#                        whole answer not streamed
LEFT = "left"  # it went away first
GONE = "gone"  # its web process died (no note): cut off at the checkpoint


@dataclass(frozen=True)
class Delivery:
    """What a request's client got.

    Attributes:
        tokens: the token events it was sent (a stream's; 0 for an answer not streamed).
        end: :data:`COMPLETE`, :data:`LEFT`, :data:`GONE`, or the code of the error it got
            (``worker_lost``, ``interrupted``, ``service_unavailable``, ...).
        status: the HTTP status it got (499 when it left or was cut off).
    """

    tokens: int
    end: str
    status: int

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: bytes | str) -> Delivery:
        """Raises: ValueError, KeyError, TypeError: not a note this module wrote."""
        data = json.loads(raw)
        return cls(tokens=int(data["tokens"]), end=str(data["end"]), status=int(data["status"]))


def of_response(final: FinalEvent | None, failure: APIError | None, tokens: int, *,
                draining: bool = False) -> Delivery:
    """What a client got, as its response ends.

    Args:
        final: the final event it was given (as it saw it: :func:`as_got`), if one was read.
        failure: the error reading the events ended with, if one did.
        tokens: the token events it was sent (0 for an answer not streamed).
        draining: this web process drains: a response that ends with neither (its view was
            cancelled at the drain's end) was cut by the server, not left by its client, and is
            billed as one whose web process died (:data:`GONE`: only what it was sent).
    """
    if final is not None and final.error is None:
        return Delivery(tokens, COMPLETE, final_status(final.finish_reason, None))
    if final is not None and final.error is not None:
        return Delivery(tokens, final.error.code.value, APIError.from_worker(final.error).status)
    if failure is not None:
        return Delivery(tokens, failure.code or "error", failure.status)
    return Delivery(tokens, GONE if draining else LEFT, CLIENT_CLOSED_STATUS)


def as_interrupted(final: FinalEvent) -> FinalEvent:
    """``final`` as its client gets it when its reader never asked for an abort: a final
    ``abort`` is then a retryable ``interrupted`` error, never a normal end (the server stopped
    the request: a drain's end, or a worker that took its web process for gone)."""
    if final.finish_reason is not FinishReason.ABORT:
        return final
    return final.model_copy(update={
        "finish_reason": FinishReason.ERROR,
        "error": ErrorInfo(code=ErrorCode.INTERRUPTED, retryable=True,
                           message="the server stopped this request before it finished; "
                                   "retry it",
                           details={"completion_tokens": final.usage.completion_tokens})})


def as_got(final: FinalEvent, tokens: int) -> FinalEvent:
    """``final`` as its client gets it: an error that counts the tokens generated
    (``details.completion_tokens``: ``worker_lost``, ``state_lost``, ``interrupted``) counts the
    ``tokens`` it was sent instead (Redis may have lost some its worker wrote; an answer not
    streamed goes out only whole)."""
    if final.error is None or "completion_tokens" not in final.error.details:
        return final
    details = {**final.error.details, "completion_tokens": tokens}
    return final.model_copy(update={"error": final.error.model_copy(update={"details": details})})


def checkpoint_key(web_id: str) -> str:
    """The hash of the delivered checkpoints of the web process ``web_id``."""
    return f"{redis_keys().prefix}:delivery:{web_id}"


def note_key(request_id: str) -> str:
    """The end note of ``request_id``."""
    return f"{redis_keys().prefix}:delivered:{request_id}"


class Progress:
    """How far one streaming request's client got (:meth:`Checkpoints.track`)."""

    __slots__ = ("request_id", "sent")

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.sent = 0  # token events handed to the client's connection

    def mark(self, seq: int) -> None:
        """The token events up to ``seq`` were handed to the client's connection."""
        self.sent = max(self.sent, seq + 1)


@dataclass(frozen=True)
class Batch:
    """One write of checkpoints: the fields to set, and those of ended requests to drop."""

    changed: dict[str, int]
    ended: list[str]


class Checkpoints:
    """The delivered checkpoints of one event loop's streaming requests (the module docstring).

    Args:
        key: the web process's hash (:func:`checkpoint_key`).
    """

    def __init__(self, key: str) -> None:
        self.key = key
        self._live: dict[str, Progress] = {}
        self._written: dict[str, int] = {}  # what Redis holds, by request id
        self._next_at = float("-inf")  # monotonic time of the next write allowed

    def track(self, request_id: str) -> Progress:
        """Start checkpointing ``request_id``; mark its :class:`Progress` as it is sent."""
        progress = self._live[request_id] = Progress(request_id)
        return progress

    def untrack(self, progress: Progress) -> None:
        """Stop checkpointing (its response ended): its field goes with the next write."""
        if self._live.get(progress.request_id) is progress:
            del self._live[progress.request_id]

    def due(self, now: float) -> Batch | None:
        """The write to add to the next read at monotonic time ``now``, if one is due."""
        if now < self._next_at:
            return None
        changed = {rid: p.sent for rid, p in self._live.items()
                   if p.sent and self._written.get(rid) != p.sent}
        ended = [rid for rid in self._written if rid not in self._live]
        if not changed and not ended:
            return None
        self._next_at = now + CHECKPOINT_INTERVAL_S
        return Batch(changed, ended)

    def commands(self, batch: Batch) -> list[tuple]:
        """``batch``'s commands (``HSET``, ``HDEL``, ``EXPIRE``), for the read's round trip."""
        commands: list[tuple] = []
        if batch.changed:
            commands.append(("HSET", self.key, *(x for item in batch.changed.items()
                                                  for x in item)))
        if batch.ended:
            commands.append(("HDEL", self.key, *batch.ended))
        commands.append(("EXPIRE", self.key, KEEP_S))
        return commands

    def written(self, batch: Batch) -> None:
        """``batch`` is in Redis (its read succeeded)."""
        self._written.update(batch.changed)
        for rid in batch.ended:
            self._written.pop(rid, None)


async def write_note(client: aioredis.Redis, request_id: str, delivery: Delivery) -> bool:
    """Write ``request_id``'s end note; return whether a recorder waited for it (the caller
    then records the request: :func:`gateway.usage.record_if_ended`).

    Raises:
        redis.RedisError: Redis is unreachable (the request is then billed as cut off at its
            checkpoint once its note is past waiting for: :data:`KEEP_S`).
    """
    key = note_key(request_id)
    pipe = client.pipeline(transaction=True)
    pipe.hset(key, "note", delivery.to_json())
    pipe.expire(key, KEEP_S)
    pipe.hget(key, "waited")
    return (await pipe.execute())[2] is not None


@dataclass(frozen=True)
class Reading:
    """What :func:`read` found: ``delivery`` (None: bill as the worker counted), or ``wait``."""

    delivery: Delivery | None = None
    wait: bool = False


def _score(value) -> float | None:
    return None if value is None else float(value)


def _freshest(reply: list) -> float | None:
    return float(reply[0][1]) if reply else None


def web_gone(beat: float | None, freshest: float | None, finished_at: float, now: float,
             ttl_s: float) -> bool:
    """Whether the web process of a request ended at ``finished_at`` is gone.

    Its heartbeat (``beat``; None: not there, as after Redis lost its data, whose first beats
    come within a second) is older than ``ttl_s`` while another process's (``freshest``, of
    any web process or worker) is not: Redis answered, and it did not beat. When every heartbeat
    is stale at once, the silence is an outage, not a death (all times unix seconds).
    """
    last = beat if beat is not None else finished_at
    return (now - last > ttl_s and freshest is not None and now - freshest <= ttl_s)


def read(client: redis.Redis, request_id: str, origin: str, finished_at: float,
         now: float | None = None) -> Reading:
    """What the client of ``request_id`` got, for its usage record (the module docstring).

    Args:
        origin: the web process that relayed it ("" for none).
        finished_at: unix time its worker or the queue ended it.

    Raises:
        redis.RedisError: Redis is unreachable.
    """
    now = time.time() if now is None else now
    keys = redis_keys()
    key = note_key(request_id)
    pipe = client.pipeline(transaction=True)  # the note, or the mark that this one waited
    pipe.hget(key, "note")
    if origin:
        pipe.hset(key, "waited", 1)
        pipe.expire(key, KEEP_S)
        pipe.hget(checkpoint_key(origin), request_id)
        pipe.zscore(keys.web, origin)
        pipe.zrevrange(keys.web, 0, 0, withscores=True)
        pipe.zrevrange(keys.workers, 0, 0, withscores=True)
    reply = pipe.execute()
    if reply[0] is not None:
        try:
            return Reading(Delivery.from_json(reply[0]))
        except (ValueError, KeyError, TypeError):
            pass  # not a note: judged as if it had none
    if not origin:
        return Reading()
    checkpoint, beat, webs, workers = reply[3:]
    freshest = max((t for t in (_freshest(webs), _freshest(workers)) if t is not None),
                   default=None)
    ttl = platform_settings()["WEB_HEARTBEAT_TTL_S"]
    if (web_gone(_score(beat), freshest, finished_at, now, ttl)
            or now - finished_at > KEEP_S):
        return Reading(Delivery(tokens=int(checkpoint or 0), end=GONE,
                                status=CLIENT_CLOSED_STATUS))
    return Reading(wait=True)


def forget(client: redis.Redis, request_id: str, origin: str) -> None:
    """Drop what was kept of ``request_id``'s delivery (its usage is recorded).

    Raises:
        redis.RedisError: Redis is unreachable (both expire on their own).
    """
    pipe = client.pipeline(transaction=False)
    pipe.delete(note_key(request_id))
    if origin:
        pipe.hdel(checkpoint_key(origin), request_id)
    pipe.execute()


def read_notes(client: redis.Redis, request_ids: list[str]) -> list[Delivery | None]:
    """The end note of each of ``request_ids`` (None: none, or not a note), in one round trip:
    :func:`read` of requests no web process relays (``origin`` empty).

    Raises:
        redis.RedisError: Redis is unreachable.
    """
    pipe = client.pipeline(transaction=False)
    for request_id in request_ids:
        pipe.hget(note_key(request_id), "note")
    out: list[Delivery | None] = []
    for raw in pipe.execute():
        try:
            out.append(None if raw is None else Delivery.from_json(raw))
        except (ValueError, KeyError, TypeError):
            out.append(None)
    return out


def forget_many(client: redis.Redis, request_ids: list[str]) -> None:
    """:func:`forget` of requests no web process relays, in one round trip.

    Raises:
        redis.RedisError: Redis is unreachable (the notes expire on their own).
    """
    if request_ids:
        client.delete(*(note_key(request_id) for request_id in request_ids))
