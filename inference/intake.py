"""How a worker takes requests from Redis: the priority tiers' streams, highest tier first.

Requests wait on one stream per priority (``{prefix}:requests:{priority}``, see
:mod:`inference.protocol`), each read through the consumer group ``workers`` that every worker
shares. :class:`RequestIntake` takes at most the room its worker has, from the highest tier down,
so a backlog of a lower tier never stands in front of a later request of a higher one; it puts
back what its worker cannot take. Only the worker's main thread uses it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import redis
from pydantic import ValidationError

from inference.protocol import CONSUMER_GROUP, ENQUEUE_LUA, Keys, RequestMessage

log = logging.getLogger(__name__)

Take = Callable[[RequestMessage], None]


class RequestIntake:
    """Reads requests for one worker.

    Args:
        client: a Redis client (``decode_responses=False``).
        keys: key names.
        consumer: this worker's consumer name in the group.
        take: called with each valid request read; a malformed entry is dropped (and its place
            in gate 1 given back).
    """

    def __init__(self, client: redis.Redis, keys: Keys, consumer: str, take: Take):
        self.client = client
        self.keys = keys
        self.consumer = consumer
        self.take = take
        # Requests streams whose consumer group this worker made sure of -> their priority.
        self._tier_of: dict[str, int] = {}
        self._enqueue = client.register_script(ENQUEUE_LUA)

    def tiers(self) -> list[tuple[int, str]]:
        """``(priority, stream)`` of every registered tier, highest priority first.

        A tier seen for the first time gets its consumer group (normally made by the enqueue
        already; this covers a stream deleted by hand).
        """
        tiers = []
        for _, score in self.client.zrevrange(self.keys.request_tiers, 0, -1, withscores=True):
            priority = int(score)
            stream = self.keys.requests(priority)
            if stream not in self._tier_of:
                try:
                    self.client.xgroup_create(stream, CONSUMER_GROUP, id="0", mkstream=True)
                except redis.ResponseError as exc:
                    if "BUSYGROUP" not in str(exc):
                        raise
                self._tier_of[stream] = priority
            tiers.append((priority, stream))
        return tiers

    def forget_tiers(self) -> None:
        """Make sure of every tier's consumer group again on the next read."""
        self._tier_of.clear()

    def poll(self, room: int, block_ms: int = 50) -> int:
        """Take up to ``room`` requests, highest priority first; return how many were read.

        The tiers' streams are read one at a time from the highest priority down, each for the
        room the higher ones left. When no tier has a request waiting, it blocks up to
        ``block_ms`` on every tier's stream at once and takes the first to arrive. With no room,
        or no tier registered yet, it sleeps ``block_ms`` instead.
        """
        tiers = self.tiers() if room > 0 else []
        if not tiers:
            time.sleep(block_ms / 1000)
            return 0
        taken = 0
        for _, stream in tiers:
            for name, entries in self._read({stream: ">"}, room - taken):
                taken += self._consume(name, entries)
            if taken >= room:
                return taken
        if taken:
            return taken
        # Nothing waiting. Requests that reached several tiers since the reads above come back
        # together, one per tier at most: the highest are taken, any past the room handed back.
        reply = self._read({stream: ">" for _, stream in tiers}, 1, block_ms)
        reply.sort(key=lambda item: self._tier_of.get(item[0], 0), reverse=True)
        for name, entries in reply:
            if taken >= room:
                for entry_id, fields in entries:
                    self._hand_back_entry(name, entry_id, fields)
                continue
            taken += self._consume(name, entries)
        return taken

    def requeue(self, message: RequestMessage) -> None:
        """Put a request back on its own tier's stream for any worker (still in gate 1)."""
        priority = int(message.priority)
        self._enqueue(keys=[self.keys.requests(priority), self.keys.request_tiers],
                      args=[str(priority), CONSUMER_GROUP, message.to_json()])

    def _read(self, streams: dict[str, str], count: int,
              block_ms: int | None = None) -> list[tuple[str, list]]:
        """XREADGROUP: ``[(stream, [(entry_id, fields), ...]), ...]``, empty when none waits."""
        try:
            reply = self.client.xreadgroup(CONSUMER_GROUP, self.consumer, streams, count=count,
                                           block=block_ms)
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            # A stream (and its group) was deleted: make sure of every group on the next poll.
            log.warning("requests stream without its consumer group: %s", exc)
            self.forget_tiers()
            return []
        if not reply:
            return []
        items = reply.items() if isinstance(reply, dict) else reply
        return [(name.decode() if isinstance(name, bytes) else name, entries)
                for name, entries in items]

    def _consume(self, stream: str, entries: list) -> int:
        """Take (or drop, if malformed) and acknowledge entries read from ``stream``."""
        for entry_id, fields in entries:
            try:
                message = RequestMessage.from_json(fields.get(b"data", b""))
            except ValidationError:
                log.exception("dropping malformed request message %s", entry_id)
                self.client.decr(self.keys.queue)
            else:
                self.take(message)
            self.client.xack(stream, CONSUMER_GROUP, entry_id)
        return len(entries)

    def _hand_back_entry(self, stream: str, entry_id: Any, fields: dict) -> None:
        """Put an entry read but not taken back at the end of its stream (still in gate 1)."""
        pipe = self.client.pipeline(transaction=True)
        pipe.xadd(stream, fields)
        pipe.xack(stream, CONSUMER_GROUP, entry_id)
        pipe.execute()
