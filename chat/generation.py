"""One chat turn: fit the conversation into the context, start the request, relay its answer.

The request's life (admission, events, abort, release) is the web tier's one lifecycle
(:mod:`gateway.lifecycle`); the chat adds the signed-in user as the principal, the model
(:func:`chat_model`), the context trimming and the storage of the answer.

An answer outlives the socket that asked for it: its request is *detachable* and held in
:mod:`gateway.grace` under the kind :data:`GRACE_KIND`. While a socket relays it, the socket keeps
it attached; when the socket closes, the answer goes on for ``RESUME_GRACE_S`` (:mod:`chat.conf`)
and a socket that comes back resumes it (:mod:`chat.resume`). Whoever sees it end first stores
it, once (:func:`chat.services.finish_answer`): a relaying socket, or the grace sweep when no
socket came back (:func:`chat.resume.finish_unattended`, after aborting it).
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

from chat import services
from chat.conf import chat_settings, resume_grace_s
from chat.context import ChatMessage, ContextOverflowError, fit_here
from chat.models import Conversation, Message
from gateway import admission, grace, lifecycle, model_registry, tokens, workers
from gateway.admission import Principal
from gateway.conf import platform_settings
from gateway.errors import APIError, unexpected_error
from gateway.events import events
from gateway.model_registry import ModelEntry
from inference.protocol.events import FinalEvent, FinishReason, TokenEvent
from inference.protocol.messages import Sampling
from tenants.models import Tenant

log = logging.getLogger(__name__)

Send = Callable[[dict[str, Any]], Awaitable[None]]
# The chat's entries in gateway.grace (the sender of its unattended_end signal).
GRACE_KIND = "chat"


def readable_error(exc: APIError) -> str:
    """The message shown in the page for a refused or failed request."""
    if exc.code == "no_worker_available":
        return "No inference worker is running right now. Try again in a moment."
    if exc.code == "queue_full":
        return "The server is busy (its queue is full). Try again in a few seconds."
    return exc.message


@dataclass
class Answer:
    """The assistant message being written, as one socket relays it.

    ``after_seq``: the page already shows the events up to this ``seq`` (a socket that resumed
    the answer); they are read again, to store the whole text, but not sent.
    """

    message_id: int
    request_id: str
    epoch: str | None = None
    admission: dict[str, Any] = field(default_factory=dict)
    after_seq: int = -1
    parts: list[str] = field(default_factory=list)
    completion_tokens: int = 0
    final: FinalEvent | None = None
    stop_requested: bool = False
    # Set to stop relaying and end the answer now, stored as it is (see :func:`relay`).
    give_up: asyncio.Event = field(default_factory=asyncio.Event)
    # Set when the page went away: stop relaying, the answer goes on for its grace period.
    detach: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def text(self) -> str:
        return "".join(self.parts)

    @property
    def meta(self) -> dict[str, Any]:
        """What the request reserved, as :func:`gateway.lifecycle.end_request` reads it."""
        return {"admission": self.admission}


async def chat_model(tenant: Tenant) -> ModelEntry:
    """The model the chat of ``tenant``'s users calls: the default model when the tenant may
    call it, else the first model it may call by name.

    Raises:
        APIError: 403 ``no_model_available`` when the tenant may call no model served.
        django.db.DatabaseError: the registry could not be read.
    """
    access = model_registry.Access.of_tenant(tenant)
    models = model_registry.allowed(await model_registry.served_models(), access)
    if not models:
        raise APIError(403, "No model is available to your organization right now: ask an "
                            "administrator to allow one.", code="no_model_available")
    return models[0]


async def prepare_prompt(history: list[ChatMessage],
                         model: ModelEntry | None = None) -> tuple[list[ChatMessage], int, int]:
    """The messages to send (oldest turns dropped to fit), their tokens and the answer's cap.

    The context is that of ``model``'s live workers (None: of every worker). The fitting, which
    counts tokens several times with the tokenizer of ``model`` (None: the default model's), runs
    in a token-counting process (:func:`gateway.tokens.run`), never on the event loop.

    Raises:
        ContextOverflowError: when the newest message alone does not fit.
        APIError: 503 when the token-counting processes keep failing.
    """
    conf = chat_settings()
    snapshots = await workers.worker_snapshots()
    if model is not None:  # the context of the workers of its model
        snapshots = workers.by_model(snapshots).get(model.name, {})
    context = workers.context_tokens(snapshots, conf["CONTEXT_TOKENS"])
    answer_room = max(conf["MIN_ANSWER_TOKENS"], min(conf["MAX_TOKENS"], context // 2))
    limit = context - answer_room - conf["CONTEXT_MARGIN_TOKENS"]
    system = {"role": "system", "content": conf["SYSTEM_PROMPT"]} if conf["SYSTEM_PROMPT"] else None
    messages, prompt_tokens = await tokens.run(
        fit_here, history, limit, system,
        folder=model.tokenizer_folder if model is not None else None)
    return messages, prompt_tokens, min(conf["MAX_TOKENS"], context - prompt_tokens)


def history_for_prompt(messages: list[Message]) -> list[ChatMessage]:
    """The stored turns the model should see: failed answers (and empty ones) are left out."""
    return [{"role": m.role, "content": m.content} for m in messages
            if m.status != Message.Status.ERROR and (m.content or m.role == Message.Role.USER)]


async def submit(user: AbstractBaseUser, tenant: Tenant, conversation: Conversation,
                 history: list[ChatMessage]) -> Answer:
    """Start the turn's request and create its ``streaming`` assistant message.

    The request is held in :mod:`gateway.grace` before it is admitted, so that it never runs
    without an owner, even if this process dies right after admitting it.

    Raises:
        ContextOverflowError: the newest message does not fit in the context.
        APIError: refused (no model the tenant may call, no worker, queue full, rate limit,
            budget); nothing was enqueued.
    """
    conf = chat_settings()
    model = await chat_model(tenant)
    messages, prompt_tokens, answer_cap = await prepare_prompt(history, model)
    request_id = uuid.uuid4().hex
    data = {"conversation_id": conversation.pk, "user_id": user.pk}
    await grace.hold(request_id, GRACE_KIND, resume_grace_s(), data=data)
    try:
        generation = await lifecycle.start(
            Principal.for_chat_user(tenant, user.pk), messages=messages,
            prompt_tokens=prompt_tokens, user=user.get_username(),
            # max_tokens None: the worker gives what is left of the context, capped by
            # answer_cap.
            sampling=Sampling(temperature=conf["TEMPERATURE"], top_p=conf["TOP_P"]),
            default_max_tokens=answer_cap, request_id=request_id, detachable=True,
            meta={"model": model.name, "chat_user_id": user.pk,
                  "conversation_id": conversation.pk})
    except BaseException:
        await asyncio.shield(grace.forget(request_id))
        raise
    answer = Answer(message_id=0, request_id=request_id,
                    epoch=generation.meta.get(admission.EPOCH_META_KEY),
                    admission=generation.meta.get("admission") or {})
    try:
        stored = await sync_to_async(services.start_answer)(conversation, request_id)
    except BaseException:
        await asyncio.shield(_abandon(answer))
        raise
    answer.message_id = stored.pk
    await grace.hold(request_id, GRACE_KIND, resume_grace_s(), data=data, epoch=answer.epoch,
                     admission=answer.admission)
    return answer


async def _abandon(answer: Answer) -> None:
    await lifecycle.end_request(answer.request_id, answer.meta, finished=False)
    await grace.forget(answer.request_id)


def outcome(final: FinalEvent | None, failure: str = "") -> tuple[str, str, str]:
    """How an answer ended, as stored: (status, finish reason, readable error).

    ``final`` None: the answer was given up before its final event (stored ``stopped``);
    ``failure``: why reading it failed (stored ``error``). A final ``abort`` is ``stopped``:
    a chat answer is only ever aborted when asked (Stop, access revoked, its grace period over).
    """
    reason = final.finish_reason if final is not None else FinishReason.ABORT
    if failure:
        return Message.Status.ERROR, reason.value, failure
    if final is not None and final.error is not None:
        return (Message.Status.ERROR, reason.value,
                readable_error(APIError.from_worker(final.error)))
    if reason is FinishReason.ABORT:
        return Message.Status.STOPPED, reason.value, ""
    return Message.Status.COMPLETE, reason.value, ""


async def _keep_attached(answer: Answer) -> None:
    """Push the answer's grace deadline forward while this socket relays it."""
    while True:
        await asyncio.sleep(grace.REFRESH_S)
        try:
            await grace.refresh(answer.request_id, resume_grace_s())
        except Exception:  # noqa: BLE001 - the next push may succeed; the deadline has room
            log.warning("could not keep %s attached", answer.request_id, exc_info=True)


async def relay(answer: Answer, send: Send) -> None:
    """Send the answer's tokens to the page as they come, then store how it ended.

    Runs as its own task so the socket keeps reading (Stop) meanwhile. Each token frame carries
    its event's ``seq``; the events up to ``answer.after_seq`` are not sent (the page has
    them). Setting ``answer.detach`` (the page went away) ends the relay at once and leaves the
    answer to its grace period; setting ``answer.give_up`` (the worker did not confirm a Stop in
    time, the socket's access was revoked) ends it at once too: the request is aborted and the
    text so far stored as ``stopped``. (Events rather than task cancellation: a cancelled Redis
    read may be retried instead of ending.)
    """
    conf = platform_settings()
    failure = ""
    detached = False
    stream = events(answer.request_id, conf["REQUEST_IDLE_TIMEOUT_S"], epoch=answer.epoch,
                    outage_tolerance_s=conf["REDIS_OUTAGE_TOLERANCE_S"])
    keeper = asyncio.ensure_future(_keep_attached(answer))
    give_up = asyncio.ensure_future(answer.give_up.wait())
    detach = asyncio.ensure_future(answer.detach.wait())
    try:
        while answer.final is None:
            next_event = asyncio.ensure_future(anext(stream))
            done, _ = await asyncio.wait({next_event, give_up, detach},
                                         return_when=asyncio.FIRST_COMPLETED)
            if next_event not in done:
                next_event.cancel()
                detached = not answer.give_up.is_set()
                break
            event = next_event.result()
            if isinstance(event, FinalEvent):
                answer.final = event
            elif isinstance(event, TokenEvent):
                answer.completion_tokens += 1
            else:
                continue
            if event.text:
                answer.parts.append(event.text)
                if event.seq > answer.after_seq:
                    await send({"type": "token", "message_id": answer.message_id,
                                "seq": event.seq, "text": event.text})
    except APIError as exc:
        failure = readable_error(exc)
    finally:
        for task in (keeper, give_up, detach):
            task.cancel()
        if detached:
            await asyncio.shield(_detach(answer))
        else:
            await asyncio.shield(_conclude(answer, failure, send))


async def _detach(answer: Answer) -> None:
    grace_s = resume_grace_s()
    try:
        await grace.detach(answer.request_id, grace_s)
    except Exception:  # noqa: BLE001 - its deadline, pushed a second ago, ends it anyway
        log.warning("could not start the grace period of %s", answer.request_id, exc_info=True)
    else:
        log.info("the page of %s went away: it goes on for %g s", answer.request_id, grace_s)


async def _store_later(answer: Answer, exc: Exception) -> None:
    """The answer could not be stored (the database is down): its grace period ends now, so
    that the grace sweep stores it from its stream (kept ``EVENTS_TTL_S``) at its next round
    that the database takes, as it stores an answer no page came back for."""
    unexpected_error(exc)  # logged (a database outage once in a while)
    try:
        await grace.detach(answer.request_id, 0)
    except Exception:  # noqa: BLE001 - its deadline, pushed a second ago, ends it anyway
        log.warning("could not hand %s to the grace sweep now", answer.request_id,
                    exc_info=True)


async def _conclude(answer: Answer, failure: str, send: Send) -> None:
    """Store the answer's end (unless stored already) and tell the page; abort it and release
    its leases if it has not ended. An answer the database does not take is stored later
    (:func:`_store_later`); the page is told how it ended all the same."""
    final = answer.final
    if final is None or failure:
        await lifecycle.end_request(answer.request_id, answer.meta, finished=final is not None)
    status, reason, error = outcome(final, failure)
    completion_tokens = final.usage.completion_tokens if final else answer.completion_tokens
    try:
        stored = await sync_to_async(services.finish_answer)(
            answer.message_id, content=answer.text, status=status, finish_reason=reason,
            error=error, completion_tokens=completion_tokens)
    except Exception as exc:  # noqa: BLE001 - the page is told; the grace sweep stores it
        stored = None
        await _store_later(answer, exc)
    else:
        try:
            await grace.forget(answer.request_id)
        except Exception:  # noqa: BLE001 - the grace sweep forgets it (the store is done)
            log.warning("could not forget %s now", answer.request_id, exc_info=True)
    if stored is not None:
        status, reason, error = stored.status, stored.finish_reason, stored.error
    try:
        await send({"type": "done", "message_id": answer.message_id, "status": status,
                    "finish_reason": reason, "error": error})
    except Exception:  # noqa: BLE001 - the page may be gone; the answer is stored
        log.debug("could not tell the page that %s ended", answer.request_id)


__all__ = ["Answer", "ContextOverflowError", "outcome", "relay", "submit",
           "history_for_prompt"]
