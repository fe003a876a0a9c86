"""Admission on Redis: rate limits, concurrency, token budget and gate 1, all-or-nothing.

One Lua script checks every limit that applies to a request and, only when all pass, records the
request in each of them and puts it on its priority tier's requests stream (registering the tier
for the workers), atomically. A refused request so consumes nothing, and 20 concurrent requests
against a limit of 5 admit exactly 5. Libraries such as ``limits`` check one window at a time; the
all-or-nothing check across several windows plus the global queue counter is why this is one
script.

- rate limits (requests and tokens per minute, per key and per tenant): a moving window (a sorted
  set of the admitted requests, scored by time), so no 60-second span ever admits more than the
  limit; tokens are reserved as ``prompt + max_tokens`` and settled to the real usage afterwards.
- max concurrent requests: a sorted set of leases (scored by expiry), released when the response
  ends; a lease outlives a crashed web process by at most ``REQUEST_IDLE_TIMEOUT_S``.
- token budget per period: a counter per tenant and period, reserved and settled like tokens.
- gate 1: ``{prefix}:queue`` (see :mod:`inference.protocol`).
"""

from __future__ import annotations

import asyncio
import json
import time
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio as aioredis
from django.conf import settings

from api.conf import platform_settings, redis_keys
from api.errors import APIError
from inference.protocol import (
    ABORT_MARK_TTL_S,
    CONSUMER_GROUP,
    ControlMessage,
    RequestMessage,
    decode_event,
)
from tenants.models import ApiKey

RATE_WINDOW_MS = 60_000
XREAD_BLOCK_S = 2.0

# KEYS[1] queue counter, KEYS[2] the request's tier stream (Keys.requests(priority)), KEYS[3] the
# tier registry (Keys.request_tiers), KEYS[4..] limit keys named by index in the spec.
# ARGV[1] spec JSON, ARGV[2] request message JSON, ARGV[3] str(priority). Returns a JSON verdict.
# The enqueue at the end is inference.protocol.ENQUEUE_LUA's.
ADMIT_LUA = """
local spec = cjson.decode(ARGV[1])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function refuse(code, what, limit, used, cost, retry_ms, retryable)
  return cjson.encode({ok = false, code = code, what = what, limit = limit, used = used,
                       cost = cost, retry_after_ms = retry_ms, retryable = retryable})
end
local function member_cost(member)
  return tonumber(string.match(member, ':(%d+)$')) or 1
end

for _, b in ipairs(spec.budgets) do
  local used = tonumber(redis.call('GET', KEYS[b.key]) or '0')
  if used + b.cost > b.limit then
    return refuse('token_budget_exhausted', b.what, b.limit, used, b.cost, 0, false)
  end
end

for _, w in ipairs(spec.windows) do
  local key = KEYS[w.key]
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now - spec.window_ms)
  if w.cost > w.limit then
    return refuse('rate_limit_exceeded', w.what, w.limit, 0, w.cost, 0, false)
  end
  local entries = redis.call('ZRANGE', key, 0, -1, 'WITHSCORES')
  local used = 0
  for i = 1, #entries, 2 do used = used + member_cost(entries[i]) end
  if used + w.cost > w.limit then
    -- The oldest entries leave the window first: wait until enough of them have.
    local freed = 0
    local retry_ms = spec.window_ms
    for i = 1, #entries, 2 do
      freed = freed + member_cost(entries[i])
      if used - freed + w.cost <= w.limit then
        retry_ms = tonumber(entries[i + 1]) + spec.window_ms - now
        break
      end
    end
    return refuse('rate_limit_exceeded', w.what, w.limit, used, w.cost, retry_ms, true)
  end
end

for _, c in ipairs(spec.concurrency) do
  local key = KEYS[c.key]
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  local used = redis.call('ZCARD', key)
  if used >= c.limit then
    return refuse('concurrency_limit_exceeded', c.what, c.limit, used, 1, 1000, true)
  end
end

local queued = tonumber(redis.call('GET', KEYS[1]) or '0')
if queued >= spec.max_queue then
  return refuse('queue_full', 'requests waiting for a worker', spec.max_queue, queued, 1, 1000,
                true)
end

for _, b in ipairs(spec.budgets) do
  redis.call('INCRBY', KEYS[b.key], b.cost)
  redis.call('EXPIRE', KEYS[b.key], b.ttl_s)
end
for _, w in ipairs(spec.windows) do
  redis.call('ZADD', KEYS[w.key], now, spec.member .. ':' .. w.cost)
  redis.call('PEXPIRE', KEYS[w.key], spec.window_ms)
end
for _, c in ipairs(spec.concurrency) do
  redis.call('ZADD', KEYS[c.key], now + spec.lease_ms, spec.member)
  redis.call('PEXPIRE', KEYS[c.key], spec.lease_ms)
end
redis.call('INCR', KEYS[1])
redis.call('ZADD', KEYS[3], ARGV[3], ARGV[3])
if redis.call('EXISTS', KEYS[2]) == 0 then
  redis.pcall('XGROUP', 'CREATE', KEYS[2], spec.group, '0', 'MKSTREAM')
end
redis.call('XADD', KEYS[2], '*', 'data', ARGV[2])
return cjson.encode({ok = true})
"""

# Settle token reservations to the real usage. KEYS: windows then budgets; ARGV[1] spec JSON.
SETTLE_LUA = """
local spec = cjson.decode(ARGV[1])
local n = 0
for _, w in ipairs(spec.windows) do
  n = n + 1
  local old = spec.member .. ':' .. w.cost
  local score = redis.call('ZSCORE', KEYS[n], old)
  if score then
    redis.call('ZREM', KEYS[n], old)
    if spec.actual > 0 then
      redis.call('ZADD', KEYS[n], score, spec.member .. ':' .. spec.actual)
    end
  end
end
for _, b in ipairs(spec.budgets) do
  n = n + 1
  if redis.call('EXISTS', KEYS[n]) == 1 then
    redis.call('DECRBY', KEYS[n], b.cost - spec.actual)
  end
end
return n
"""


@dataclass(frozen=True)
class Admission:
    """What a request reserved; travels in the request message's ``meta`` for settlement."""

    member: str
    token_windows: list[dict[str, Any]]
    budgets: list[dict[str, Any]]
    concurrency_keys: list[str]

    def to_meta(self) -> dict[str, Any]:
        return {"member": self.member, "token_windows": self.token_windows,
                "budgets": self.budgets, "concurrency_keys": self.concurrency_keys}


_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, aioredis.Redis] = (
    weakref.WeakKeyDictionary()
)


def aredis() -> aioredis.Redis:
    """The async Redis client of the running event loop (one pool per loop)."""
    loop = asyncio.get_running_loop()
    client = _clients.get(loop)
    if client is None:
        # Every streaming request holds a connection while it waits for events (XREAD BLOCK),
        # so the pool must hold the whole gate-1 queue plus the running batch and more.
        client = aioredis.Redis.from_url(
            settings.REDIS_URL, max_connections=platform_settings()["REDIS_MAX_CONNECTIONS"])
        _clients[loop] = client
    return client


def sync_redis() -> redis.Redis:
    """A blocking Redis client (Celery tasks, management commands)."""
    return redis.Redis.from_url(settings.REDIS_URL)


def build_limits(
    key: ApiKey, request_id: str, token_cost: int, now: float | None = None
) -> tuple[dict[str, Any], list[str], Admission]:
    """The admission spec and keys for one request of ``key`` reserving ``token_cost`` tokens.

    Returns:
        (spec for :data:`ADMIT_LUA`, limit keys in spec order, the :class:`Admission`).
    """
    keys = redis_keys()
    p = keys.prefix
    tenant = key.tenant
    now = time.time() if now is None else now
    limit_keys: list[str] = []

    def slot(name: str) -> int:
        limit_keys.append(name)
        return len(limit_keys) + 3  # KEYS[1..3]: the queue, the tier stream, the tier registry

    windows, budgets, concurrency = [], [], []
    token_windows: list[dict[str, Any]] = []
    for scope, obj, ident in (("key", key, key.pk), ("tenant", tenant, tenant.pk)):
        if obj.requests_per_minute:
            name = f"{p}:rl:{scope}:{ident}:rpm"
            windows.append({"key": slot(name), "limit": obj.requests_per_minute, "cost": 1,
                            "what": f"requests per minute ({scope})"})
        if obj.tokens_per_minute:
            name = f"{p}:rl:{scope}:{ident}:tpm"
            windows.append({"key": slot(name), "limit": obj.tokens_per_minute,
                            "cost": token_cost, "what": f"tokens per minute ({scope})"})
            token_windows.append({"key": name, "cost": token_cost})
    if tenant.token_budget:
        period = tenant.budget_period_seconds
        name = f"{p}:budget:{tenant.pk}:{int(now // period)}"
        budgets.append({"key": slot(name), "limit": tenant.token_budget, "cost": token_cost,
                        "ttl_s": period, "what": f"token budget per {tenant.budget_period}"})
    concurrency_keys = []
    if tenant.max_concurrent_requests:
        name = f"{p}:conc:tenant:{tenant.pk}"
        concurrency.append({"key": slot(name), "limit": tenant.max_concurrent_requests,
                            "what": "concurrent requests (tenant)"})
        concurrency_keys.append(name)
    conf = platform_settings()
    spec = {
        "member": request_id,
        "window_ms": RATE_WINDOW_MS,
        "lease_ms": int(conf["REQUEST_IDLE_TIMEOUT_S"] * 1000) + RATE_WINDOW_MS,
        "max_queue": conf["MAX_QUEUE_SIZE"],
        "group": CONSUMER_GROUP,
        "windows": windows,
        "budgets": budgets,
        "concurrency": concurrency,
    }
    admission = Admission(
        member=request_id,
        token_windows=token_windows,
        budgets=[{"key": limit_keys[b["key"] - 4], "cost": token_cost} for b in budgets],
        concurrency_keys=concurrency_keys,
    )
    return spec, limit_keys, admission


def refusal(verdict: dict[str, Any]) -> APIError:
    """The 429 for a refused admission verdict of :data:`ADMIT_LUA`."""
    code = verdict["code"]
    what, limit, used, cost = verdict["what"], verdict["limit"], verdict["used"], verdict["cost"]
    if code == "queue_full":
        message = (f"The server's queue is full ({used} of {limit} requests waiting); "
                   "retry shortly.")
    elif code == "token_budget_exhausted":
        message = (f"Token budget exhausted: {used} of {limit} {what} used, this request "
                   f"reserves {cost} (prompt + max_tokens).")
    elif not verdict["retryable"]:
        message = (f"This request needs {cost} of a limit of {limit} {what}; it can never be "
                   "admitted. Lower max_tokens or the prompt.")
    else:
        message = f"Rate limit reached: {limit} {what} (in use: {used}); retry later."
    retryable = bool(verdict["retryable"])
    return APIError(
        429, message, code=code,
        retry_after_s=verdict["retry_after_ms"] / 1000 if retryable else None,
        should_retry=None if retryable else False,
        details={"limit": limit, "used": used, "requested": cost, "scope": what},
    )


async def live_workers() -> list[str]:
    """Ids of the workers whose heartbeat is younger than ``WORKER_HEARTBEAT_TTL_S``."""
    ttl = platform_settings()["WORKER_HEARTBEAT_TTL_S"]
    members = await aredis().zrangebyscore(redis_keys().workers, time.time() - ttl, "+inf")
    return [m.decode() for m in members]


def refused_counter_key() -> str:
    """Redis hash ``{code}`` -> requests refused before reaching a worker (read by /metrics)."""
    return f"{redis_keys().prefix}:metrics:refused"


async def admit(key: ApiKey, message: RequestMessage, token_cost: int) -> None:
    """Check every limit of ``key`` and gate 1; on success enqueue ``message`` for a worker.

    The message goes on the requests stream of its ``priority``.

    Every refusal is counted by its code in :func:`refused_counter_key`.

    Raises:
        APIError: 503 when no worker is alive; 429 naming the limit that refused.
    """
    try:
        await _admit(key, message, token_cost)
    except APIError as exc:
        await aredis().hincrby(refused_counter_key(), exc.code or "unknown", 1)
        raise


async def _admit(key: ApiKey, message: RequestMessage, token_cost: int) -> None:
    if not await live_workers():
        raise APIError(503, "No inference worker is running; retry later.",
                       code="no_worker_available", retry_after_s=5)
    spec, limit_keys, admission = build_limits(key, message.request_id, token_cost)
    message.meta["admission"] = admission.to_meta()
    keys = redis_keys()
    priority = int(message.priority)
    raw = await aredis().eval(
        ADMIT_LUA, 3 + len(limit_keys), keys.queue, keys.requests(priority), keys.request_tiers,
        *limit_keys, json.dumps(spec), message.to_json(), str(priority),
    )
    verdict = json.loads(raw)
    if not verdict["ok"]:
        raise refusal(verdict)


async def release(meta: dict[str, Any]) -> None:
    """Give back the concurrency leases of a finished request (idempotent)."""
    admission = meta.get("admission") or {}
    keys = admission.get("concurrency_keys") or []
    if keys:
        pipe = aredis().pipeline(transaction=False)
        for name in keys:
            pipe.zrem(name, admission["member"])
        await pipe.execute()


def settle(meta: dict[str, Any], actual_tokens: int, client: redis.Redis | None = None) -> None:
    """Replace the tokens reserved at admission by ``actual_tokens`` (prompt + completion)."""
    admission = meta.get("admission") or {}
    windows = admission.get("token_windows") or []
    budgets = admission.get("budgets") or []
    if not windows and not budgets:
        return
    spec = {"member": admission["member"], "actual": int(actual_tokens),
            "windows": [{"cost": w["cost"]} for w in windows],
            "budgets": [{"cost": b["cost"]} for b in budgets]}
    names = [w["key"] for w in windows] + [b["key"] for b in budgets]
    (client or sync_redis()).eval(SETTLE_LUA, len(names), *names, json.dumps(spec))


async def abort(request_id: str) -> None:
    """Ask every worker to abort ``request_id``; a worker that reads it later drops it."""
    keys = redis_keys()
    pipe = aredis().pipeline(transaction=False)
    pipe.set(keys.aborted(request_id), 1, ex=ABORT_MARK_TTL_S)
    pipe.publish(keys.control, ControlMessage("abort", request_id).to_json())
    await pipe.execute()


def _raise_if_cancelled() -> None:
    """Re-raise a cancellation that a Redis call swallowed.

    On Python 3.11, ``asyncio.wait_for`` (used inside redis-py) loses a cancellation that
    arrives just as the awaited operation completes. A client disconnect is delivered as such a
    cancellation, and losing it would leave the request generating for nobody, so the task's own
    pending-cancellation count is checked after every read.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def events(
    request_id: str, idle_timeout_s: float, first_timeout_s: float | None = None
) -> AsyncIterator[dict[str, Any]]:
    """The request's events in order, up to and including the final one.

    With ``first_timeout_s``, yields ``{"type": "waiting"}`` once if the first event has not
    arrived by then (a streaming response then commits to its status), and goes on waiting.

    Raises:
        APIError: 504 when no event arrives for ``idle_timeout_s`` seconds.
    """
    client = aredis()
    stream = redis_keys().events(request_id)
    last_id = "0-0"
    start = time.monotonic()
    deadline = start + idle_timeout_s
    first_deadline = start + first_timeout_s if first_timeout_s is not None else None
    while True:
        wake = deadline if first_deadline is None else min(deadline, first_deadline)
        # Blocks stay well below the client's socket timeout (5 s by default in redis-py 8).
        block_ms = max(1, int(min(XREAD_BLOCK_S, wake - time.monotonic()) * 1000))
        reply = await client.xread({stream: last_id}, block=block_ms, count=256)
        _raise_if_cancelled()
        if not reply:
            now = time.monotonic()
            if first_deadline is not None and now >= first_deadline:
                first_deadline = None
                yield {"type": "waiting"}
            if now >= deadline:
                raise APIError(504, f"No answer from the inference worker within "
                               f"{idle_timeout_s:g} s.", code="worker_timeout")
            continue
        first_deadline = None
        deadline = time.monotonic() + idle_timeout_s
        for entry_id, fields in reply[0][1]:
            last_id = entry_id
            event = decode_event(fields)
            yield event
            if event["type"] == "final":
                return
