"""One generation request's life in the web tier, written once for the REST API and the chat.

1. :func:`start` counts the prompt's tokens (as the worker will), builds the
   :class:`~inference.protocol.RequestMessage` (tenant, priority tier, fairness key, sampling,
   the admission deadline ``MAX_QUEUE_WAIT_S``) and admits it: every limit and gate 1, then
   dispatch to the workers (:mod:`gateway.admission`). A refusal raises before anything is queued.
2. :meth:`Generation.events` reads the worker's events (tokens, then one final event).
3. :meth:`Generation.close`, always called (also when the client went away), aborts the request in
   its worker if it has not finished and releases its concurrency lease.
4. The worker reports the request's usage when it ends; the Celery task
   :func:`gateway.tasks.record_usage` records it and settles the token reservations.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from gateway import admission
from gateway.admission import Principal
from gateway.conf import platform_settings
from gateway.events import Waiting, abort, events
from gateway.tokens import count_chat_tokens, count_text_tokens
from inference.protocol import ChatTurn, Event, FinalEvent, RequestMessage, Sampling
from tenants.models import Tenant

log = logging.getLogger(__name__)


def fairness_key(tenant: Tenant, *, api_key_id: int | None = None, user: str | None = None) -> str:
    """The scheduler's fairness key of a request under ``FAIRNESS_KEY``.

    ``tenant`` (the default): the tenant; ``api_key``: each API key of the tenant (a chat user,
    who has none, shares the tenant's); ``user``: each end user named by the request (the REST
    ``user`` field, the chat's signed-in user) within the tenant, else the tenant.
    """
    mode = platform_settings()["FAIRNESS_KEY"]
    if mode == "api_key" and api_key_id is not None:
        return f"{tenant.slug}/key-{api_key_id}"
    if mode == "user" and user:
        return f"{tenant.slug}/user-{user}"
    return tenant.slug


class Generation:
    """A request admitted and dispatched: its events, and its end (see the module docstring)."""

    def __init__(self, message: RequestMessage):
        self.message = message
        self.final: FinalEvent | None = None
        self._closed = False

    @property
    def request_id(self) -> str:
        return self.message.request_id

    @property
    def meta(self) -> dict[str, Any]:
        return self.message.meta

    async def events(self, first_timeout_s: float | None = None
                     ) -> AsyncIterator[Event | Waiting]:
        """The worker's events, up to and including the final one (kept as :attr:`final`).

        Args:
            first_timeout_s: yield one :class:`~gateway.events.Waiting` when the first event
                takes longer than this (seconds), then go on waiting.

        Raises:
            APIError: 504 ``worker_timeout`` after ``REQUEST_IDLE_TIMEOUT_S`` without an event.
        """
        idle = platform_settings()["REQUEST_IDLE_TIMEOUT_S"]
        async for event in events(self.request_id, idle, first_timeout_s):
            if isinstance(event, FinalEvent):
                self.final = event
            yield event

    async def abort(self) -> None:
        """Ask the worker to stop generating; its final event (``abort``) follows."""
        await abort(self.request_id)

    async def close(self) -> None:
        """Abort the request if it has not finished, and release its lease (idempotent).

        Runs to its end even when the calling task is being cancelled (a client disconnect).
        """
        if self._closed:
            return
        self._closed = True
        await asyncio.shield(self._end())

    async def _end(self) -> None:
        try:
            if self.final is None:
                await abort(self.request_id)
        finally:
            await admission.release(self.meta)


async def start(principal: Principal, *, sampling: Sampling, default_max_tokens: int,
                messages: Sequence[dict[str, str]] | None = None, prompt: str | None = None,
                user: str | None = None, meta: dict[str, Any] | None = None,
                prompt_tokens: int | None = None, request_id: str | None = None) -> Generation:
    """Admit a request of ``principal`` and dispatch it to the workers.

    Exactly one of ``messages`` (chat) and ``prompt`` (completion) is given. A ``sampling``
    without ``max_tokens`` lets the worker give what is left of the context, capped by
    ``default_max_tokens``; the reservation counts that cap.

    Args:
        principal: the sender (an API key, or a chat user in a tenant).
        user: the end user the request names, for a per-user fairness key.
        meta: handed back with the usage (``tenant_id`` and ``api_key_id`` are added).
        prompt_tokens: the prompt's tokens if already counted (else counted here).
        request_id: the request's id (else a new one).

    Raises:
        APIError: 503 when no worker is alive; 429 naming the limit that refused.
    """
    if prompt_tokens is None:
        prompt_tokens = (count_chat_tokens(messages) if messages is not None
                         else count_text_tokens(prompt or ""))
    tenant = principal.tenant
    conf = platform_settings()
    message = RequestMessage(
        request_id=request_id or uuid.uuid4().hex,
        tenant=tenant.slug,
        fairness_key=fairness_key(tenant, api_key_id=principal.api_key_id, user=user),
        priority=tenant.tier.priority,
        fairness_weight=tenant.fairness_weight,
        messages=None if messages is None else tuple(ChatTurn(**m) for m in messages),
        prompt=prompt,
        sampling=sampling,
        default_max_tokens=default_max_tokens,
        queue_deadline_s=conf["MAX_QUEUE_WAIT_S"],
        meta={"tenant_id": tenant.pk, "api_key_id": principal.api_key_id, **(meta or {})},
    )
    token_cost = prompt_tokens + (sampling.max_tokens or default_max_tokens)
    return Generation(await admission.admit(principal, message, token_cost))
