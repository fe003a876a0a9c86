"""Operations that change conversations (the consumer and the views call these)."""

from __future__ import annotations

from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction
from django.utils import timezone

from chat.models import Conversation, Message
from gateway.storable import storable_text
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
    content = storable_text(content)
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
                                  status=Message.Status.ERROR, error=storable_text(error))


def finish_answer(message_id: int | None = None, *, request_id: str | None = None,
                  content: str, status: str, finish_reason: str = "", error: str = "",
                  completion_tokens: int = 0) -> Message | None:
    """Store how an answer ended (its text so far, ``status`` and the reason), once.

    The answer is named by its id or its request's id. Only an answer still ``streaming`` is
    changed, in one conditional update: when two parties end the same answer at once (a page
    that came back and the grace sweep), the first one's store stands.

    Returns:
        The answer as stored (by this call or an earlier one); None when there is none.
    """
    answers = Message.objects.filter(role=Message.Role.ASSISTANT)
    answers = (answers.filter(pk=message_id) if message_id is not None
               else answers.filter(request_id=request_id or "-"))
    with transaction.atomic():
        stored = answers.filter(status=Message.Status.STREAMING).update(
            content=storable_text(content), status=status, finish_reason=finish_reason,
            error=storable_text(error),
            completion_tokens=completion_tokens)
        if stored:
            Conversation.objects.filter(pk__in=answers.values("conversation_id")).update(
                updated_at=timezone.now())
    return answers.first()


def rename_conversation(conversation: Conversation, title: str) -> None:
    conversation.title = storable_text(title.strip()[:200])
    conversation.save(update_fields=["title", "updated_at"])


def delete_conversation(conversation: Conversation) -> None:
    conversation.delete()
