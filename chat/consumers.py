"""The chat websocket: one signed-in user's turns, streamed token by token.

The frames it reads and writes are those of :mod:`chat.frames`. The answer streams from its own
task, so Stop and a closed page are handled while tokens flow: Stop aborts the request in the
worker at once (its answer is kept and marked stopped). Closing the socket does not stop the
answer: it goes on for ``RESUME_GRACE_S`` (:mod:`chat.conf`), for the page to come back; then it
is aborted and stored as ``stopped`` (:mod:`chat.generation`). Anonymous sockets are refused; a
socket reaches only its own user's conversations under the user's tenant, and only the requests
it made or resumed.

Authorization holds at every use, not only at connect: before each frame is acted on, and every
``REAUTHORIZE_INTERVAL_S`` while the socket is open, :func:`chat.authorization.authorize` checks
the socket's session, user and tenant again; when they no longer hold, an answer being written
is stopped (and kept), the page gets a closing ``error`` frame and the socket closes with 4401
(signed out, account disabled) or 4403 (tenant lost).

Any frame that cannot be acted on (binary, not JSON, JSON that is not an object, an unknown
type, fields of the wrong type, a frame longer than :data:`chat.frames.MAX_FRAME_CHARS`) gets an
``error`` frame, and so does a turn that fails inside the server (a database that cannot serve:
:func:`chat.outages.unavailable_frame`, retryable); the socket stays open.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from asgiref.sync import sync_to_async
from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from chat import generation, resume, selectors, services
from chat.authorization import CLOSE_UNAUTHENTICATED, Denial, authorize
from chat.conf import chat_settings, resume_grace_s
from chat.context import ContextOverflowError
from chat.frames import FrameError, parse_frame, resume_fields, turn_fields
from chat.models import Conversation
from chat.outages import unavailable_frame
from gateway import monitor
from gateway.aborts import abort_later
from gateway.errors import APIError, database_unavailable, unexpected_error

log = logging.getLogger(__name__)


class ChatConsumer(AsyncJsonWebsocketConsumer):
    """``ws/chat/``: see the module docstring for the frames."""

    async def connect(self) -> None:
        self.answer: generation.Answer | None = None
        self.task: asyncio.Task | None = None
        self.watchdog: asyncio.Task | None = None
        self.closed = False
        self.ending = False
        self.user = self.scope.get("user")
        session = self.scope.get("session")
        self.session_key: str | None = session.session_key if session is not None else None
        if self.user is None or not self.user.is_authenticated:
            await self.close(code=CLOSE_UNAUTHENTICATED)
            return
        granted = await database_sync_to_async(authorize)(self.session_key, self.user.pk)
        if isinstance(granted, Denial):
            await self.close(code=granted.code)
            return
        self.user, self.tenant = granted
        await self.accept()
        # This process's monitor sweeps the grace periods of every web process's answers (a
        # page coming back to a restarted process may be the first thing it serves).
        await monitor.ensure_started()
        if chat_settings()["REAUTHORIZE_INTERVAL_S"] > 0:
            self.watchdog = asyncio.create_task(self._watch())

    async def disconnect(self, code: int) -> None:
        self.closed = True
        watchdog = getattr(self, "watchdog", None)
        if watchdog is not None:
            watchdog.cancel()
        task = getattr(self, "task", None)
        if task is not None and not task.done():
            if self.answer.stop_requested:
                pass  # Stop was pressed: the relay ends with its final event (or gives up)
            elif resume_grace_s() > 0:
                # The page is gone: the answer goes on for its grace period, for the page to
                # come back (chat.resume); the grace sweep ends and stores it otherwise.
                self.answer.detach.set()
            else:
                # No grace period: relay's cleanup aborts the request and stores the text.
                self.answer.give_up.set()
            await asyncio.wait({task}, timeout=chat_settings()["STOP_GRACE_S"])

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None,
                      **kwargs: Any) -> None:
        """One frame from the page: authorized, parsed, acted on. Never ends in an exception:
        a frame that cannot be acted on gets an ``error`` frame and the socket keeps working."""
        if self.closed or self.ending:
            return
        try:
            if not await self._still_authorized():
                return
            frame = parse_frame(text_data, bytes_data)
            kind = frame.get("type")
            if kind == "send":
                await self._send_turn(*turn_fields(frame))
            elif kind == "stop":
                await self._stop()
            elif kind == "resume":
                await self._resume(*resume_fields(frame))
            else:
                raise FrameError('Unknown request: "type" must be "send", "stop" or "resume".')
        except FrameError as exc:
            await self._error(str(exc))
        except Exception as exc:
            if database_unavailable(exc):
                unexpected_error(exc)  # logged (once in a while)
                await self._safe_send(unavailable_frame())
                return
            log.exception("a chat frame of user %s failed", getattr(self.user, "pk", None))
            await self._error("Something went wrong on the server. Try again in a moment.")

    async def _safe_send(self, frame: dict[str, Any]) -> None:
        if not self.closed:
            await self.send_json(frame)

    async def _error(self, message: str, **extra: Any) -> None:
        await self._safe_send({"type": "error", "message": message, **extra})

    async def _still_authorized(self) -> bool:
        """Check :func:`authorize` again; when it fails, end the socket (:meth:`_end`)."""
        granted = await database_sync_to_async(authorize)(self.session_key, self.user.pk,
                                                          self.tenant.pk)
        if isinstance(granted, Denial):
            await self._end(granted)
            return False
        self.user, self.tenant = granted
        return True

    async def _watch(self) -> None:
        """Re-check the authorization while the socket is open, even when no frame comes."""
        while not (self.closed or self.ending):
            await asyncio.sleep(chat_settings()["REAUTHORIZE_INTERVAL_S"])
            try:
                await self._still_authorized()
            except Exception as exc:  # noqa: BLE001 - the next frame or check decides
                if database_unavailable(exc):
                    unexpected_error(exc)  # every socket fails at once: logged once in a while
                else:
                    log.warning("could not re-check a chat socket's authorization",
                                exc_info=True)

    async def _end(self, denial: Denial) -> None:
        """Stop the answer being written (it is kept), tell the page why, close the socket."""
        if self.ending or self.closed:
            return
        self.ending = True
        task = self.task
        if task is not None and not task.done():
            self.answer.give_up.set()
            await asyncio.wait({task}, timeout=chat_settings()["STOP_GRACE_S"])
        await self._error(denial.message, closing=True)
        self.closed = True
        await self.close(code=denial.code, reason=denial.reason)

    async def _send_turn(self, conversation_id: int | None, text: str) -> None:
        if self.task is not None and not self.task.done():
            await self._error("An answer is still being written: wait for it or press Stop.")
            return
        conversation: Conversation | None = None
        if conversation_id is not None:
            conversation = await sync_to_async(selectors.conversation_of)(
                self.user, self.tenant, conversation_id)
            if conversation is None:
                await self._error("That conversation does not exist.")
                return
            if await resume.in_progress(conversation):
                await self._error("An answer is still being written in this conversation: "
                                  "wait for it or press Stop.")
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
        except Exception:
            log.exception("could not start a chat answer for user %s", self.user.pk)
            reason = "The server could not start the answer. Try again in a moment."
        else:
            await self._safe_send({"type": "start", "message_id": answer.message_id})
            self._relay(answer)
            return
        failed = await sync_to_async(services.fail_answer)(conversation, reason)
        await self._error(reason, message_id=failed.pk)

    def _relay(self, answer: generation.Answer) -> None:
        self.answer = answer
        self.task = asyncio.create_task(generation.relay(answer, self._safe_send))
        if self.ending:  # denied meanwhile (the watchdog): stop at once
            answer.give_up.set()
        elif self.closed:  # the page went away meanwhile: its grace period starts
            (answer.detach if resume_grace_s() > 0 else answer.give_up).set()

    async def _resume(self, conversation_id: int, message_id: int | None,
                      after_seq: int | None) -> None:
        """Take up the answer the page was showing (see :mod:`chat.resume`)."""
        if self.task is not None and not self.task.done():
            await self._error("An answer is still being written: wait for it or press Stop.")
            return
        try:
            taken = await resume.take_up(self.user, self.tenant, conversation_id, message_id,
                                         after_seq)
        except resume.NotFound as exc:
            await self._error(str(exc))
            return
        await self._safe_send(taken.frame)
        if taken.answer is not None:
            self._relay(taken.answer)

    async def _stop(self) -> None:
        answer, task = self.answer, self.task
        if answer is None or task is None or task.done():
            return
        answer.stop_requested = True
        await abort_later(answer.request_id)
        # The worker ends the request within a tick or two (a final "abort" event ends the
        # relay); if it does not confirm in time, stop relaying anyway.
        asyncio.get_running_loop().call_later(chat_settings()["STOP_GRACE_S"],
                                              answer.give_up.set)
