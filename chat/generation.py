"""One chat turn: fit the conversation into the context, start the request, relay its answer.

The request's life (admission, events, abort, release) is the web tier's one lifecycle
(:mod:`gateway.lifecycle`); the chat adds the signed-in user as the principal, the context
trimming and the storage of the answer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from asgiref.sync import sync_to_async
from django.contrib.auth.models import AbstractBaseUser

from chat import services
from chat.conf import chat_settings
from chat.context import ChatMessage, ContextOverflowError, fit_here
from chat.models import Conversation, Message
from gateway import lifecycle, tokens, workers
from gateway.admission import Principal
from gateway.conf import platform_settings
from gateway.errors import APIError
from gateway.lifecycle import Generation
from inference.protocol import FinalEvent, FinishReason, Sampling, TokenEvent
from tenants.models import Tenant

log = logging.getLogger(__name__)

Send = Callable[[dict[str, Any]], Awaitable[None]]


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
    generation: Generation
    parts: list[str] = field(default_factory=list)
    completion_tokens: int = 0
    # Set to stop relaying at once (see :func:`relay`).
    give_up: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def request_id(self) -> str:
        return self.generation.request_id

    @property
    def text(self) -> str:
        return "".join(self.parts)


async def prepare_prompt(history: list[ChatMessage]) -> tuple[list[ChatMessage], int, int]:
    """The messages to send (oldest turns dropped to fit), their tokens and the answer's cap.

    The fitting, which counts tokens several times, runs in a token-counting process
    (:func:`gateway.tokens.run`), never on the event loop.

    Raises:
        ContextOverflowError: when the newest message alone does not fit.
        APIError: 503 when the token-counting processes keep failing.
    """
    conf = chat_settings()
    context = workers.context_tokens(await workers.worker_snapshots(), conf["CONTEXT_TOKENS"])
    answer_room = max(conf["MIN_ANSWER_TOKENS"], min(conf["MAX_TOKENS"], context // 2))
    limit = context - answer_room - conf["CONTEXT_MARGIN_TOKENS"]
    system = {"role": "system", "content": conf["SYSTEM_PROMPT"]} if conf["SYSTEM_PROMPT"] else None
    messages, prompt_tokens = await tokens.run(fit_here, history, limit, system)
    return messages, prompt_tokens, min(conf["MAX_TOKENS"], context - prompt_tokens)


def history_for_prompt(messages: list[Message]) -> list[ChatMessage]:
    """The stored turns the model should see: failed answers (and empty ones) are left out."""
    return [{"role": m.role, "content": m.content} for m in messages
            if m.status != Message.Status.ERROR and (m.content or m.role == Message.Role.USER)]


async def submit(user: AbstractBaseUser, tenant: Tenant, conversation: Conversation,
                 history: list[ChatMessage]) -> Answer:
    """Start the turn's request and create its ``streaming`` assistant message.

    Raises:
        ContextOverflowError: the newest message does not fit in the context.
        APIError: refused (no worker, queue full, rate limit, budget); nothing was enqueued.
    """
    conf = chat_settings()
    messages, prompt_tokens, answer_cap = await prepare_prompt(history)
    generation = await lifecycle.start(
        Principal.for_chat_user(tenant, user.pk), messages=messages,
        prompt_tokens=prompt_tokens, user=user.get_username(),
        # max_tokens None: the worker gives what is left of the context, capped by answer_cap.
        sampling=Sampling(temperature=conf["TEMPERATURE"], top_p=conf["TOP_P"]),
        default_max_tokens=answer_cap,
        meta={"model": platform_settings()["SERVED_MODEL_NAME"], "chat_user_id": user.pk,
              "conversation_id": conversation.pk})
    stored = await sync_to_async(services.start_answer)(conversation, generation.request_id)
    return Answer(message_id=stored.pk, generation=generation)


async def relay(answer: Answer, send: Send) -> None:
    """Send the answer's tokens to the page as they come, then store how it ended.

    Runs as its own task so the socket keeps reading (Stop) meanwhile. Setting
    ``answer.give_up`` (the page went away, or the worker did not confirm a Stop in time) ends
    it at once: the request is aborted in the worker and the text so far stored as ``stopped``.
    (An event rather than task cancellation: a cancelled Redis read may be retried instead of
    ending.)
    """
    failure: str = ""
    events = answer.generation.events()
    give_up = asyncio.ensure_future(answer.give_up.wait())
    try:
        while answer.generation.final is None:
            next_event = asyncio.ensure_future(anext(events))
            done, _ = await asyncio.wait({next_event, give_up},
                                         return_when=asyncio.FIRST_COMPLETED)
            if next_event not in done:
                next_event.cancel()
                break
            event = next_event.result()
            if isinstance(event, TokenEvent | FinalEvent) and event.text:
                answer.parts.append(event.text)
                await send({"type": "token", "message_id": answer.message_id,
                            "text": event.text})
            if isinstance(event, TokenEvent):
                answer.completion_tokens += 1
    except APIError as exc:
        failure = readable_error(exc)
    finally:
        give_up.cancel()
        await asyncio.shield(_conclude(answer, failure, send))


async def _conclude(answer: Answer, failure: str, send: Send) -> None:
    """Store the answer's end and tell the page; abort and release in the worker if needed."""
    await answer.generation.close()
    final = answer.generation.final
    reason = final.finish_reason if final else FinishReason.ABORT
    error = ""
    if failure:
        status = Message.Status.ERROR
        error = failure
    elif final is not None and final.error is not None:
        status = Message.Status.ERROR
        error = readable_error(APIError.from_worker(final.error))
    elif reason is FinishReason.ABORT:
        status = Message.Status.STOPPED
    else:
        status = Message.Status.COMPLETE
    if final is not None:
        answer.completion_tokens = final.usage.completion_tokens
    await sync_to_async(services.finish_answer)(
        answer.message_id, content=answer.text, status=status, finish_reason=reason.value,
        error=error, completion_tokens=answer.completion_tokens)
    try:
        await send({"type": "done", "message_id": answer.message_id, "status": status,
                    "finish_reason": reason.value, "error": error})
    except Exception:  # noqa: BLE001 - the page may be gone; the answer is stored
        log.debug("could not tell the page that %s ended", answer.request_id)


__all__ = ["Answer", "ContextOverflowError", "relay", "submit", "history_for_prompt"]
