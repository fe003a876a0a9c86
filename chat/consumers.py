"""The chat websocket: one signed-in user's turns, streamed token by token.

Frames from the page (JSON):
    ``{"type": "send", "conversation_id": <id or null>, "content": "..."}``: a new user turn
    (a null id starts a conversation); ``{"type": "stop"}``: stop the answer being written.
Frames to the page:
    ``conversation`` (id, title, created), ``user_message``, ``start`` (the answer's message id),
    ``token`` (text), ``done`` (status ``complete``, ``stopped`` or ``error``, with a readable
    ``error``), ``error`` (a turn that could not start, with a readable ``message``).

The answer streams from its own task, so Stop and a closed page are handled while tokens flow:
Stop aborts the request in the worker at once (its answer is kept and marked stopped), closing
the socket does the same. Anonymous sockets are refused; a socket reaches only its own user's
conversations under the user's tenant, and only the requests it made.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from asgiref.sync import sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from chat import generation, selectors, services
from chat.conf import chat_settings
from chat.context import ContextOverflowError
from chat.models import Conversation
from gateway.errors import APIError

log = logging.getLogger(__name__)

# Close codes (4000-4999 are the application's): not signed in, no tenant.
CLOSE_UNAUTHENTICATED = 4401
CLOSE_NO_TENANT = 4403
MAX_MESSAGE_CHARS = 32_000


class ChatConsumer(AsyncJsonWebsocketConsumer):
    """``ws/chat/``: see the module docstring for the frames."""

    async def connect(self) -> None:
        self.user = self.scope.get("user")
        self.answer: generation.Answer | None = None
        self.task: asyncio.Task | None = None
        self.closed = False
        if self.user is None or not self.user.is_authenticated:
            await self.close(code=CLOSE_UNAUTHENTICATED)
            return
        self.tenant = await sync_to_async(selectors.user_tenant)(self.user)
        if self.tenant is None:
            await self.close(code=CLOSE_NO_TENANT)
            return
        await self.accept()

    async def disconnect(self, code: int) -> None:
        self.closed = True
        task = getattr(self, "task", None)
        if task is not None and not task.done():
            # The page is gone: relay's cleanup aborts the request and stores the text so far.
            self.answer.give_up.set()
            await asyncio.wait({task}, timeout=chat_settings()["STOP_GRACE_S"])

    async def receive_json(self, content: Any, **kwargs: Any) -> None:
        kind = content.get("type") if isinstance(content, dict) else None
        if kind == "send":
            await self._send_turn(content)
        elif kind == "stop":
            await self._stop()
        else:
            await self._error("Unknown request.")

    async def _safe_send(self, frame: dict[str, Any]) -> None:
        if not self.closed:
            await self.send_json(frame)

    async def _error(self, message: str, **extra: Any) -> None:
        await self._safe_send({"type": "error", "message": message, **extra})

    async def _send_turn(self, content: dict[str, Any]) -> None:
        if self.task is not None and not self.task.done():
            await self._error("An answer is still being written: wait for it or press Stop.")
            return
        text = content.get("content")
        if not isinstance(text, str) or not text.strip():
            await self._error("Type a message first.")
            return
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate: JSON allows it, text does not
            await self._error("The message contains characters that are not valid text.")
            return
        if len(text) > MAX_MESSAGE_CHARS:
            await self._error(f"The message is too long (at most {MAX_MESSAGE_CHARS} "
                              "characters).")
            return
        conversation: Conversation | None = None
        if content.get("conversation_id"):
            conversation = await sync_to_async(selectors.conversation_of)(
                self.user, self.tenant, content["conversation_id"])
            if conversation is None:
                await self._error("That conversation does not exist.")
                return
        conversation, user_message, created = await sync_to_async(services.add_user_message)(
            self.user, self.tenant, conversation, text)
        await self._safe_send({"type": "conversation", "id": conversation.pk,
                               "title": str(conversation), "created": created})
        await self._safe_send({"type": "user_message", "message": user_message.to_dict()})
        stored = await sync_to_async(selectors.history)(conversation)
        history = generation.history_for_prompt(stored)
        try:
            answer = await generation.submit(self.user, self.tenant, conversation, history)
        except (ContextOverflowError, APIError) as exc:
            reason = (generation.readable_error(exc) if isinstance(exc, APIError)
                      else str(exc))
            failed = await sync_to_async(services.fail_answer)(conversation, reason)
            await self._error(reason, message_id=failed.pk)
            return
        self.answer = answer
        await self._safe_send({"type": "start", "message_id": answer.message_id})
        self.task = asyncio.create_task(generation.relay(answer, self._safe_send))

    async def _stop(self) -> None:
        answer, task = self.answer, self.task
        if answer is None or task is None or task.done():
            return
        await answer.generation.abort()
        # The worker ends the request within a tick or two (a final "abort" event ends the
        # relay); if it does not confirm in time, stop relaying anyway.
        asyncio.get_running_loop().call_later(chat_settings()["STOP_GRACE_S"],
                                              answer.give_up.set)
