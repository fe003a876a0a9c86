"""One chat turn: fit the conversation into the context, admit the request, relay its answer.

Admission (limits, budget, gate 1), the Redis events and aborts are the REST API's
(:mod:`api.admission`); the chat only adds the signed-in user as the principal, the context
trimming and the storage of the answer.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from asgiref.sync import sync_to_async
from django.contrib.auth.models import AbstractBaseUser

from api import admission
from api.conf import platform_settings
from api.errors import APIError
from api.tokens import count_chat_tokens
from chat import services
from chat.conf import chat_settings
from chat.context import ChatMessage, ContextOverflowError, fit_to_context
from chat.models import Conversation, Message
from dashboard.stats import context_tokens, worker_stats
from inference.protocol import RequestMessage
from tenants.models import Tenant

log = logging.getLogger(__name__)

Send = Callable[[dict[str, Any]], Awaitable[None]]


@dataclass(frozen=True)
class ChatPrincipal:
    """What :func:`api.admission.admit` reads of an API key, for a signed-in user.

    Chat users have no key of their own: only their tenant's limits apply (``pk`` names the
    per-key windows, which stay unused with limits of 0).
    """

    tenant: Tenant
    pk: str
    requests_per_minute: int = 0
    tokens_per_minute: int = 0


def fairness_key(tenant: Tenant, user: AbstractBaseUser) -> str:
    """The scheduler's fairness key of a chat user under ``FAIRNESS_KEY``.

    ``tenant`` (the default) and ``api_key`` share the tenant's key (a chat user has no API
    key); ``user`` gives each user their own, within the tenant.
    """
    if platform_settings()["FAIRNESS_KEY"] == "user":
        return f"{tenant.slug}/user-{user.get_username()}"
    return tenant.slug


def readable_error(exc: APIError) -> str:
    """The message shown in the page for a refused or failed request."""
    if exc.code == "no_worker_available":
        return "No inference worker is running right now. Try again in a moment."
    if exc.code == "queue_full":
        return "The server is busy (its queue is full). Try again in a few seconds."
    return exc.message


@dataclass
class Answer:
    """The assistant message being written, as it streams."""

    message_id: int
    request_id: str
    meta: dict[str, Any]
    parts: list[str] = field(default_factory=list)
    completion_tokens: int = 0
    # Set to stop relaying at once (see :func:`relay`).
    give_up: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def text(self) -> str:
        return "".join(self.parts)


async def prepare_prompt(history: list[ChatMessage]) -> tuple[list[ChatMessage], int]:
    """The messages to send (oldest turns dropped to fit) and the answer's token cap.

    Raises:
        ContextOverflowError: when the newest message alone does not fit.
    """
    conf = chat_settings()
    workers = await sync_to_async(worker_stats)()
    context = context_tokens(workers, conf["CONTEXT_TOKENS"])
    answer_room = max(conf["MIN_ANSWER_TOKENS"], min(conf["MAX_TOKENS"], context // 2))
    limit = context - answer_room - conf["CONTEXT_MARGIN_TOKENS"]
    system = {"role": "system", "content": conf["SYSTEM_PROMPT"]} if conf["SYSTEM_PROMPT"] else None
    messages = fit_to_context(history, prompt_limit_tokens=limit,
                              count_tokens=count_chat_tokens, system=system)
    return messages, min(conf["MAX_TOKENS"], context - count_chat_tokens(messages))


def history_for_prompt(messages: list[Message]) -> list[ChatMessage]:
    """The stored turns the model should see: failed answers (and empty ones) are left out."""
    return [{"role": m.role, "content": m.content} for m in messages
            if m.status != Message.Status.ERROR and (m.content or m.role == Message.Role.USER)]


async def submit(user: AbstractBaseUser, tenant: Tenant, conversation: Conversation,
                 history: list[ChatMessage]) -> Answer:
    """Admit the turn's request and create its ``streaming`` assistant message.

    Raises:
        ContextOverflowError: the newest message does not fit in the context.
        APIError: refused (no worker, queue full, rate limit, budget); nothing was enqueued.
    """
    conf = chat_settings()
    messages, answer_cap = await prepare_prompt(history)
    request_id = uuid.uuid4().hex
    prompt_tokens = count_chat_tokens(messages)
    message = RequestMessage(
        request_id=request_id,
        tenant=tenant.slug,
        fairness_key=fairness_key(tenant, user),
        priority=tenant.tier.priority,
        fairness_weight=tenant.fairness_weight,
        messages=messages,
        # max_tokens None: the worker gives what is left of the context, capped by this.
        sampling={"max_tokens": None, "temperature": conf["TEMPERATURE"], "top_p": conf["TOP_P"]},
        default_max_tokens=answer_cap,
        queue_deadline_s=platform_settings()["MAX_QUEUE_WAIT_S"],
        meta={"tenant_id": tenant.pk, "api_key_id": None, "model":
              platform_settings()["SERVED_MODEL_NAME"], "chat_user_id": user.pk,
              "conversation_id": conversation.pk},
    )
    principal = ChatPrincipal(tenant=tenant, pk=f"chat-user-{user.pk}")
    await admission.admit(principal, message, prompt_tokens + answer_cap)
    stored = await sync_to_async(services.start_answer)(conversation, request_id)
    return Answer(message_id=stored.pk, request_id=request_id, meta=message.meta)


async def relay(answer: Answer, send: Send) -> None:
    """Send the answer's tokens to the page as they come, then store how it ended.

    Runs as its own task so the socket keeps reading (Stop) meanwhile. Setting
    ``answer.give_up`` (the page went away, or the worker did not confirm a Stop in time) ends
    it at once: the request is aborted in the worker and the text so far stored as ``stopped``.
    (An event rather than task cancellation: a cancelled Redis read may be retried instead of
    ending.)
    """
    idle = platform_settings()["REQUEST_IDLE_TIMEOUT_S"]
    final: dict[str, Any] | None = None
    failure: str = ""
    events = admission.events(answer.request_id, idle)
    give_up = asyncio.ensure_future(answer.give_up.wait())
    try:
        while final is None:
            next_event = asyncio.ensure_future(anext(events))
            done, _ = await asyncio.wait({next_event, give_up},
                                         return_when=asyncio.FIRST_COMPLETED)
            if next_event not in done:
                next_event.cancel()
                break
            event = next_event.result()
            if event["type"] == "final":
                final = event
            if event["type"] in ("token", "final") and event.get("text"):
                answer.parts.append(event["text"])
                await send({"type": "token", "message_id": answer.message_id,
                            "text": event["text"]})
            if event["type"] == "token":
                answer.completion_tokens += 1
    except APIError as exc:
        failure = readable_error(exc)
    finally:
        give_up.cancel()
        await asyncio.shield(_conclude(answer, final, failure, send))


async def _conclude(answer: Answer, final: dict[str, Any] | None, failure: str,
                    send: Send) -> None:
    """Store the answer's end and tell the page; abort and release in the worker if needed."""
    try:
        if final is None:
            await admission.abort(answer.request_id)
    finally:
        await admission.release(answer.meta)
    reason = final["finish_reason"] if final else "abort"
    error = ""
    if failure:
        status = Message.Status.ERROR
        error = failure
    elif reason == "error":
        status = Message.Status.ERROR
        error = readable_error(APIError.from_worker(final["error"] or {}))
    elif reason == "abort":
        status = Message.Status.STOPPED
    else:
        status = Message.Status.COMPLETE
    if final is not None:
        answer.completion_tokens = final["usage"].get("completion_tokens",
                                                      answer.completion_tokens)
    await sync_to_async(services.finish_answer)(
        answer.message_id, content=answer.text, status=status, finish_reason=reason,
        error=error, completion_tokens=answer.completion_tokens)
    try:
        await send({"type": "done", "message_id": answer.message_id, "status": status,
                    "finish_reason": reason, "error": error})
    except Exception:  # noqa: BLE001 - the page may be gone; the answer is stored
        log.debug("could not tell the page that %s ended", answer.request_id)


__all__ = ["Answer", "ChatPrincipal", "ContextOverflowError", "relay", "submit",
           "history_for_prompt"]
