"""Read-only queries of the chat: whose conversations a user may see."""

from __future__ import annotations

from django.contrib.auth.models import AbstractBaseUser
from django.db.models import QuerySet

from chat.models import Conversation, Message
from tenants.models import Membership, Tenant


def user_tenant(user: AbstractBaseUser) -> Tenant | None:
    """The active tenant ``user`` chats under (tier loaded), or None."""
    if not user.is_authenticated:
        return None
    membership = (
        Membership.objects.select_related("tenant", "tenant__tier")
        .filter(user=user, tenant__is_active=True)
        .first()
    )
    return membership.tenant if membership else None


def conversations_of(user: AbstractBaseUser, tenant: Tenant) -> QuerySet[Conversation]:
    """The conversations ``user`` started under ``tenant``, newest activity first.

    Every lookup of a conversation goes through here, so no user ever reaches another user's
    (or another tenant's) conversations.
    """
    return Conversation.objects.filter(user=user, tenant=tenant)


def conversation_of(user: AbstractBaseUser, tenant: Tenant, pk: int | str | None
                    ) -> Conversation | None:
    """``user``'s conversation ``pk`` under ``tenant``, or None (also for a malformed pk)."""
    try:
        return conversations_of(user, tenant).filter(pk=int(pk)).first() if pk else None
    except (TypeError, ValueError):
        return None


def history(conversation: Conversation) -> list[Message]:
    """The conversation's messages in order."""
    return list(conversation.messages.all())


def answer_to_resume(conversation: Conversation, message_id: int | None) -> Message | None:
    """The answer a page coming back asks for: the conversation's assistant message
    ``message_id``, or (None) the conversation's last message if it is an answer."""
    if message_id is not None:
        return conversation.messages.filter(pk=message_id, role=Message.Role.ASSISTANT).first()
    last = conversation.messages.order_by("-created_at", "-pk").first()
    return last if last is not None and last.role == Message.Role.ASSISTANT else None


def streaming_answers(conversation: Conversation) -> list[Message]:
    """The conversation's answers still marked ``streaming``."""
    return list(conversation.messages.filter(role=Message.Role.ASSISTANT,
                                             status=Message.Status.STREAMING))
