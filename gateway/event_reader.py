"""One reader of the request event streams per event loop, shared by all its streaming requests.

Each request of a web process that waits for its events (:func:`gateway.events.events`) holds a
:class:`Subscription`: its stream (``{prefix}:events:{request_id}``) and the id of the last entry
handed to it. The loop's :class:`EventReader` task reads every subscribed stream with one
``XREAD BLOCK ... STREAMS k1 k2 ... id1 id2 ...`` at a time, on a connection of its own (no
request's call can hold it, and it never blocks a shared one; :mod:`gateway.redis_wire`, which
sends a round trip without redis-py's per-command layers: a lone stream makes one a token), and
hands each subscription its new entries in order, each once: a tick that writes to 16 streams
costs a read or two, not 16.

- A read returns at most :data:`COUNT` entries per stream and names at most
  :data:`MAX_KEYS_PER_READ` streams; more streams are read by several commands sent in one round
  trip, each round reading all of them.
- Every read also names the reader's wake stream (``{prefix}:webwake:{uuid}``). A subscription
  made while the reader blocks appends an entry to it (the stream is trimmed to one entry and
  expires :data:`WAKE_TTL_S` after its last one), so the read returns at once and the next one
  names the new stream. With no subscription at all the reader waits on an :class:`asyncio.Event`
  and sends nothing.
- A subscription whose taker lags (:data:`MAX_BACKLOG` entries handed over and not taken) is
  left out of the reads until it catches up, so a slow client costs no unbounded memory.
- A read's round trip also carries the loop's delivered checkpoints (:mod:`gateway.delivery`).
- A failed read (``redis.ConnectionError`` or ``redis.TimeoutError``; a connection lost once
  established is made anew and the read sent again first) is raised by every subscription's
  next :meth:`Subscription.read`, and the reader retries with backoff. Each subscription keeps
  its position: once Redis answers again, nothing is lost or repeated.
- A reader that dies of anything else is logged, its subscriptions' next read raises
  :class:`ReaderFailed` (an outage to them), and the next read or subscription starts a new one.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
import uuid
import weakref
from dataclasses import dataclass, field

import redis.exceptions
from django.conf import settings

from gateway import delivery
from gateway.clients import aredis, raise_if_cancelled
from gateway.conf import redis_keys
from gateway.monitor import WEB_ID
from gateway.redis_wire import WireConnection

log = logging.getLogger(__name__)

# How long one read blocks in Redis (seconds): well below the client's socket timeout (5 s).
BLOCK_S = 1.0
# A read not back this long after its block ended is taken for an outage in progress: a
# subscription's read waits for its outcome rather than report "nothing yet" (seconds).
LATE_S = 0.5
# With more streams than one command names, a round that found nothing makes its next one block
# this long (seconds), so that no stream waits longer than that for its next read.
SHORT_BLOCK_S = 0.05
COUNT = 256  # entries per stream per read
MAX_KEYS_PER_READ = 512  # streams named by one XREAD
MAX_BACKLOG = 4 * COUNT  # entries handed to a subscription, not yet taken, before it is skipped
WAKE_TTL_S = 60  # the wake stream expires this long after its last entry (seconds)
# Backoff between the reader's reads while Redis is unreachable (seconds).
OUTAGE_BACKOFF_S = (0.1, 0.2, 0.5, 1.0)

Entry = tuple[bytes, dict[bytes, bytes]]
REDIS_DOWN = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)


class ReaderFailed(redis.exceptions.ConnectionError):
    """The loop's event reader died of something else than Redis being unreachable (it was
    logged); to its subscriptions it is an outage, and their next read starts a new reader."""


class ReaderLate(redis.exceptions.ConnectionError):
    """The reader's read in flight is past its block and the caller's patience: an outage."""


def _id(entry_id: bytes | str) -> tuple[int, int]:
    """A stream entry id (``ms-seq``) as a comparable pair."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


def _copy(exc: BaseException) -> BaseException:
    """A fresh exception like ``exc`` (one per subscription: each raises its own)."""
    try:
        new = type(exc)(*exc.args)
    except Exception:  # noqa: BLE001 - an exception type with another signature
        new = redis.exceptions.ConnectionError(str(exc))
    new.__cause__ = exc
    return new


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class Subscription:
    """One stream's new entries, as the loop's reader reads them (made by :func:`subscribe`)."""

    def __init__(self, reader: EventReader, stream: str, last_id: bytes | str) -> None:
        self.stream = stream
        self.key = stream.encode()
        self.last_id = last_id  # of the last entry handed over: the next read starts after it
        self.backlog = 0  # entries handed over and not taken yet
        self.answered_at = float("-inf")  # monotonic time Redis last answered a read of it
        self.overdue = False  # a read() past its timeout waits for the reader's next answer
        self.skipped = False  # left out of the reads for its backlog
        self.closed = False
        self._reader = reader
        self._items: collections.deque[list[Entry] | BaseException] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None

    async def read(self, timeout_s: float, patience_s: float | None = None) -> list[Entry]:
        """The stream's next entries ``(id, fields)`` in order, after those already returned;
        waits up to ``timeout_s`` seconds for some, and is empty when none came meanwhile.

        Past ``timeout_s``, it waits on for a read of the reader's that is late (Redis may be
        unreachable, the client retrying) and raises its failure, as a blocking read of the
        stream would have; with ``patience_s``, for at most that long in all (seconds from the
        call), then it raises :class:`ReaderLate` (so that a caller can keep its client's
        connection alive through an outage the Redis client has not reported yet).

        Raises:
            redis.ConnectionError, redis.TimeoutError: a read of the reader failed (Redis
                unreachable) since the last call, or :class:`ReaderLate`; the next call goes on
                where this one stopped.
            RuntimeError: the subscription is closed.
        """
        if self.closed:
            raise RuntimeError(f"the subscription to {self.stream} is closed")
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        deadline = started + timeout_s
        while True:
            if self._items:
                return self._take()
            now = time.monotonic()
            if now >= deadline:
                if self.answered_at >= started or self._reader.healthy(now):
                    return []
                if patience_s is not None and now >= started + patience_s:
                    raise ReaderLate(f"no answer from Redis for the events of {self.stream}")
                self.overdue = True
                delay = BLOCK_S if patience_s is None else min(BLOCK_S, started + patience_s - now)
            else:
                delay = deadline - now
            self._reader.ensure_running()
            waiter = self._waiter = loop.create_future()
            timer = loop.call_later(delay, _wake, waiter)
            try:
                await waiter
            finally:
                timer.cancel()
                self._waiter = None
                self.overdue = False

    def close(self) -> None:
        """Stop reading the stream (idempotent): the reader's next read leaves it out."""
        if not self.closed:
            self.closed = True
            self._items.clear()
            self._reader.remove(self)

    def _take(self) -> list[Entry]:
        """What the reader handed over: the entries up to the next failure, or that failure."""
        if isinstance(self._items[0], BaseException):
            raise self._items.popleft()
        entries: list[Entry] = []
        while self._items and not isinstance(self._items[0], BaseException):
            entries.extend(self._items.popleft())  # type: ignore[arg-type]
        self.backlog -= len(entries)
        if self.skipped and self.backlog < MAX_BACKLOG:
            self.skipped = False
            self._reader.wake()
        return entries

    def _notify(self) -> None:
        if self._waiter is not None:
            _wake(self._waiter)

    def give(self, entries: list[Entry], now: float) -> None:
        """Hand over entries newer than :attr:`last_id` (the reader's side)."""
        self.answered_at = now
        if entries:
            self.last_id = entries[-1][0]
            self._items.append(entries)
            self.backlog += len(entries)
        if entries or self.overdue:
            self._notify()

    def fail(self, exc: BaseException) -> None:
        """Have the next :meth:`read` raise ``exc`` (the reader's side; one failure in a row)."""
        if not (self._items and isinstance(self._items[-1], BaseException)):
            self._items.append(exc)
        self._notify()


@dataclass
class _Read:
    """One XREAD of a round: the ids to read after, by stream, and the subscriptions served."""

    streams: dict[bytes, bytes | str] = field(default_factory=dict)
    subs: list[Subscription] = field(default_factory=list)


class EventReader:
    """The event reader of one event loop (:func:`current`); see the module docstring."""

    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:12]
        self.client_name = f"webevents-{tag}"  # its connection's name in CLIENT LIST
        self.wake_key = f"{redis_keys().prefix}:webwake:{tag}"
        self._wake_key = self.wake_key.encode()
        self._wake_id: bytes | str = "0-0"
        self.checkpoints = delivery.Checkpoints(delivery.checkpoint_key(WEB_ID))
        self._url = settings.REDIS_URL
        self._subs: dict[bytes, list[Subscription]] = {}
        self._task: asyncio.Task[None] | None = None
        self._wakers: set[asyncio.Task[None]] = set()
        self._idle = asyncio.Event()
        self._sent_at: float | None = None  # monotonic time the read in flight was sent
        self._block_s = BLOCK_S  # how long the read in flight blocks
        self._ok = True  # the last read succeeded
        self._woken = False  # a wake-up was sent during the read in flight
        self._found = True  # the last round returned entries

    def streams(self) -> set[str]:
        """The streams it reads."""
        return {key.decode() for key in self._subs}

    def subscribe(self, stream: str, last_id: bytes | str = "0-0") -> Subscription:
        """Start reading ``stream`` after the entry ``last_id`` (``0-0``: from its start)."""
        sub = Subscription(self, stream, last_id)
        self._subs.setdefault(sub.key, []).append(sub)
        self.ensure_running()
        self.wake()
        return sub

    def remove(self, sub: Subscription) -> None:
        subs = self._subs.get(sub.key, [])
        if sub in subs:
            subs.remove(sub)
            if not subs:
                del self._subs[sub.key]

    def healthy(self, now: float) -> bool:
        """Whether its last read succeeded and the one in flight is not late."""
        return (self._ok and self._sent_at is not None
                and now - self._sent_at < self._block_s + LATE_S)

    def ensure_running(self) -> None:
        """Start the reader's task if it is not running (first use, or it died)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(),
                                                                name="web-event-reader")
            self._task.add_done_callback(self._ended)

    def wake(self) -> None:
        """Have the reader name every subscription now, not after the read in flight."""
        self._idle.set()
        if self._sent_at is None or self._woken:
            return  # not reading: its next read names them all; or woken already
        self._woken = True
        task = asyncio.get_running_loop().create_task(self._send_wake())
        self._wakers.add(task)
        task.add_done_callback(self._wakers.discard)

    async def _send_wake(self) -> None:
        try:
            pipe = aredis().pipeline(transaction=False)
            pipe.xadd(self.wake_key, {"w": "1"}, maxlen=1, approximate=False)
            pipe.expire(self.wake_key, WAKE_TTL_S)
            await pipe.execute()
        except redis.exceptions.RedisError as exc:  # the reader meets the outage itself
            log.debug("could not wake the event reader: %s", exc)

    def _ended(self, task: asyncio.Task[None]) -> None:
        """The reader's task ended (it never returns): tell its subscriptions."""
        self._sent_at = None
        if task.cancelled():
            error = ReaderFailed("the event reader was cancelled")
        else:
            cause = task.exception()
            log.error("the web event reader failed; the next read starts a new one",
                      exc_info=cause)
            error = ReaderFailed(f"the event reader failed: {cause!r}")
        for subs in list(self._subs.values()):
            for sub in subs:
                sub.fail(_copy(error))

    def _plan(self) -> list[_Read]:
        """The reads of the next round; the wake stream goes with the last one."""
        reads = [_Read()]
        for key, subs in self._subs.items():
            served = []
            for sub in subs:
                sub.skipped = sub.backlog >= MAX_BACKLOG
                if not sub.skipped:
                    served.append(sub)
            if not served:
                continue
            if len(reads[-1].streams) >= MAX_KEYS_PER_READ:
                reads.append(_Read())
            reads[-1].streams[key] = min((sub.last_id for sub in served), key=_id)
            reads[-1].subs.extend(served)
        reads[-1].streams[self._wake_key] = self._wake_id
        return reads

    async def _xread(self, connection: WireConnection, reads: list[_Read]) -> list:
        # One round trip: the loop's checkpoints when due, then the reads. A read alone blocks;
        # of several, only the last, and only after a round that found nothing (else the others'
        # streams would wait for its block).
        self._block_s = BLOCK_S if len(reads) == 1 else 0.0 if self._found else SHORT_BLOCK_S
        batch = self.checkpoints.due(time.monotonic())
        commands = [] if batch is None else self.checkpoints.commands(batch)
        for i, read in enumerate(reads):
            block = int(self._block_s * 1000) if i == len(reads) - 1 else 0
            commands.append(("XREAD", "COUNT", COUNT, *(("BLOCK", block) if block else ()),
                             "STREAMS", *read.streams, *read.streams.values()))
        replies = await connection.round_trip(commands)
        if batch is not None:
            self.checkpoints.written(batch)
        return replies[len(commands) - len(reads):]

    def _dispatch(self, reads: list[_Read], replies: list) -> None:
        now = time.monotonic()
        found: dict[bytes, list[Entry]] = {}
        for reply in replies:  # XREAD's, as RESP2 sends it: [[key, [[id, [f, v, ...]], ...]]]
            for key, entries in reply or ():
                found[key] = [(entry_id, dict(zip(flat[::2], flat[1::2], strict=True)))
                              for entry_id, flat in entries]
        wake = found.pop(self._wake_key, None)
        if wake:
            self._wake_id = wake[-1][0]
        self._found = bool(found)
        for read in reads:
            for sub in read.subs:
                if sub.closed:
                    continue
                entries = found.get(sub.key, [])
                if entries and read.streams[sub.key] != sub.last_id:  # read from another's id
                    after = _id(sub.last_id)
                    entries = [entry for entry in entries if _id(entry[0]) > after]
                sub.give(entries, now)

    async def _run(self) -> None:
        connection = WireConnection(self._url, self.client_name)
        failures = 0
        try:
            while True:
                if not self._subs:
                    self._idle.clear()
                    await self._idle.wait()
                    continue
                reads = self._plan()
                self._sent_at, self._woken = time.monotonic(), False
                try:
                    replies = await self._xread(connection, reads)
                except REDIS_DOWN as exc:
                    raise_if_cancelled()
                    self._ok = False
                    self._sent_at = None
                    for subs in list(self._subs.values()):
                        for sub in subs:
                            sub.fail(_copy(exc))
                    await asyncio.sleep(OUTAGE_BACKOFF_S[min(failures, len(OUTAGE_BACKOFF_S) - 1)])
                    failures += 1
                    continue
                raise_if_cancelled()
                self._sent_at, self._ok, failures = None, True, 0
                self._dispatch(reads, replies)
        finally:
            self._sent_at = None
            connection.close()


_readers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, EventReader] = (
    weakref.WeakKeyDictionary())


def current() -> EventReader:
    """The event reader of the running event loop (started by its first subscription)."""
    loop = asyncio.get_running_loop()
    reader = _readers.get(loop)
    if reader is None:
        reader = _readers[loop] = EventReader()
    return reader


def subscribe(stream: str, last_id: bytes | str = "0-0") -> Subscription:
    """Read ``stream`` after the entry ``last_id`` with the running loop's reader; close the
    subscription (:meth:`Subscription.close`) when done with it."""
    return current().subscribe(stream, last_id)
