"""Housekeeping of the protocol's Redis keys: what would otherwise be kept for ever.

The shared queue cleans up after itself (a request leaves it when taken, withdrawn or expired; a
dead worker's requests are reclaimed by the live workers), and most keys expire. What is left is
an events stream whose expiry was never set (a writer that died between its two commands).
"""

from __future__ import annotations

import time

import redis

from gateway.conf import redis_keys
from inference.protocol import EVENTS_TTL_S


def _stream_id_ms(entry_id: bytes | str) -> int:
    """The milliseconds part of a stream entry id (``ms-seq``)."""
    value = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(value.partition("-")[0])


def trim_redis(client: redis.Redis) -> dict[str, int]:
    """Delete events streams left without an expiry whose last event is older than their TTL.

    Returns:
        ``{"event_streams": how many were deleted}``.
    """
    keys = redis_keys()
    now_ms = int(time.time() * 1000)
    deleted = 0
    for name in client.scan_iter(match=keys.events("*"), count=500, _type="stream"):
        if client.ttl(name) != -1:
            continue  # expires on its own
        last = client.xrevrange(name, count=1)
        if not last or now_ms - _stream_id_ms(last[0][0]) > EVENTS_TTL_S * 1000:
            client.delete(name)
            deleted += 1
    return {"event_streams": deleted}
