"""How every process judges another's heartbeat: against its own sight of Redis.

A heartbeat (a worker's in ``{prefix}:workers``, a web process's in ``{prefix}:web``) older than
its TTL means its process died, unless Redis itself stopped answering meanwhile: then nobody
could beat, and every heartbeat ages at once. A process paused or hung behind Redis learns
nothing from its clock either. So each judge keeps a :class:`RedisSight`, fed with each answer
Redis gives it, and declares deaths only by :func:`declares_dead`:

- the judge must have seen Redis answer without a break for a whole TTL (a break: a stretch of
  more than half the TTL without an answer: a call that hung, a judge that was paused, a Celery
  task whose broker was down and so did not run); a judge that just started has no sight yet;
- when every heartbeat is stale at once (the freshest one too), the silence is taken for an
  outage, not for deaths, unless the judge saw Redis without a break for the whole silence (then
  the processes could have beaten and did not), or, after an outage it did see, for twice the
  TTL. So the death of the only worker is declared one TTL after its last beat by a judge whose
  sight was continuous, and within two TTLs of the end of an outage between.

``inference/protocol/lua/reclaim.lua`` applies the same rule to the workers' heartbeats, with the
judge's :meth:`RedisSight.seconds` as its argument. A TTL should be at least twice the heartbeat
interval (10 s and 1 s by default): a break shorter than half the TTL goes unseen.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class RedisSight:
    """How long one process has seen Redis answer without a break.

    Args:
        gap_s: the longest stretch without an answer that is not a break (seconds; half the
            shortest heartbeat TTL the process judges).
        clock: monotonic seconds (tests may give their own).
    """

    def __init__(self, gap_s: float, clock: Callable[[], float] = time.monotonic):
        self.gap_s = float(gap_s)
        self._clock = clock
        self._since: float | None = None  # start of the unbroken sight; None: none
        self._last: float | None = None  # the latest answer

    def answered(self) -> None:
        """Redis just answered this process (call it after each successful call or round)."""
        now = self._clock()
        if self._last is None or now - self._last > self.gap_s:
            self._since = now  # a break (or the first answer): the sight starts again
        self._last = now

    def lost(self) -> None:
        """A call failed (Redis unreachable): no sight until it answers again."""
        self._since = self._last = None

    def seconds(self) -> float:
        """Seconds of unbroken sight up to now: 0 with none, or when the latest answer is more
        than ``gap_s`` old (a call may be hanging)."""
        if self._since is None or self._last is None:
            return 0.0
        now = self._clock()
        if now - self._last > self.gap_s:
            return 0.0
        return now - self._since


def declares_dead(age_s: float, freshest_age_s: float, sight_s: float, ttl_s: float) -> bool:
    """Whether a heartbeat ``age_s`` seconds old is a death (the module docstring's rule).

    Args:
        age_s: the age of the heartbeat judged (seconds).
        freshest_age_s: the age of the freshest heartbeat of its kind (seconds).
        sight_s: the judge's :meth:`RedisSight.seconds`.
        ttl_s: the heartbeat TTL (seconds).
    """
    if age_s <= ttl_s or sight_s < ttl_s:
        return False
    return freshest_age_s <= ttl_s or sight_s >= min(freshest_age_s, 2 * ttl_s)
