"""Operations that change conversations (the consumer and the views call these)."""

from __future__ import annotations

from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction
from django.utils import timezone

from chat.models import Conversation, Message
from tenants.models import Tenant

TITLE_CHARS = 60


def title_from(text: str) -> str:
    """A conversation title from its first message: the first line, shortened."""
    line = " ".join(text.strip().split())
    return line if len(line) <= TITLE_CHARS else line[: TITLE_CHARS - 1].rstrip() + "…"


@transaction.atomic
def add_user_message(user: AbstractBaseUser, tenant: Tenant, conversation: Conversation | None,
                     content: str) -> tuple[Conversation, Message, bool]:
    """Store a new user message, starting a conversation when ``conversation`` is None.

    Returns:
        (the conversation, the stored message, whether the conversation is new).
    """
    created = conversation is None
    if conversation is None:
        conversation = Conversation.objects.create(user=user, tenant=tenant,
                                                   title=title_from(content))
    message = Message.objects.create(conversation=conversation, role=Message.Role.USER,
                                     content=content)
    Conversation.objects.filter(pk=conversation.pk).update(updated_at=timezone.now())
    return conversation, message, created


def start_answer(conversation: Conversation, request_id: str) -> Message:
    """The assistant message of an accepted request, ``streaming`` until it ends."""
    return Message.objects.create(conversation=conversation, role=Message.Role.ASSISTANT,
                                  status=Message.Status.STREAMING, request_id=request_id)


def fail_answer(conversation: Conversation, error: str) -> Message:
    """An assistant message recording that no answer could be made (shown in its place)."""
    return Message.objects.create(conversation=conversation, role=Message.Role.ASSISTANT,
                                  status=Message.Status.ERROR, error=error)


def finish_answer(message_id: int, *, content: str, status: str, finish_reason: str = "",
                  error: str = "", completion_tokens: int = 0) -> None:
    """Store how an answer ended: its text so far, ``status`` and the reason."""
    Message.objects.filter(pk=message_id).update(
        content=content, status=status, finish_reason=finish_reason, error=error,
        completion_tokens=completion_tokens)
    conversation_id = Message.objects.filter(pk=message_id).values("conversation_id")
    Conversation.objects.filter(pk__in=conversation_id).update(updated_at=timezone.now())


def rename_conversation(conversation: Conversation, title: str) -> None:
    conversation.title = title.strip()[:200]
    conversation.save(update_fields=["title", "updated_at"])


def delete_conversation(conversation: Conversation) -> None:
    conversation.delete()
