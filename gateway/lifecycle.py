"""One generation request's life in the web tier, written once for the REST API and the chat.

1. :func:`start` builds the :class:`~inference.protocol.messages.RequestMessage` (tenant, priority
   tier, fairness key, sampling, the admission deadline ``MAX_QUEUE_WAIT_S``), counts the prompt's
   tokens as the worker will (in a counting process, never on the event loop:
   :mod:`gateway.tokens`) and admits it: every limit and gate 1, then dispatch to the workers
   (:mod:`gateway.admission`). A refusal raises before anything is queued. A prompt that no live
   worker's context can hold is not queued either: its generation ends at once with the worker's
   own ``context_length_exceeded`` error (see :func:`context_refusal`), and a prompt far over
   the context is refused from its size in bytes, without being tokenized.
2. :meth:`Generation.event_batches` reads the worker's events (tokens, then one final event).
3. :meth:`Generation.close`, always called (also when the client went away), aborts the request in
   its worker if it has not finished, releases its concurrency lease and writes what its client
   got (:mod:`gateway.delivery`: the tokens it was sent, how its response ended). A *detachable*
   generation (the chat's) may instead outlive its reader for a grace period
   (:mod:`gateway.grace`): no web process's heartbeat guards it, a drain does not stop it, and
   its reader ends it with :func:`end_request` (or the grace sweep does).
4. The worker reports the request's usage when it ends; the Celery task
   :func:`gateway.tasks.record_usage` records it and settles the token reservations, billing what
   the client got. A request whose final event this process read is recorded here too, once its
   end is written: the task may have come first, and waited for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Sequence
from typing import Any

import redis.exceptions

from gateway import admission, delivery, event_reader, monitor, usage, workers
from gateway.aborts import abort_later
from gateway.admission import Principal
from gateway.clients import aredis
from gateway.conf import message_model, platform_settings, redis_keys
from gateway.errors import APIError
from gateway.events import Waiting, event_batches, flattened
from gateway.tokens import PromptCount, count_chat_tokens, count_text_tokens
from inference.protocol.events import ErrorCode, ErrorInfo, Event, FinalEvent, FinishReason
from inference.protocol.messages import (
    AdapterRef,
    ChatTurn,
    RequestMessage,
    Sampling,
    batch_fairness_key,
)
from tenants.models import Tenant

log = logging.getLogger(__name__)


def fairness_key(tenant: Tenant, *, api_key_id: int | None = None, user: str | None = None,
                 batch: bool = False) -> str:
    """The scheduler's fairness key of a request under ``FAIRNESS_KEY``.

    ``tenant`` (the default): the tenant; ``api_key``: each API key of the tenant (a chat user,
    who has none, shares the tenant's); ``user``: each end user named by the request (the REST
    ``user`` field, the chat's signed-in user) within the tenant, else the tenant. ``batch``:
    that key's batch key (``tenant-7:batch``, ``docs/design.md``, "The batch service class"),
    so batch work never raises the interactive key's VTC counter.
    """
    mode = platform_settings()["FAIRNESS_KEY"]
    if mode == "api_key" and api_key_id is not None:
        key = f"{tenant.slug}/key-{api_key_id}"
    elif mode == "user" and user:
        key = f"{tenant.slug}/user-{user}"
    else:
        key = tenant.slug
    return batch_fairness_key(key) if batch else key


# The generations of this process not yet closed (a draining web process stops them at its end).
_live: weakref.WeakSet[Generation] = weakref.WeakSet()


async def interrupt_all(timeout_s: float = 2.0) -> int:
    """Stop every generation of this process not yet ended (the end of a web drain): each
    reader then gets an ``interrupted`` error to send its client. Returns how many."""
    pending = [g for g in list(_live) if g.final is None and not g._closed
               and not g.detachable]
    if pending:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*(abort_later(g.request_id) for g in pending),
                                                  return_exceptions=True), timeout_s)
    return len(pending)


class Generation:
    """A request admitted and dispatched: its events, and its end (see the module docstring).

    Args:
        message: the request as dispatched.
        refusal: the final (error) event of a request refused before it was queued; its
            :meth:`events` is that event alone.
        detachable: it may outlive its reader (see the module docstring).
    """

    def __init__(self, message: RequestMessage, refusal: FinalEvent | None = None, *,
                 detachable: bool = False):
        self.message = message
        self.detachable = detachable
        self.final: FinalEvent | None = None
        self.failure: APIError | None = None  # the error reading its events ended with
        self._refusal = refusal
        self._progress: delivery.Progress | None = None  # a stream's: what its client was sent
        self._closed = False
        self._abort_requested = False
        if refusal is None:
            _live.add(self)

    @property
    def request_id(self) -> str:
        return self.message.request_id

    @property
    def meta(self) -> dict[str, Any]:
        return self.message.meta

    @property
    def streaming(self) -> bool:
        """Whether its client gets its tokens as they come (else its answer goes out whole)."""
        return self.meta.get("stream") is True

    def sent(self, seq: int) -> None:
        """The token events up to ``seq`` were handed to the client's connection (a stream's
        relay says so after each send; the loop's delivered checkpoint follows)."""
        if self._progress is not None:
            self._progress.mark(seq)

    @property
    def client_tokens(self) -> int:
        """The tokens its client was sent so far (0 for an answer not streamed)."""
        return self._progress.sent if self._progress is not None else 0

    def events(self, first_timeout_s: float | None = None, *,
               keepalive_s: float | None = None) -> AsyncIterator[Event | Waiting]:
        """:meth:`event_batches` one event at a time."""
        return flattened(self.event_batches(first_timeout_s, keepalive_s=keepalive_s))

    async def event_batches(self, first_timeout_s: float | None = None, *,
                            keepalive_s: float | None = None,
                            ) -> AsyncIterator[list[Event] | Waiting]:
        """The worker's events up to and including the final one (kept as :attr:`final`, alone
        in its list), each list what one read found (:func:`gateway.events.event_batches`):
        a :class:`~gateway.events.Waiting` once the first takes over ``first_timeout_s``, then
        one each ``keepalive_s`` without an event. An error, the worker's or this side's, says
        in its details how many tokens the client got (``completion_tokens``: those it was
        sent of a stream, 0 of an answer not streamed).

        Raises:
            APIError: 504 ``worker_timeout`` after ``REQUEST_IDLE_TIMEOUT_S`` without an event;
                503 ``service_unavailable`` when Redis stays unreachable or lost the request.
        """
        if self._refusal is not None:
            self.final = self._refusal
            yield [self._refusal]
            return
        conf = platform_settings()
        if self.streaming and self._progress is None:
            self._progress = event_reader.current().checkpoints.track(self.request_id)
        try:
            async with contextlib.aclosing(event_batches(
                    self.request_id, conf["REQUEST_IDLE_TIMEOUT_S"], first_timeout_s,
                    keepalive_s=keepalive_s, epoch=self.meta.get(admission.EPOCH_META_KEY),
                    outage_tolerance_s=conf["REDIS_OUTAGE_TOLERANCE_S"])) as batches:
                async for batch in batches:
                    if not isinstance(batch, Waiting) and isinstance(batch[-1], FinalEvent):
                        if len(batch) > 1:  # the final counts the tokens sent before it
                            yield batch[:-1]
                        final = (batch[-1] if self._abort_requested
                                 else delivery.as_interrupted(batch[-1]))
                        batch = [delivery.as_got(final, self.client_tokens)]
                        self.final = batch[0]
                    yield batch
        except APIError as exc:
            self.failure = exc
            exc.details = {**(exc.details or {}), "completion_tokens": self.client_tokens}
            raise

    async def abort(self) -> None:
        """Ask the worker to stop generating; its final event (``abort``) follows. With Redis
        unreachable, the web monitor sends the abort when it is back."""
        self._abort_requested = True
        await abort_later(self.request_id)

    async def close(self) -> None:
        """Abort the request if it has not finished, and release its lease (idempotent).

        Runs to its end even when the calling task is being cancelled (a client disconnect).
        """
        if self._closed:
            return
        self._closed = True
        if self._refusal is not None:  # never queued: nothing to abort or release
            return
        await asyncio.shield(self._end())

    async def _end(self) -> None:
        _live.discard(self)
        if self._progress is not None:
            event_reader.current().checkpoints.untrack(self._progress)
        if self.final is None:
            self._abort_requested = True
        await end_request(self.request_id, self.meta, finished=self.final is not None,
                          delivered=delivery.of_response(
                              self.final, self.failure, self.client_tokens,
                              draining=monitor.DRAINING.is_set()))


async def end_request(request_id: str, meta: dict[str, Any], *, finished: bool,
                      delivered: delivery.Delivery | None = None) -> None:
    """Abort ``request_id`` unless it ``finished`` (its final event was read), and release its
    concurrency leases (``meta`` holds what it reserved: ``meta["admission"]``). Idempotent;
    an abort that cannot reach Redis is retried by the web monitor.

    ``delivered``: what its client got; written first (an abort's end is billed by it), then
    the request's usage is recorded here if its recorder came first and waited for it
    (:func:`gateway.usage.record_if_ended`).
    """
    waited = False
    if delivered is not None:
        try:
            waited = await delivery.write_note(aredis(), request_id, delivered)
        except redis.exceptions.RedisError:
            log.warning("could not write what the client of %s got", request_id)
    if not finished:
        await abort_later(request_id)
    try:
        await admission.release(meta)
    except redis.exceptions.RedisError:
        # Released when the request ends in the queue (its final event releases its
        # leases), or when the lease expires.
        log.warning("could not release the leases of %s now", request_id)
    if waited:
        await usage.record_if_ended(request_id)


async def start(principal: Principal, *, sampling: Sampling, default_max_tokens: int,
                messages: Sequence[dict[str, Any]] | None = None, prompt: str | None = None,
                tools: Sequence[dict[str, Any]] | None = None, user: str | None = None,
                meta: dict[str, Any] | None = None, prompt_tokens: int | None = None,
                request_id: str | None = None, detachable: bool = False,
                batch_deadline_at: float | None = None,
                adapter: AdapterRef | None = None) -> Generation:
    """Admit a request of ``principal`` and dispatch it to the workers.

    Exactly one of ``messages`` (chat) and ``prompt`` (completion) is given. A ``sampling``
    without ``max_tokens`` lets the worker give what is left of the context, capped by
    ``default_max_tokens`` (lowered to the sender's token limits:
    :meth:`~gateway.admission.Principal.answer_cap`); the reservation counts that cap, once
    per choice (``sampling.n``) besides the prompt.

    Args:
        principal: the sender (an API key, or a chat user in a tenant).
        tools: the function tools a chat offers (rendered into its prompt), or None.
        user: the end user the request names, for a per-user fairness key.
        meta: handed back with the usage (``tenant_id`` and ``api_key_id`` are added).
        prompt_tokens: the prompt's tokens if already counted (else counted here, in a counting
            process, and a prompt no live worker can hold is refused: see
            :func:`context_refusal`).
        request_id: the request's id (else a new one).
        detachable: no web process's heartbeat guards the request: it goes on when its reader
            leaves, until it ends or is aborted (its owner holds it in :mod:`gateway.grace`).
        batch_deadline_at: batch work (a Batch API line, :mod:`api.batch_runner`): no web
            process, no ``MAX_QUEUE_WAIT_S``; it must end by this unix time.
        adapter: the LoRA adapter it runs under (None: the bare base model): on the message,
            and its name in ``meta["adapter"]`` (for its usage record); ``meta["model"]`` stays
            the base model's name, which routes the request to that model's queue.

    Returns:
        The generation; for a prompt refused for its length, one that was never queued and
        whose only event is the worker's ``context_length_exceeded`` final event.

    Raises:
        APIError: 503 when no worker is alive, this web process is draining, or the counting
            processes keep failing; 429 naming the limit that refused.
    """
    batch = batch_deadline_at is not None
    if monitor.DRAINING.is_set() and not batch:  # also on a connection opened before the drain
        raise APIError(503, "This server is shutting down; retry the request.",
                       code="service_unavailable", retry_after_s=1)
    tenant = principal.tenant
    conf = platform_settings()
    # Started in any case: the heartbeat, the epoch and the sweeps (grace periods included).
    web_id = "" if batch else (await monitor.ensure_started()).web_id
    message = RequestMessage(
        request_id=request_id or uuid.uuid4().hex,
        tenant=tenant.slug,
        fairness_key=fairness_key(tenant, api_key_id=principal.api_key_id, user=user,
                                  batch=batch),
        batch=batch, batch_deadline_at=batch_deadline_at or 0.0,
        priority=tenant.tier.priority, fairness_weight=tenant.fairness_weight,
        messages=None if messages is None else tuple(ChatTurn(**m) for m in messages),
        tools=tuple(tools) if tools else None, prompt=prompt, sampling=sampling,
        default_max_tokens=default_max_tokens,
        queue_deadline_s=0.0 if batch else conf["MAX_QUEUE_WAIT_S"],
        origin="" if detachable or batch else web_id,
        meta={"tenant_id": tenant.pk, "api_key_id": principal.api_key_id, **(meta or {}),
              **({"adapter": adapter.name} if adapter is not None else {})}, adapter=adapter)
    if prompt_tokens is None:
        context = await served_context(message_model(message.meta))
        # A prompt over context - 1 tokens never fits: past that its bytes settle it.
        most = None if context is None else context - 1
        count = await (count_chat_tokens(messages, most=most, tools=tools)
                       if messages is not None
                       else count_text_tokens(prompt or "", most=most))
        error = context_refusal(count, sampling.max_tokens, context,
                                "messages" if messages is not None else "prompt")
        if error is not None:
            await aredis().hincrby(admission.refused_counter_key(), error.code.value, 1)
            return Generation(message, FinalEvent(request_id=message.request_id,
                                                  finish_reason=FinishReason.ERROR, error=error))
        prompt_tokens = count.tokens
    if sampling.max_tokens is None:
        cap = principal.answer_cap(prompt_tokens, default_max_tokens, sampling.n)
        if cap != default_max_tokens:
            message = message.model_copy(update={"default_max_tokens": cap})
    # Each of the n choices may take its whole max_tokens; the prompt is computed once.
    token_cost = prompt_tokens + sampling.n * (sampling.max_tokens or message.default_max_tokens)
    return Generation(await admission.admit(principal, message, token_cost),
                      detachable=detachable)


# How long the context length read from the workers' stats is reused (seconds).
CONTEXT_CACHE_S = 1.0
_context_cache: dict[str, tuple[float, int | None]] = {}


async def served_context(model: str | None = None) -> int | None:
    """The longest context (tokens) of a live worker (of ``model``, a base model's name; None:
    of any model), or None when none reports one.

    The largest, not the smallest (:func:`gateway.workers.context_tokens`): a request is
    refused here only when every worker would refuse it. Read from the workers' stats at most
    once per :data:`CONTEXT_CACHE_S` per deployment.
    """
    cache_key = f"{redis_keys().prefix}@{model or ''}"
    now = time.monotonic()
    cached = _context_cache.get(cache_key)
    if cached is not None and cached[0] > now:
        return cached[1]
    snapshots = await workers.worker_snapshots()
    lengths = [int(s["max_model_len"]) for s in snapshots.values()
               if s.get("max_model_len") and (model is None or workers.model_of(s) == model)]
    context = max(lengths) if lengths else None
    _context_cache[cache_key] = (now + CONTEXT_CACHE_S, context)
    return context


def context_refusal(count: PromptCount, max_tokens: int | None, context: int | None,
                    param: str) -> ErrorInfo | None:
    """The worker's ``context_length_exceeded`` error for a prompt it would refuse, else None.

    The worker refuses a prompt that leaves no room in its context (``max_tokens`` omitted), or
    whose tokens plus ``max_tokens`` exceed it; the message and numbers are the worker's
    (``inference.worker.preparation``, ``inference.engine.llm_engine``). A count that is not exact
    (the prompt's bytes alone put it over the context) gives its lower bound, said as "at least". An
    estimated count (no tokenizer) refuses nothing.

    Args:
        count: the prompt's tokens.
        max_tokens: the request's ``max_tokens`` (None: the rest of the context).
        context: the longest context of a live worker (tokens); None: nothing is refused.
        param: the request field holding the prompt (``messages`` or ``prompt``).
    """
    if context is None or count.estimated:
        return None
    n = count.tokens if count.exact else f"at least {count.tokens}"
    details: dict[str, Any] = {"prompt_tokens": count.tokens, "max_model_len": context}
    if not count.exact:
        details["prompt_bytes"] = count.prompt_bytes
    if max_tokens is None:
        if count.tokens < context:
            return None
        message = (f"prompt of {n} tokens leaves no room in the model's context of {context} "
                   "tokens")
        details["param"] = param
    else:
        if count.tokens + max_tokens <= context:
            return None
        total = (count.tokens + max_tokens if count.exact
                 else f"at least {count.tokens + max_tokens}")
        message = (f"prompt of {n} tokens + max_tokens {max_tokens} = {total} exceeds the "
                   f"model's context of {context} tokens")
        details["max_tokens"] = max_tokens
    return ErrorInfo(code=ErrorCode.CONTEXT_LENGTH_EXCEEDED, message=message, details=details)
