"""Housekeeping of the protocol's Redis keys: what would otherwise be kept for ever."""

from __future__ import annotations

import time

import redis

from gateway.conf import redis_keys
from inference.protocol import CONSUMER_GROUP, EVENTS_TTL_S


def _stream_id(entry_id: bytes | str) -> tuple[int, int]:
    """``(milliseconds, sequence)`` of a stream entry id."""
    value = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = value.partition("-")
    return int(ms), int(seq or 0)


def _stream_id_ms(entry_id: bytes | str) -> int:
    return _stream_id(entry_id)[0]


def _trim_requests_stream(client: redis.Redis, stream: str, now_ms: int, retention_s: float,
                          dead_worker_after_s: float) -> tuple[int, int]:
    """Trim one tier's requests stream and drop its group's dead consumers.

    Returns:
        (entries trimmed, consumers deleted).
    """
    try:
        groups = client.xinfo_groups(stream)
    except redis.ResponseError:  # no stream
        return 0, 0
    group = next((g for g in groups if g["name"] in (CONSUMER_GROUP, CONSUMER_GROUP.encode())),
                 None)
    if group is None:
        return 0, 0
    # Everything before the first unread or unacknowledged entry is done with.
    ms, seq = _stream_id(group["last-delivered-id"])
    keep_from = (ms, seq + 1)
    pending = client.xpending(stream, CONSUMER_GROUP)
    if pending["pending"]:
        keep_from = min(keep_from, _stream_id(pending["min"]))
    keep_from = min(keep_from, (now_ms - int(retention_s * 1000), 0))
    trimmed = client.xtrim(stream, minid=f"{keep_from[0]}-{keep_from[1]}", approximate=False)
    consumers = 0
    for consumer in client.xinfo_consumers(stream, CONSUMER_GROUP):
        if consumer["pending"] == 0 and consumer["idle"] > dead_worker_after_s * 1000:
            client.xgroup_delconsumer(stream, CONSUMER_GROUP, consumer["name"])
            consumers += 1
    return trimmed, consumers


def trim_redis(client: redis.Redis, *, retention_s: float,
               dead_worker_after_s: float) -> dict[str, int]:
    """Trim what Redis would otherwise keep for ever; return how many of each were removed.

    - entries of each priority tier's requests stream that every worker has read and
      acknowledged, once older than ``retention_s`` (a stream is never trimmed past an unread or
      unacknowledged entry);
    - events streams left without an expiry whose last event is older than their TTL;
    - heartbeats of workers silent for ``dead_worker_after_s`` (seconds), and the consumers of
      every tier's group idle that long that hold no unacknowledged entry.

    The tier registry and the (possibly empty) tier streams themselves are kept: a tier's
    stream and group are where its next request goes.
    """
    keys = redis_keys()
    now_ms = int(time.time() * 1000)
    result = {"requests_trimmed": 0, "event_streams": 0, "dead_workers": 0, "consumers": 0}

    for _, score in client.zrange(keys.request_tiers, 0, -1, withscores=True):
        trimmed, consumers = _trim_requests_stream(
            client, keys.requests(int(score)), now_ms, retention_s, dead_worker_after_s)
        result["requests_trimmed"] += trimmed
        result["consumers"] += consumers

    for name in client.scan_iter(match=keys.events("*"), count=500, _type="stream"):
        if client.ttl(name) != -1:
            continue  # expires on its own
        last = client.xrevrange(name, count=1)
        if not last or now_ms - _stream_id_ms(last[0][0]) > EVENTS_TTL_S * 1000:
            client.delete(name)
            result["event_streams"] += 1

    result["dead_workers"] = client.zremrangebyscore(
        keys.workers, "-inf", time.time() - dead_worker_after_s)
    return result
