"""Generations that outlive their reader for a grace period, and their end when none comes back.

A reader that may come back (a chat page that reloads, a socket that drops, a web process that
restarts) registers its request here instead of aborting it when it leaves. The state lives in
Redis, not in the process that held the reader:

- ``{prefix}:grace`` (sorted set): request id -> the unix time its grace period ends. An
  attached reader pushes it forward every :data:`REFRESH_S` (:func:`refresh`: now +
  max(grace, :data:`ATTACHED_LEASE_S`)); a reader that leaves sets it to now + grace
  (:func:`detach`); a process that dies stops pushing it, so its readers' grace periods start
  from its last push.
- ``{prefix}:grace:info`` (hash): request id -> JSON ``{"kind", "data", "epoch", "admission"}``:
  who finishes the request (the sender of :data:`unattended_end`), the owner's own fields, the
  Redis epoch it was queued in, and what it reserved at admission (``meta["admission"]``).
- ``{prefix}:grace:ending`` (hash): request id -> the unix time its grace period ran out.

:func:`sweep` runs in every web process's monitor (:func:`gateway.housekeeping.asweep`) and in
the Celery beat sweep (:func:`gateway.tasks.sweep_queue`). A request whose grace period ran out is
claimed (atomically: :data:`CLAIM_LUA`) and aborted as when a client leaves; its reservations
are then settled and its leases released with its usage, as for any request that ends
(``fq_finish``, :mod:`gateway.usage`). Once its final event is in its stream (or
:data:`STOP_WAIT_S` after the abort without one; then its leases are released here) the owner is
told through :data:`unattended_end` to store what was generated, and the entry is forgotten. A
request already ended when its grace period runs out is not aborted, only stored.

Every step is idempotent and a claim is atomic, so sweepers running at once, or a reader coming
back just as the grace period ends, change nothing twice; the owner's store must be conditional
(store only what is still unfinished).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import django.dispatch
import redis

from gateway.aborts import abort_sync
from gateway.clients import aredis, sync_redis
from gateway.conf import redis_keys
from gateway.scripts import LuaScript
from inference.protocol.events import Event, FinalEvent, decode_event
from inference.protocol.keys import EVENTS_TTL_S

log = logging.getLogger(__name__)

# An attached reader pushes its request's deadline forward this often (seconds)...
REFRESH_S = 1.0
# ... to at least this far ahead: a reader's process that dies gives it this long at least.
ATTACHED_LEASE_S = 3.0
# After the abort of a request whose grace period ran out, how long to wait for its final event
# before storing what its stream holds (seconds); it is checked again every SWEEP_RECHECK_S.
STOP_WAIT_S = 5.0
SWEEP_RECHECK_S = 0.5
# Entries handled per sweep (the rest wait for the next one).
SWEEP_BATCH = 64

# Sent (by kind) when a request whose grace period ran out has ended, or is given up:
# ``request_id``, ``data`` (the owner's fields), ``events`` (its stream: the events generated,
# the final one last when there is one) and ``final`` (None: no final event came). The receiver
# stores the answer if it is not stored yet; raising leaves the entry for the next sweep.
unattended_end = django.dispatch.Signal()

# KEYS: grace, info, ending. ARGV: now, recheck_at, limit.
# Returns [id, info, ending_since, first, ...] for each due entry, rescheduled to recheck_at;
# ``first`` is 1 for an entry whose grace period runs out in this call.
CLAIM_LUA = LuaScript("""
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[3]))
local out = {}
for _, id in ipairs(due) do
  local info = redis.call('HGET', KEYS[2], id)
  if not info then
    redis.call('ZREM', KEYS[1], id)
    redis.call('HDEL', KEYS[3], id)
  else
    local since = redis.call('HGET', KEYS[3], id)
    local first = 0
    if not since then
      since = ARGV[1]
      first = 1
      redis.call('HSET', KEYS[3], id, since)
    end
    redis.call('ZADD', KEYS[1], ARGV[2], id)
    table.insert(out, id)
    table.insert(out, info)
    table.insert(out, since)
    table.insert(out, first)
  end
end
return out
""")

# KEYS: grace, info, ending. ARGV: id, deadline. Push the deadline of a live entry to ARGV[2].
# Returns nil (no entry), or [info, 'live' | 'ending'] (an ending entry is left as it is).
ATTACH_LUA = LuaScript("""
local info = redis.call('HGET', KEYS[2], ARGV[1])
if not info then return nil end
if redis.call('HEXISTS', KEYS[3], ARGV[1]) == 1 then return {info, 'ending'} end
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
return {info, 'live'}
""")


def _keys() -> list[str]:
    prefix = redis_keys().prefix
    return [f"{prefix}:grace", f"{prefix}:grace:info", f"{prefix}:grace:ending"]


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def attached_deadline(grace_s: float, now: float | None = None) -> float:
    """The deadline an attached reader keeps its request at (unix time)."""
    return (time.time() if now is None else now) + max(grace_s, ATTACHED_LEASE_S)


async def hold(request_id: str, kind: str, grace_s: float, *, data: dict[str, Any] | None = None,
               epoch: str | None = None, admission: dict[str, Any] | None = None) -> None:
    """Register (or update) ``request_id`` as held by an attached reader.

    Args:
        kind: the :data:`unattended_end` sender that finishes it.
        grace_s: how long it may go on without a reader (seconds).
        data: the owner's fields, handed back to its receiver (JSON).

    Raises:
        redis.RedisError: Redis unreachable.
    """
    grace, info, ending = _keys()
    entry = json.dumps({"kind": kind, "data": data or {}, "epoch": epoch,
                        "admission": admission or {}})
    pipe = aredis().pipeline(transaction=True)
    pipe.hset(info, request_id, entry)
    pipe.zadd(grace, {request_id: attached_deadline(grace_s)})
    pipe.hdel(ending, request_id)
    await pipe.execute()


async def attach(request_id: str, deadline: float) -> tuple[dict[str, Any], bool] | None:
    """Push the grace deadline of ``request_id`` to ``deadline`` (unix time) unless it ran out.

    Returns:
        None when the request is not held (ended and forgotten, or never held); else its info
        and whether it is still live (False: its grace period ran out and it is being ended).
    """
    reply = await ATTACH_LUA.arun(aredis(), 3, *_keys(), request_id, deadline)
    if reply is None:
        return None
    return json.loads(reply[0]), _text(reply[1]) == "live"


async def refresh(request_id: str, grace_s: float) -> bool:
    """An attached reader's push (:func:`attached_deadline`); whether the request is live."""
    held = await attach(request_id, attached_deadline(grace_s))
    return held is not None and held[1]


async def detach(request_id: str, grace_s: float) -> None:
    """The reader left: the request goes on for ``grace_s`` seconds from now."""
    await attach(request_id, time.time() + grace_s)


async def forget(request_id: str) -> None:
    """The request ended and its owner stored it: drop its entry (idempotent)."""
    grace, info, ending = _keys()
    pipe = aredis().pipeline(transaction=True)
    pipe.zrem(grace, request_id)
    pipe.hdel(info, request_id)
    pipe.hdel(ending, request_id)
    await pipe.execute()


async def is_held(request_id: str) -> bool:
    """Whether ``request_id`` is held (generating, or ended and not yet stored)."""
    return bool(await aredis().hexists(_keys()[1], request_id))


async def due(client=None, now: float | None = None) -> bool:
    """Whether some entry's deadline has passed (a cheap check before :func:`sweep`)."""
    now = time.time() if now is None else now
    return bool(await (client or aredis()).zrangebyscore(_keys()[0], "-inf", now, start=0,
                                                         num=1))


def stream_events(request_id: str, client: redis.Redis | None = None) -> list[Event]:
    """The events in the request's stream, up to and including its final one if written."""
    return _until_final((client or sync_redis()).xrange(redis_keys().events(request_id)))


def streams_events(request_ids: list[str], client: redis.Redis | None = None
                   ) -> list[list[Event]]:
    """:func:`stream_events` of each request, in one round trip (a pipeline)."""
    if not request_ids:
        return []
    with (client or sync_redis()).pipeline(transaction=False) as pipe:
        for request_id in request_ids:
            pipe.xrange(redis_keys().events(request_id))
        return [_until_final(entries) for entries in pipe.execute()]


def _until_final(entries: list) -> list[Event]:
    events: list[Event] = []
    for _, fields in entries:
        event = decode_event(fields)
        events.append(event)
        if isinstance(event, FinalEvent):
            break
    return events


def _release_leases(admission: dict[str, Any], client: redis.Redis) -> None:
    """Give back the concurrency leases of a request given up without a final event."""
    names = admission.get("concurrency_keys") or []
    if names:
        pipe = client.pipeline(transaction=False)
        for name in names:
            pipe.zrem(name, admission.get("member", ""))
        pipe.execute()


def _forget(request_id: str, client: redis.Redis) -> None:
    grace, info, ending = _keys()
    pipe = client.pipeline(transaction=True)
    pipe.zrem(grace, request_id)
    pipe.hdel(info, request_id)
    pipe.hdel(ending, request_id)
    pipe.execute()


def sweep(client: redis.Redis | None = None, now: float | None = None) -> int:
    """End the requests whose grace period ran out (see the module docstring); returns how many
    were stored and forgotten in this call.

    Raises:
        redis.RedisError: Redis unreachable (the next sweep goes on where this one stopped).
    """
    client = client or sync_redis()
    now = time.time() if now is None else now
    reply = CLAIM_LUA.run(client, 3, *_keys(), now, now + SWEEP_RECHECK_S, SWEEP_BATCH)
    finished = 0
    for i in range(0, len(reply), 4):
        request_id, raw, since, first = (_text(reply[i]), reply[i + 1], float(reply[i + 2]),
                                         int(reply[i + 3]))
        try:
            info = json.loads(raw)
            events = stream_events(request_id, client)
            final = events[-1] if events and isinstance(events[-1], FinalEvent) else None
            if final is None:
                if first:
                    log.info("request %s had no reader for its grace period: aborting it",
                             request_id)
                abort_sync(request_id, client)  # again at each recheck: idempotent
            if final is None and now - since < STOP_WAIT_S:
                continue  # its final event comes within a tick or two
            if final is None:
                log.warning("no final event for %s %.0f s after its abort: storing what it "
                            "generated", request_id, now - since)
                _release_leases(info.get("admission") or {}, client)
            unattended_end.send(sender=info.get("kind", ""), request_id=request_id,
                                data=info.get("data") or {}, events=events, final=final)
        except redis.RedisError:
            raise
        except Exception:  # noqa: BLE001 - retried at the next sweep, for a while
            log.exception("could not end the unattended request %s", request_id)
            if now - since < EVENTS_TTL_S:
                continue
        _forget(request_id, client)
        finished += 1
    return finished
