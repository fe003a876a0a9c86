"""Answers that outlive their page: a page that comes back takes its answer up again, and an
answer no page came back for is stored when its grace period ends.

A page comes back after a dropped connection, a reload or a restart of the web process that held
its socket. It sends ``resume`` for its conversation (see :mod:`chat.frames`) and gets:

- the answer still being written: a ``resume`` frame (``message_id``, ``after_seq``), then the
  ``token`` frames after ``after_seq`` (the page's last ``seq``; -1, for a page that has none,
  replays the answer from its start), then the live ones and ``done``: the text shown is exactly
  the text generated, no token lost or doubled;
- an answer that ended meanwhile: an ``answer`` frame with the message as stored.

The socket's authorization is checked again before (as for every frame), and only the user's
own conversations under the user's tenant are reached (:func:`chat.selectors.conversation_of`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from asgiref.sync import sync_to_async
from django.contrib.auth.models import AbstractBaseUser

from chat import selectors, services
from chat.conf import resume_grace_s
from chat.generation import GRACE_KIND, Answer, outcome
from chat.models import Conversation, Message
from gateway import grace
from gateway.clients import aredis
from gateway.conf import redis_keys
from inference.protocol.events import Event, FinalEvent, TokenEvent
from tenants.models import Tenant

log = logging.getLogger(__name__)

LOST = ("This answer was lost: the server's request store restarted while it was being "
        "written.")


class NotFound(LookupError):
    """The conversation or the answer asked for is not the user's (the message is shown)."""


@dataclass(frozen=True)
class Resumption:
    """What a ``resume`` frame gets: ``frame``, then the relay of ``answer`` when it is still
    being written."""

    frame: dict[str, Any]
    answer: Answer | None = None


async def take_up(user: AbstractBaseUser, tenant: Tenant, conversation_id: int,
                  message_id: int | None, after_seq: int | None) -> Resumption:
    """The answer a page coming back asks for (see the module docstring).

    Args:
        message_id: the answer the page was showing (None: the conversation's last message,
            if it is an answer: a page that sent a turn and lost its socket before the answer
            started).
        after_seq: the last ``seq`` the page shows of ``message_id`` (None: none).

    Raises:
        NotFound: the conversation is not the user's, or has no answer ``message_id``.
    """
    conversation = await sync_to_async(selectors.conversation_of)(user, tenant, conversation_id)
    if conversation is None:
        raise NotFound("That conversation does not exist.")
    message = await sync_to_async(selectors.answer_to_resume)(conversation, message_id)
    if message is None:
        if message_id is not None:
            raise NotFound("That answer does not exist.")
        return Resumption({"type": "answer", "conversation_id": conversation.pk,
                           "message": None})
    if message.status == Message.Status.STREAMING:
        held = await grace.attach(message.request_id, grace.attached_deadline(resume_grace_s()))
        if held is None:
            message = await _not_held(message)
        if message.status == Message.Status.STREAMING:
            info = held[0] if held is not None else {}
            after = after_seq if message_id == message.pk and after_seq is not None else -1
            answer = Answer(message_id=message.pk, request_id=message.request_id,
                            epoch=info.get("epoch"), admission=info.get("admission") or {},
                            after_seq=after)
            return Resumption({"type": "resume", "conversation_id": conversation.pk,
                               "message_id": message.pk, "after_seq": after}, answer)
    return Resumption({"type": "answer", "conversation_id": conversation.pk,
                       "message": message.to_dict()})


async def _not_held(message: Message) -> Message:
    """A ``streaming`` answer that :mod:`gateway.grace` does not hold: stored an instant ago
    (read again), still readable from its stream (relayed: its reader stores it), or lost with
    Redis's data (stored as such)."""
    message = await Message.objects.aget(pk=message.pk)
    if message.status != Message.Status.STREAMING:
        return message
    if await aredis().exists(redis_keys().events(message.request_id)):
        return message
    log.warning("the answer %s (request %s) was lost with Redis's data", message.pk,
                message.request_id)
    stored = await sync_to_async(services.finish_answer)(
        message.pk, content=message.content, status=Message.Status.ERROR,
        finish_reason="error", error=LOST)
    return stored or message


async def in_progress(conversation: Conversation) -> bool:
    """Whether an answer of ``conversation`` is still being written (by any socket, or by none
    during its grace period)."""
    for message in await sync_to_async(selectors.streaming_answers)(conversation):
        if await grace.is_held(message.request_id):
            return True
    return False


def finish_unattended(sender: str, *, request_id: str, events: list[Event],
                      final: FinalEvent | None, **kwargs: Any) -> None:
    """Store an answer whose grace period ended without a page (the receiver of
    :data:`gateway.grace.unattended_end`): its text as generated, ``stopped`` when it was
    aborted for it; nothing when a page stored it first."""
    if sender != GRACE_KIND:
        return
    status, reason, error = outcome(final)
    tokens = sum(isinstance(e, TokenEvent) for e in events)
    services.finish_answer(
        request_id=request_id, content="".join(e.text for e in events if e.text),
        status=status, finish_reason=reason, error=error,
        completion_tokens=final.usage.completion_tokens if final is not None else tokens)
