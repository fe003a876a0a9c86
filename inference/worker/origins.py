"""Whether the web process streaming a request is alive, as one worker judges it.

Each web process beats in the ``{prefix}:web`` sorted set (``WEB_HEARTBEAT_TTL_S``); a request's
message names the process that admitted it (its origin). A worker stops the generations whose
origin is gone (nobody reads their answers) and ends unstarted ones at once
(:mod:`inference.worker.intake`, :mod:`inference.worker.recovery`; ``docs/design.md``, "Faults").
It judges each heartbeat against its own sight of Redis (:mod:`inference.protocol.liveness`):
for a TTL after Redis stopped answering it (or after it was paused), no web process is gone,
and when every web process's heartbeat is stale at once, the silence is taken for an outage.
"""

from __future__ import annotations

import time

import redis

from inference.protocol.keys import Keys
from inference.protocol.liveness import declares_dead
from inference.worker.live import WorkerState

# Origins first seen without a heartbeat that are remembered, at most (then forgotten at once).
MAX_MISSING_ORIGINS = 10_000


class WebOrigins:
    """Judges web processes by their heartbeats (main thread).

    Args:
        state: the worker's shared state (its sight of Redis).
        client: a Redis client.
        keys: key names.
        web_ttl_s: a web process whose heartbeat is older than this (seconds) is gone.
    """

    def __init__(self, state: WorkerState, client: redis.Redis, keys: Keys, web_ttl_s: float):
        self.state = state
        self.client = client
        self.keys = keys
        self.web_ttl_s = web_ttl_s
        # Origins first seen without a heartbeat: origin -> monotonic time.
        self._missing: dict[str, float] = {}

    def alive(self, origin: str) -> bool:
        """Whether the web process ``origin`` is alive: its heartbeat is younger than
        ``web_ttl_s``, or this worker cannot tell it dead
        (:func:`inference.protocol.liveness.declares_dead`: its own sight of Redis is shorter
        than the TTL, or every web heartbeat is stale at once). One never seen counts as alive
        for ``web_ttl_s`` from when it was first missed.

        Raises:
            redis.RedisError: Redis is unreachable.
        """
        sight_s = self.state.sight.seconds()
        if not origin or sight_s < self.web_ttl_s:
            return True  # (just after an outage, no web process could beat: not judged)
        asked = time.monotonic()
        beat = self.client.zscore(self.keys.web, origin)
        now = time.time()
        if beat is not None:
            self._missing.pop(origin, None)
            age = now - float(beat)
            if age <= self.web_ttl_s:
                return True
            freshest = self.client.zrevrange(self.keys.web, 0, 0, withscores=True)
            if time.monotonic() - asked > self.web_ttl_s / 2:
                # Answers that long in coming crossed an outage (Redis stopped with the calls
                # sent): the sight measured before them says nothing of it.
                return True
            freshest_age = now - float(freshest[0][1]) if freshest else age
            return not declares_dead(age, freshest_age, sight_s, self.web_ttl_s)
        first = self._missing.setdefault(origin, time.monotonic())
        if len(self._missing) > MAX_MISSING_ORIGINS:
            self._missing.clear()
        return time.monotonic() - first <= self.web_ttl_s
