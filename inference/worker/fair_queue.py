"""A worker's side of the shared request queue: take in the fair order, own, hand back, charge.

The queue (``inference/protocol/lua/fair_queue.lua``, see :mod:`inference.protocol`) holds every
request waiting for a worker in one order for the whole deployment: priority tier, then the fairness
key with the least weighted service (VTC, Sheng et al., OSDI 2024; counters shared by every worker),
then arrival; or priority then arrival (FCFS). Each method is one Lua script, so each change of the
queue is atomic. Only the worker's main thread calls :meth:`take`, :meth:`requeue`,
:meth:`preempt`, :meth:`charge`, :meth:`expire` and :meth:`reclaim`; the engine thread calls
:meth:`write_events` and :meth:`nudge`.

Every take of a request gives it a new take token (:attr:`QueuedRequest.take`); each write or end
of the request by its worker carries the token of the take it belongs to, and Redis refuses one
that is not the request's current take: a worker only paused (a GC pause, a stolen VM, swap)
longer than its heartbeat TTL was reclaimed meanwhile, and what it still writes for its earlier
takes, even of a request it took again since, is dropped.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis
from pydantic import ValidationError

from inference.protocol.events import Event, FinalEvent, Usage
from inference.protocol.keys import Keys, queue_script
from inference.protocol.messages import RequestMessage

log = logging.getLogger(__name__)


def _ids(values: Iterable[bytes | str]) -> list[str]:
    return [v.decode() if isinstance(v, bytes) else str(v) for v in values]


# An event and the take token of the take it belongs to, as a worker writes it.
Owned = tuple[Event, str]


class Reclaimed(Exception):  # noqa: N818 - a state, not a failure of the call
    """This worker was reclaimed while it was silent and has not registered afresh: it takes
    nothing until it has stopped what it held (:meth:`FairQueue.take`)."""


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@dataclass(frozen=True)
class QueuedRequest:
    """A request as the queue handed it to this worker: its id, fairness key, tier, arrival,
    message and take token.

    ``message`` is None when the stored message does not validate (it is then dropped).
    ``take``: the token of this take (a new one for every take of the request). ``batch``:
    a batch request, which never counts in gate 1 (its worker's held count neither).
    """

    request_id: str
    fairness_key: str
    priority: int
    arrival: int
    message: RequestMessage | None
    take: str = ""
    batch: bool = False

    @classmethod
    def from_record(cls, raw: bytes | str, take: bytes | str = "") -> QueuedRequest:
        record = json.loads(raw)
        try:
            message = RequestMessage.from_json(record["body"])
        except ValidationError:
            log.exception("dropping malformed request message %s", record.get("id"))
            message = None
        return cls(record["id"], record["key"], int(record["prio"]), int(record["seq"]),
                   message, _text(take), record.get("batch") is True)


class FairQueue:
    """The shared queue as one worker uses it.

    Args:
        client: a Redis client (``decode_responses=False``).
        keys: key names of the deployment.
        worker_id: this worker's id (its heartbeat member and consumer name).
        policy: ``vtc`` or ``fcfs``: the order this worker takes requests in.
    """

    def __init__(self, client: redis.Redis, keys: Keys, worker_id: str, policy: str):
        self.client = client
        self.keys = keys
        self.worker_id = worker_id
        self.policy = str(policy)
        self._scripts = {name: client.register_script(queue_script(name))
                         for name in ("take", "events", "requeue", "charge", "withdraw",
                                      "reclaim", "enqueue", "gate1", "preempt", "release")}
        self.wake_self = keys.fq("wake", worker_id)
        # Adapter affinity (take.lua): the LoRA adapters this worker holds loaded (digests, as
        # its last heartbeat saw them), and the most seconds a request waits for a worker that
        # holds its adapter (0: no affinity).
        self.adapters_held: tuple[str, ...] = ()
        self.affinity_s = 0.0
        self._tiers: list[int] = []
        self._tiers_read_at = float("-inf")
        # Counter updates not yet known to have arrived (release: n; charge: key -> amount):
        # the one sent last with its token, resent as it was until a reply says it arrived,
        # and what came since (sent next, under a new token).
        self._sent: dict[str, tuple[str, Any]] = {}
        self._unsent_release = 0
        self._unsent_charge: dict[str, float] = {}

    def _run(self, name: str, *args: Any) -> Any:
        return self._scripts[name](args=[self.keys.queue, *args])

    def take(self, n: int, above: int | None = None, *,
             batch_extra: int = 0) -> list[QueuedRequest]:
        """Take up to ``n`` requests in the fair order; they are this worker's until handed back.

        With ``above``, only requests of a higher tier than it are taken (the fair order's
        head first, so none when the head's tier is not higher). With ``batch_extra``, up to that
        many batch requests more once ``n`` are taken (batch work sorts after every interactive
        request, so the extra ones are the order's next ones). Each interactive one counts as
        held (gate 1) until :meth:`release_held` says its engine admitted it; each carries its
        take token.

        Raises:
            Reclaimed: this worker was reclaimed while silent; nothing was taken.
        """
        n, batch_extra = max(0, n), max(0, batch_extra)
        if n + batch_extra <= 0:
            return []
        raw = self._run("take", self.worker_id, n, self.policy,
                        "" if above is None else int(above), batch_extra,
                        ",".join(self.adapters_held), self.affinity_s)
        if not isinstance(raw, list):
            raise Reclaimed(self.worker_id)
        return [QueuedRequest.from_record(raw[i], raw[i + 1]) for i in range(0, len(raw), 2)]

    def wait(self, timeout_s: float, above: int | None = None) -> bool:
        """Block until a request is enqueued (with ``above``: in a higher tier than it) or this
        worker is nudged (:meth:`nudge`), or ``timeout_s`` passes; True if either happened.

        A worker whose rows are full waits with ``above``, so that it never takes the wake-up
        of an enqueue it would not take from a worker that would.
        """
        if above is None:
            wakes = [self.keys.fq("wake")]
        else:
            wakes = [self.keys.fq("wake_tier", t) for t in self.known_tiers() if t > above]
        return self.client.blpop([*wakes, self.wake_self], timeout=timeout_s) is not None

    def known_tiers(self) -> list[int]:
        """Every tier a request was ever queued in (read at most once a second)."""
        now = time.monotonic()
        if now - self._tiers_read_at > 1.0:
            self._tiers = sorted(int(t) for t in self.client.smembers(self.keys.fq("known_tiers")))
            self._tiers_read_at = now
        return self._tiers

    def nudge(self) -> None:
        """Wake this worker's :meth:`wait` (a row freed, a row preempted): one entry, kept
        briefly."""
        pipe = self.client.pipeline(transaction=False)
        pipe.lpush(self.wake_self, "1")
        pipe.ltrim(self.wake_self, 0, 3)
        pipe.expire(self.wake_self, 60)
        pipe.execute()

    def preempt(self, message: RequestMessage, usage: Usage, take: str) -> bool:
        """Put a request this worker preempted back at its place in the queue, with ``message``
        (its resume state) for the next worker and its ``usage`` so far; False when ``take``
        (its take token) is not the request's current take here any more (then nothing
        changed)."""
        deadline = message.deadline() or 0
        return bool(self._run("preempt", self.worker_id, message.request_id, take,
                              message.to_json(), usage.model_dump_json(), deadline))

    def requeue(self, takes: Mapping[str, str]) -> int:
        """Hand taken requests (request id -> take token) back to their places for any worker;
        return how many went back (a take no longer current is left alone)."""
        if not takes:
            return 0
        args = [part for rid, take in takes.items() for part in (rid, take)]
        return int(self._run("requeue", self.worker_id, *args))

    def release_held(self, n: int) -> bool:
        """``n`` held requests left this worker's pending queue (admitted, or ended); False
        when nothing changed: this worker was reclaimed (its held count went with it).

        Applied once in Redis whatever happens to the reply: an update whose reply was lost is
        sent again, with its token, at the next call (``n`` may be 0 for that), and Redis
        applies each token once (``fq_once``).

        Raises:
            redis.RedisError: Redis is unreachable (what was not sent goes with the next call).
        """
        self._unsent_release += n
        changed = True
        while True:
            update = self._next_update("release", self._unsent_release)
            if update is None:
                return changed
            self._unsent_release = 0
            token, count = update
            changed = bool(self._run("release", self.worker_id, count, token)) and changed
            del self._sent["release"]

    def drop_releases(self) -> None:
        """Forget the held-count updates not known to have arrived: the held count they would
        lower is gone (this worker was reclaimed, or Redis lost its data)."""
        self._unsent_release = 0
        self._sent.pop("release", None)

    def _next_update(self, kind: str, unsent: Any) -> tuple[str, Any] | None:
        """The update of ``kind`` to send now: the one sent last if no reply said it arrived,
        else what is unsent under a new token (None: nothing)."""
        if kind not in self._sent:
            if not unsent:
                return None
            self._sent[kind] = (uuid.uuid4().hex, unsent)
        return self._sent[kind]

    def write_events(self, events: Iterable[Owned], ttl_s: int,
                     prompt_tokens: Mapping[str, int] | None = None) -> set[tuple[str, str]]:
        """Append events to their requests' streams, for the takes this worker owns.

        Each event comes with the take token of the take it belongs to; one whose take is not
        the request's current take at this worker is dropped. A request's final event ends it
        (its usage entry goes to the ledger, its leases are released). Writing the same events
        again (a retry after a lost reply) writes nothing twice.

        Args:
            events: ``(event, take token)`` pairs, in order.
            prompt_tokens: request id -> its prompt's tokens, recorded with its first event (a
                request that ends with its worker is billed for its prompt).

        Returns:
            The ``(request id, take token)`` of the takes the worker no longer owns (reclaimed
            while it was silent, taken again since, or lost with Redis's data): their events
            were dropped, and the caller should stop them.
        """
        counts = prompt_tokens or {}
        args: list[Any] = []
        for event, take in events:
            args += [event.request_id, "1" if isinstance(event, FinalEvent) else "0",
                     event.seq, event.model_dump_json(), counts.get(event.request_id, ""),
                     take]
        if not args:
            return set()
        lost = _ids(self._run("events", self.worker_id, ttl_s, *args))
        return {(lost[i], lost[i + 1]) for i in range(0, len(lost), 2)}

    def charge(self, service: Mapping[str, float]) -> None:
        """Add weighted tokens (``w_in`` x computed prompt + ``w_out`` x generated, divided by
        the key's weight) to each fairness key's shared counter.

        Applied once in Redis as :meth:`release_held` is (an update whose reply was lost is
        sent again with its token at the next call; ``service`` may be empty for that).

        Raises:
            redis.RedisError: Redis is unreachable (what was not sent goes with the next call).
        """
        for key, amount in service.items():
            if amount:
                self._unsent_charge[key] = self._unsent_charge.get(key, 0.0) + float(amount)
        while True:
            update = self._next_update("charge", self._unsent_charge)
            if update is None:
                return
            self._unsent_charge = {}
            token, amounts = update
            args = [part for key, amount in amounts.items() for part in (key, repr(amount))]
            self._run("charge", self.worker_id, token, *args)
            del self._sent["charge"]

    def expire(self, ttl_s: int, limit: int = 256) -> list[str]:
        """End the waiting requests whose admission deadline has passed (``queue_timeout``).

        Returns:
            The ids of the requests ended (their usage entries are in the ledger).
        """
        return _ids(self._run("withdraw", ttl_s, "expired", limit))

    def reclaim(self, ttl_s: float, events_ttl_s: int, *, sight_s: float,
                include_self: bool = False) -> tuple[int, list[str], list[str]]:
        """Reclaim the requests of workers whose heartbeat is older than ``ttl_s``, as a judge
        that has seen Redis answer without a break for ``sight_s`` seconds judges them
        (:func:`inference.protocol.liveness.declares_dead`; none below ``ttl_s``), and, with
        ``include_self``, what an earlier process left under this worker's own id.

        Requests they took and had not started go back to their places; those they were running
        end with a retryable ``worker_lost`` error saying how many tokens their stream holds.

        Returns:
            (requests put back in the queue, the workers reclaimed, the ids of the requests
            ended: their usage entries are in the ledger).
        """
        extra = [self.worker_id] if include_self else []
        reply = self._run("reclaim", ttl_s, events_ttl_s, min(float(sight_s), 1e9),
                          time.time(), *extra)
        workers = json.loads(reply[1])  # cjson writes an empty list as {}
        return int(reply[0]), list(workers or []), _ids(reply[2:])

    def owned(self) -> tuple[list[str], list[str]]:
        """(ids this worker took and has not started, ids it runs), as the queue records them."""
        pipe = self.client.pipeline(transaction=False)
        pipe.hkeys(self.keys.fq("taken", self.worker_id))
        pipe.hkeys(self.keys.fq("running", self.worker_id))
        taken, running = pipe.execute()
        return _ids(taken), _ids(running)

    def takes(self, request_ids: Sequence[str]) -> dict[str, str]:
        """The current take token of each of ``request_ids`` that has one (taken or running)."""
        if not request_ids:
            return {}
        tokens = self.client.hmget(self.keys.fq("take"), list(request_ids))
        return {rid: _text(t) for rid, t in zip(request_ids, tokens, strict=True)
                if t is not None}

    def enqueue(self, message: RequestMessage) -> int:
        """Put a new request in the queue without the web tier's limits (tools, tests)."""
        return int(self._run("enqueue", message.request_id, message.fairness_key,
                             message.priority, message.deadline() or 0, message.to_json(),
                             message.adapter.key if message.adapter is not None else ""))

    def hold_adapters(self, digests: Sequence[str], ttl_s: float,
                      pipe: redis.client.Pipeline | None = None) -> None:
        """Say that this worker holds the LoRA adapters ``digests`` loaded, for ``ttl_s``
        seconds (its heartbeat renews it), for the queue's adapter affinity (take.lua); a
        ``pipe`` queues the write in it."""
        self.adapters_held = tuple(digests)
        if digests:
            until = f"{self.worker_id} {time.time() + ttl_s:.3f}"
            (pipe or self.client).hset(self.keys.fq("adapter_holder"),
                                       mapping=dict.fromkeys(digests, until))

    def gate1(self) -> int:
        """Requests accepted and not yet admitted by any worker."""
        return int(self._run("gate1"))
