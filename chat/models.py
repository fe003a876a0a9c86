"""Conversations of signed-in users with the model, and their messages."""

from __future__ import annotations

from django.conf import settings
from django.db import models

from tenants.models import Tenant


class Conversation(models.Model):
    """A chat of one user, under the tenant the user belonged to when it was started."""

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="conversations"
    )
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="conversations")
    title = models.CharField(max_length=200, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True, db_index=True)

    class Meta:
        ordering = ["-updated_at"]

    def __str__(self) -> str:
        return self.title or f"Conversation {self.pk}"


class Message(models.Model):
    """One turn of a conversation.

    An assistant message is created when its request is accepted (``streaming``) and ends
    ``complete``, ``stopped`` (Stop pressed or the page closed; the text so far is kept) or
    ``error`` (``error`` holds the readable reason).
    """

    class Role(models.TextChoices):
        SYSTEM = "system", "System"
        USER = "user", "User"
        ASSISTANT = "assistant", "Assistant"

    class Status(models.TextChoices):
        STREAMING = "streaming", "Streaming"
        COMPLETE = "complete", "Complete"
        STOPPED = "stopped", "Stopped"
        ERROR = "error", "Error"

    conversation = models.ForeignKey(
        Conversation, on_delete=models.CASCADE, related_name="messages"
    )
    role = models.CharField(max_length=16, choices=Role.choices)
    content = models.TextField(blank=True)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.COMPLETE)
    finish_reason = models.CharField(max_length=16, blank=True)
    error = models.TextField(blank=True)
    request_id = models.CharField(max_length=64, blank=True, db_index=True)
    completion_tokens = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["created_at", "pk"]

    def __str__(self) -> str:
        return f"{self.role}: {self.content[:40]}"

    def to_dict(self) -> dict[str, object]:
        """The message as the chat page's script reads it."""
        return {"id": self.pk, "role": self.role, "content": self.content,
                "status": self.status, "finish_reason": self.finish_reason,
                "error": self.error}
