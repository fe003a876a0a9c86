"""Admission and dispatch: every limit of a request and gate 1, all-or-nothing, then the queue.

One Lua script (``inference/protocol/lua/admit.lua``) checks every limit that applies to a request
and, only when all pass, records the request in each of them and puts it in the shared queue that
feeds the workers in the deployment's fair order (:mod:`inference.protocol`), atomically. A refused
request so consumes nothing, and 20 concurrent requests against a limit of 5 admit exactly 5.
Libraries such as ``limits`` check one window at a time; the all-or-nothing check across several
windows plus the global queue counter is why this is one script.

- rate limits (requests and tokens per minute, per key and per tenant): a moving window (a sorted
  set of the admitted requests, scored by time), so no 60-second span ever admits more than the
  limit; tokens are reserved as ``prompt + max_tokens`` and settled to the real usage afterwards
  (``inference/protocol/lua/settle.lua``).
- max concurrent requests: a sorted set of leases (scored by expiry), released when the request
  ends in the queue (``fq_finish``, whoever ends it: its worker, a reclaim, a withdrawal) and when
  the response ends; the expiry (``REQUEST_IDLE_TIMEOUT_S`` and a minute) is the last resort.
- token budget per period: a counter per tenant and period, reserved and settled like tokens;
  a counter Redis has lost is first rebuilt from the usage records (:mod:`gateway.budgets`).
  Batch work (a Batch API line) is charged there at the price of a batch token
  (``BATCH_TOKEN_PRICE``, :mod:`gateway.pricing`): it reserves ``ceil(price * (prompt +
  max_tokens))`` and settles to ``ceil(price * tokens used)``; the price is kept with what it
  reserved. Rate windows count its tokens in full.
- gate 1: requests waiting in the queue plus those workers hold not yet admitted (see
  :mod:`inference.protocol`).

:func:`admit`, :func:`release` and :func:`settle` are the whole interface: how requests reach the
workers (the shared queue's Lua library) can change behind them.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

from gateway import budgets as token_budgets
from gateway import pricing, ratelimits
from gateway.clients import aredis
from gateway.conf import message_model, platform_settings, redis_keys
from gateway.errors import APIError
from gateway.scripts import LuaScript
from gateway.workers import alive_workers
from inference.protocol.keys import queue_script
from inference.protocol.messages import RequestMessage
from tenants.models import ApiKey, Tenant

RATE_WINDOW_MS = 60_000
ADMIT_LUA = LuaScript(queue_script("admit"))
# An admission retried after its reply was lost gets its first verdict for this long (s).
ADMITTED_MARKER_TTL_S = 600
# Where the web tier's copy of a request message keeps the Redis epoch it was queued in.
EPOCH_META_KEY = "epoch"
# Keys of the admission script before the limit keys (the queue's are named in the script).
FIXED_KEYS = 0


@dataclass(frozen=True)
class Principal:
    """Who sends a request, as admission sees it: a tenant, and the sender's own limits.

    ``scope`` names the sender's own rate windows (an API key's, or a chat user's, who has none:
    limits of 0 leave those windows unused). ``api_key_id`` is recorded with the usage.
    """

    tenant: Tenant
    scope: str
    requests_per_minute: int = 0
    tokens_per_minute: int = 0
    api_key_id: int | None = None

    @classmethod
    def for_api_key(cls, key: ApiKey) -> Principal:
        return cls(tenant=key.tenant, scope=str(key.pk),
                   requests_per_minute=key.requests_per_minute,
                   tokens_per_minute=key.tokens_per_minute, api_key_id=key.pk)

    @classmethod
    def for_chat_user(cls, tenant: Tenant, user_id: Any) -> Principal:
        return cls(tenant=tenant, scope=f"chat-user-{user_id}")

    def answer_cap(self, prompt_tokens: int, default_max_tokens: int, n: int = 1) -> int:
        """The answer's cap (per choice, of ``n``) for a request that omits ``max_tokens``:
        ``default_max_tokens``, lowered to what the tightest token limit of the sender lets one
        request reserve (its tokens per minute, per key or per tenant, or its tenant's token
        budget: the prompt and ``n`` answers), so that omitting ``max_tokens`` is never refused
        for a default the client did not choose. A prompt that alone uses that limit keeps a
        cap of 1 token (and is refused as too big for the limit)."""
        tenant = self.tenant
        limits = [n for n in (self.tokens_per_minute, tenant.tokens_per_minute,
                              tenant.token_budget) if n]
        if not limits:
            return default_max_tokens
        return max(1, min(default_max_tokens, (min(limits) - prompt_tokens) // n))


@dataclass(frozen=True)
class Admission:
    """What a request reserved; travels in the request message's ``meta`` for settlement.

    ``token_price``: the share of a token each of its tokens is charged in budgets and its usage
    record (1 for interactive work, ``BATCH_TOKEN_PRICE`` for batch work when it was admitted).
    """

    member: str
    token_windows: list[dict[str, Any]]
    budgets: list[dict[str, Any]]
    concurrency_keys: list[str]
    token_price: float = pricing.FULL_PRICE

    def to_meta(self) -> dict[str, Any]:
        return {"member": self.member, "token_windows": self.token_windows,
                "budgets": self.budgets, "concurrency_keys": self.concurrency_keys,
                pricing.META_KEY: self.token_price}


def build_limits(
    principal: Principal, request_id: str, token_cost: int, now: float | None = None, *,
    token_price: float = pricing.FULL_PRICE, model: str | None = None,
) -> tuple[dict[str, Any], list[str], Admission]:
    """The admission spec and keys for one request of ``principal`` reserving ``token_cost``
    tokens: in full in token windows, at ``token_price`` (a share of a token) in budgets; it
    joins the queue of ``model`` (None: the default model's). Rate limits, budgets and
    concurrency leases are the tenant's and the key's over every model.

    Returns:
        (spec for ``admit.lua``, limit keys in spec order, the :class:`Admission`).
    """
    p = redis_keys().prefix
    tenant = principal.tenant
    now = time.time() if now is None else now
    limit_keys: list[str] = []

    def slot(name: str) -> int:
        limit_keys.append(name)
        return len(limit_keys) + FIXED_KEYS

    windows, budgets, concurrency = [], [], []
    token_windows: list[dict[str, Any]] = []
    for scope, obj, ident in (("key", principal, principal.scope), ("tenant", tenant, tenant.pk)):
        if obj.requests_per_minute:
            name = f"{p}:rl:{scope}:{ident}:rpm"
            windows.append({"key": slot(name), "limit": obj.requests_per_minute, "cost": 1,
                            "what": f"requests per minute ({scope})", "kind": "requests"})
        if obj.tokens_per_minute:
            name = f"{p}:rl:{scope}:{ident}:tpm"
            windows.append({"key": slot(name), "limit": obj.tokens_per_minute,
                            "cost": token_cost, "what": f"tokens per minute ({scope})",
                            "kind": "tokens"})
            token_windows.append({"key": name, "cost": token_cost})
    budget_cost = pricing.priced(token_cost, token_price)
    if tenant.token_budget:
        period = token_budgets.budget_period(tenant, p, now)
        budgets.append({"key": slot(period.key), "limit": tenant.token_budget,
                        "cost": budget_cost, "ttl_s": period.seconds,
                        "ends_at": (period.index + 1) * period.seconds,  # unix seconds
                        "what": f"token budget per {tenant.budget_period}"})
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
        "prefix": redis_keys(model).queue,
        "windows": windows,
        "budgets": budgets,
        "concurrency": concurrency,
    }
    admission = Admission(
        member=request_id,
        token_windows=token_windows,
        budgets=[{"key": limit_keys[b["key"] - FIXED_KEYS - 1], "cost": budget_cost}
                 for b in budgets],
        concurrency_keys=concurrency_keys,
        token_price=token_price,
    )
    return spec, limit_keys, admission


def refusal(verdict: dict[str, Any], token_price: float = pricing.FULL_PRICE) -> APIError:
    """The 429 for a refused admission verdict of ``admit.lua`` (of a request charged
    ``token_price`` of a token in budgets: batch work)."""
    code = verdict["code"]
    what, limit, used, cost = verdict["what"], verdict["limit"], verdict["used"], verdict["cost"]
    retryable = bool(verdict["retryable"])
    retry_after_s = verdict["retry_after_ms"] / 1000 if retryable else None
    details = {"limit": limit, "used": used, "requested": cost, "scope": what}
    if code == "queue_full":
        message = (f"The server's queue is full ({used} of {limit} requests waiting); "
                   "retry shortly.")
    elif code == "token_budget_exhausted":
        priced = ("" if token_price == pricing.FULL_PRICE
                  else f" at the batch price of {token_price:g} per token")
        message = (f"Token budget exhausted: {used} of {limit} {what} used, this request "
                   f"reserves {cost} (prompt + max_tokens{priced}).")
        if priced:
            details["token_price"] = token_price
        if verdict.get("retry_after_ms"):  # when the period ends: not retryable before
            retry_after_s = details["resets_in_s"] = math.ceil(verdict["retry_after_ms"] / 1000)
            message += f" The budget starts again in {retry_after_s} s."
    elif not retryable:
        message = (f"This request needs {cost} of a limit of {limit} {what}; it can never be "
                   "admitted. Lower max_tokens or the prompt.")
    else:
        message = f"Rate limit reached: {limit} {what} (in use: {used}); retry later."
    return APIError(429, message, code=code, retry_after_s=retry_after_s,
                    should_retry=None if retryable else False, details=details)


def refused_counter_key() -> str:
    """Redis hash ``{code}`` -> requests refused before reaching a worker (read by /metrics)."""
    return f"{redis_keys().prefix}:metrics:refused"


async def admit(principal: Principal, message: RequestMessage, token_cost: int) -> RequestMessage:
    """Check every limit of ``principal`` and gate 1; on success dispatch ``message``.

    Every refusal is counted by its code in :func:`refused_counter_key`.

    Args:
        principal: the sender.
        message: the request; it joins the shared queue under its ``priority`` and fairness key.
        token_cost: tokens to reserve in token windows and budgets (prompt + max_tokens); a
            batch request (``message.batch``) is charged ``BATCH_TOKEN_PRICE`` of each in
            budgets (:mod:`gateway.pricing`).

    Returns:
        The message as dispatched: ``meta["admission"]`` holds what it reserved and at what
        price per token (``token_price``, what its settlement and usage record charge), and
        (in this copy only) ``meta["rate_limits"]`` the use of its rate windows
        (:mod:`gateway.ratelimits`).

    Raises:
        APIError: 503 ``no_worker_available`` when no worker is alive; 429 naming the limit
            that refused, with the ``x-ratelimit-*`` headers of the windows as they are.
        ImproperlyConfigured: ``BATCH_TOKEN_PRICE`` is not a valid price (a batch request).
    """
    try:
        return await _admit(principal, message, token_cost)
    except APIError as exc:
        await aredis().hincrby(refused_counter_key(), exc.code or "unknown", 1)
        raise


async def _admit(principal: Principal, message: RequestMessage,
                 token_cost: int) -> RequestMessage:
    model = message_model(message.meta)
    if not await alive_workers(model):
        raise APIError(503, f"No inference worker of the model '{model}' is running; retry "
                            "later.", code="no_worker_available", retry_after_s=5)
    now = time.time()
    # The price in force now is the one it is charged at, to the end (kept in its meta).
    price = pricing.batch_token_price() if message.batch else pricing.FULL_PRICE
    spec, limit_keys, admission = build_limits(principal, message.request_id, token_cost, now,
                                               token_price=price, model=model)
    if principal.tenant.token_budget:
        # A counter Redis lost (restart, flush) is rebuilt from the usage records first.
        period = token_budgets.budget_period(principal.tenant, redis_keys().prefix, now)
        await token_budgets.ensure_counter(aredis(), period)
    message = message.model_copy(
        update={"meta": {**message.meta, "admission": admission.to_meta()}})
    spec.update(fairness_key=message.fairness_key, priority=int(message.priority),
                deadline=message.deadline() or 0, epoch=uuid.uuid4().hex,
                marker_ttl_s=ADMITTED_MARKER_TTL_S,
                adapter=message.adapter.key if message.adapter is not None else "")
    raw = await ADMIT_LUA.arun(aredis(), len(limit_keys), *limit_keys, json.dumps(spec),
                              message.to_json())
    verdict = json.loads(raw)
    uses = ratelimits.window_uses(spec["windows"], verdict.get("windows"))
    if not verdict["ok"]:
        exc = refusal(verdict, price)
        exc.extra_headers.update(ratelimits.headers(uses))
        raise exc
    # Kept in the web tier's copy only (the worker's was sent above): the response's headers and
    # the epoch of the Redis data it was queued in (gateway.monitor tells when Redis lost it).
    return message.model_copy(
        update={"meta": {**message.meta, ratelimits.META_KEY: ratelimits.to_meta(uses),
                         EPOCH_META_KEY: verdict["epoch"]}})


async def release(meta: dict[str, Any]) -> None:
    """Give back the concurrency leases of a finished request (idempotent)."""
    admission = meta.get("admission") or {}
    keys = admission.get("concurrency_keys") or []
    if keys:
        pipe = aredis().pipeline(transaction=False)
        for name in keys:
            pipe.zrem(name, admission["member"])
        await pipe.execute()


# Settling a request's reservations to its real usage (``settle.lua``): the budget counters need
# what :mod:`gateway.budgets` knows of their rebuilds, so it lives there.
settle = token_budgets.settle
