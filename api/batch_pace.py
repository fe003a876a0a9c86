"""When a batch in progress is stepped, and which of its running lines a step reads.

Every end of a batch line's request adds its id to the batch's *ended set* in Redis
(``{p}:fq:batch_ended:{batch id}``, written by the shared queue's ``fq_finish`` with the final
event, so with every end whoever writes it: its worker, a reclaim, a withdrawal). A batch
``in_progress`` is stepped (:func:`plan`):

- with a **full scan** (each running line's stream looked at by ``api.batch_runner``) when its
  last full scan is more than ``BATCH_SCAN_INTERVAL_S`` old (the *scanned* marker
  ``{p}:batch_scanned:{batch id}`` has expired), or its last step left lines it could have fed
  and did not (a limit held them back, its time ran out, or lines refused as they were sent
  left their slots free: the marker is dropped); the scan also finds what no end announces (a
  request Redis lost, a stream that expired unread);
- else **on the ended ones only**, once at least :func:`min_ended` of its lines ended since
  (an eighth of ``BATCH_LINES_IN_FLIGHT``, at least one), or every line its last step left
  running (the marker's value; a batch's last lines do not wait for the scan): the step reads
  those lines alone and feeds as many new ones;
- else not at all this time: a check costs one Redis round trip for all batches.

A batch in any other active status (validating, finalizing, cancelling) is stepped every time,
with a full scan, even while Redis cannot be read. Redis losing the keys only makes the next step
a full one.

Why: a step costs the Celery process CPU time (tens of milliseconds with a 64-line scan) which,
on a machine the engine shares, lengthens the engine pass it lands on; one a second beside
interactive traffic, where a line ends every second or so, lengthened about 3 % of the
interactive passes by about 20 ms (``docs/benchmarks.md``, section 11). Stepped on what ended,
a batch is stepped as often as before when its lines end quickly (an idle platform) and seldom
when they end slowly, each step doing the same work per line.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import redis

from api.models import Batch
from gateway.conf import platform_settings, redis_keys

# A batch is stepped on its ended lines once this share of its lines in flight ended.
ENDED_SHARE = 1 / 8


def ended_key(batch_id: str) -> str:
    """The batch's ended set (request ids), written by ``fq_finish``."""
    return redis_keys().fq("batch_ended", batch_id)


def scanned_key(batch_id: str) -> str:
    """The batch's scanned marker: present while its last full scan is recent."""
    return f"{redis_keys().prefix}:batch_scanned:{batch_id}"


def min_ended() -> int:
    """Ended lines that make a batch's step due (an eighth of ``BATCH_LINES_IN_FLIGHT``, >= 1)."""
    return max(1, int(platform_settings()["BATCH_LINES_IN_FLIGHT"] * ENDED_SHARE))


def plan(rows: Sequence[tuple[str, str]], client: redis.Redis) -> dict[str, bool]:
    """Which of the active batches ``rows`` (``(id, status)``, in their order) step now, each
    with whether its step is a full scan (True) or reads its ended lines only (False).

    Raises:
        redis.RedisError: Redis is unreachable.
    """
    in_progress = [pk for pk, status in rows if status == Batch.Status.IN_PROGRESS]
    found: dict[str, tuple[int | None, int]] = {}  # its lines running (None: scan due), ended
    if in_progress:
        with client.pipeline(transaction=False) as pipe:
            for pk in in_progress:
                pipe.get(scanned_key(pk))
                pipe.scard(ended_key(pk))
            replies = pipe.execute()
        found = {pk: (None if replies[2 * i] is None else int(replies[2 * i]),
                      int(replies[2 * i + 1])) for i, pk in enumerate(in_progress)}
    due: dict[str, bool] = {}
    least = min_ended()
    for pk, _status in rows:
        running, ended_now = found.get(pk, (None, 0))
        if running is None:
            due[pk] = True
        elif ended_now >= min(least, max(running, 1)):
            due[pk] = False
    return due


def ended(batch_id: str, client: redis.Redis) -> set[str]:
    """The request ids in the batch's ended set.

    Raises:
        redis.RedisError: Redis is unreachable.
    """
    return {m.decode() if isinstance(m, bytes) else m
            for m in client.smembers(ended_key(batch_id))}


def settled(batch_id: str, request_ids: Iterable[str], *, full: bool, fed_all: bool,
            running: int, client: redis.Redis) -> None:
    """After a step of the batch committed: the ended ids it read leave the set; a full scan
    that fed every line it could marks the batch scanned for ``BATCH_SCAN_INTERVAL_S``, with
    its lines now ``running`` (a step on the ended ones updates that number and keeps the
    mark's expiry), and a step that left lines unfed drops the mark (the next step is a full
    one).

    Raises:
        redis.RedisError: Redis is unreachable (the ids are read again by the next step, which
            finds their lines settled).
    """
    ids = list(request_ids)
    interval_ms = max(1, int(platform_settings()["BATCH_SCAN_INTERVAL_S"] * 1000))
    with client.pipeline(transaction=False) as pipe:
        if ids:
            pipe.srem(ended_key(batch_id), *ids)
        if not fed_all:
            pipe.delete(scanned_key(batch_id))
        elif full:
            pipe.set(scanned_key(batch_id), running, px=interval_ms)
        else:
            pipe.set(scanned_key(batch_id), running, xx=True, keepttl=True)
        pipe.execute()
