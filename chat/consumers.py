"""The chat websocket: one signed-in user's turns, streamed token by token.

Frames from the page (text frames, each one JSON object):
    ``{"type": "send", "conversation_id": <id or null>, "content": "..."}``: a new user turn
    (a null or missing id starts a conversation); ``{"type": "stop"}``: stop the answer this
    socket is writing (other fields are ignored: a socket only ever stops its own answer);
    ``{"type": "resume", "conversation_id": <id>, "message_id": <id or null>,
    "after_seq": <int or null>}``: a page that came back (reconnected, reloaded) takes up the
    answer of its conversation that it was showing, after the last ``seq`` it has
    (:mod:`chat.resume`).
Frames to the page:
    ``conversation`` (id, title, created), ``user_message``, ``start`` (the answer's message id),
    ``token`` (message id, ``seq``, text), ``done`` (status ``complete``, ``stopped`` or
    ``error``, with a readable ``error``), ``resume`` (message id, ``after_seq``: the tokens
    after it follow), ``answer`` (an answer that ended while the page was away, as stored, or
    null), ``error`` (a frame that could not be acted on, with a readable ``message``; the
    socket keeps working, unless the frame says ``"closing": true``: then the socket closes with
    one of the application close codes below).

The answer streams from its own task, so Stop and a closed page are handled while tokens flow:
Stop aborts the request in the worker at once (its answer is kept and marked stopped). Closing
the socket does not stop the answer: it goes on for ``RESUME_GRACE_S`` (:mod:`chat.conf`), for
the page to come back; then it is aborted and stored as ``stopped`` (:mod:`chat.generation`).
Anonymous sockets are refused; a socket reaches only its own user's conversations under the
user's tenant, and only the requests it made or resumed.

Authorization holds at every use, not only at connect: before each frame is acted on, and every
``REAUTHORIZE_INTERVAL_S`` while the socket is open (:mod:`chat.conf`), :func:`authorize` checks
that the session that opened the socket still exists (signing out deletes it) and still signs in
the same active user, and that this user still belongs to the same active tenant. When that no
longer holds, an answer being written is stopped (and kept), the page gets a closing ``error``
frame and the socket closes with 4401 (signed out, account disabled) or 4403 (tenant lost).

Any other frame (binary, not JSON, JSON that is not an object, an unknown type, fields of the
wrong type, a frame longer than :data:`MAX_FRAME_CHARS`) gets an ``error`` frame, and so does a
turn that fails inside the server; the socket stays open.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from importlib import import_module
from typing import Any

from asgiref.sync import sync_to_async
from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.conf import settings
from django.contrib.auth import (
    BACKEND_SESSION_KEY,
    HASH_SESSION_KEY,
    SESSION_KEY,
    get_user_model,
    load_backend,
)
from django.contrib.auth.models import AbstractBaseUser
from django.utils.crypto import constant_time_compare

from chat import generation, resume, selectors, services
from chat.conf import chat_settings, resume_grace_s
from chat.context import ContextOverflowError
from chat.models import Conversation
from gateway import monitor
from gateway.errors import APIError
from gateway.events import abort_later
from tenants.models import Tenant

log = logging.getLogger(__name__)

# Close codes (4000-4999 are the application's): not signed in, no tenant.
CLOSE_UNAUTHENTICATED = 4401
CLOSE_NO_TENANT = 4403
MAX_MESSAGE_CHARS = 32_000
# Longer frames are refused unread. A message of MAX_MESSAGE_CHARS fits even with every
# character JSON-escaped (12 characters for one outside the BMP: "\ud83d\ude00").
MAX_FRAME_CHARS = 12 * MAX_MESSAGE_CHARS + 1024
# Conversation ids are 64-bit database keys.
MAX_ID = 2**63 - 1


class FrameError(ValueError):
    """A frame the socket cannot act on; the message is shown in the page as it is."""


@dataclass(frozen=True)
class Denial:
    """Why a socket may no longer act for its user: shown in the page, then the close code."""

    code: int
    reason: str  # the close frame's reason (short)
    message: str  # the error frame's readable message


SIGNED_OUT = Denial(CLOSE_UNAUTHENTICATED, "signed out",
                    "You are signed out (or your account was disabled). Sign in again to chat.")
NO_TENANT = Denial(CLOSE_NO_TENANT, "no tenant",
                   "Your account no longer belongs to an active tenant, so it cannot chat.")
OTHER_TENANT = Denial(CLOSE_NO_TENANT, "tenant changed",
                      "Your account now belongs to another tenant. Reload the page to chat "
                      "there.")


def _session_signs_in(data: dict[str, Any], user: AbstractBaseUser) -> bool:
    """Whether the session's auth hash is ``user``'s (the current key's or a fallback's).

    Read-only, unlike :func:`django.contrib.auth.get_user`: a socket never rotates or flushes
    the browser's session (it cannot set the cookie).
    """
    if not hasattr(user, "get_session_auth_hash"):
        return True
    stored = data.get(HASH_SESSION_KEY)
    if not isinstance(stored, str) or not stored:
        return False
    fallbacks = getattr(user, "get_session_auth_fallback_hash", lambda: [])()
    return any(constant_time_compare(stored, expected)
               for expected in [user.get_session_auth_hash(), *fallbacks])


def authorize(session_key: str | None, user_pk: Any,
              tenant_pk: int | None = None) -> tuple[AbstractBaseUser, Tenant] | Denial:
    """Who a socket acts for now, read fresh from the session store and the database.

    Args:
        session_key: the session that authenticated the socket (None: none did).
        user_pk: the user it authenticated.
        tenant_pk: the tenant the socket was opened under; None at connect.

    Returns:
        (the user, the user's active tenant), or why not: :data:`SIGNED_OUT` when the session is
        gone (signed out, expired), signs in someone else, no longer verifies (password changed)
        or the user is inactive; :data:`NO_TENANT` when the user belongs to no active tenant;
        :data:`OTHER_TENANT` when it belongs to another one than ``tenant_pk``.
    """
    if not session_key:
        return SIGNED_OUT
    store = import_module(settings.SESSION_ENGINE).SessionStore(session_key)
    data = {key: store.get(key) for key in (SESSION_KEY, BACKEND_SESSION_KEY, HASH_SESSION_KEY)}
    backend_path = data[BACKEND_SESSION_KEY]
    if data[SESSION_KEY] is None or backend_path not in settings.AUTHENTICATION_BACKENDS:
        return SIGNED_OUT
    try:
        session_user_pk = get_user_model()._meta.pk.to_python(data[SESSION_KEY])
    except Exception:  # noqa: BLE001 - a malformed session signs no one in
        return SIGNED_OUT
    if session_user_pk != user_pk:
        return SIGNED_OUT
    user = load_backend(backend_path).get_user(session_user_pk)
    if (user is None or not getattr(user, "is_active", True)
            or not _session_signs_in(data, user)):
        return SIGNED_OUT
    tenant = selectors.user_tenant(user)
    if tenant is None:
        return NO_TENANT
    if tenant_pk is not None and tenant.pk != tenant_pk:
        return OTHER_TENANT
    return user, tenant


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def parse_frame(text_data: str | None, bytes_data: bytes | None) -> dict[str, Any]:
    """The JSON object a frame holds.

    Raises:
        FrameError: a binary or empty frame, one longer than :data:`MAX_FRAME_CHARS`, text that
            is not JSON (``NaN`` and ``Infinity`` included) or nested too deeply to read, JSON
            that is not an object.
    """
    if text_data is None:
        raise FrameError("Frames must be JSON text, not binary data.")
    if len(text_data) > MAX_FRAME_CHARS:
        raise FrameError(f"The frame is too long (at most {MAX_FRAME_CHARS} characters).")
    try:
        content = json.loads(text_data, parse_constant=_no_constant)
    except RecursionError:
        raise FrameError("The frame's JSON is nested too deeply.") from None
    except ValueError:
        raise FrameError("The frame is not valid JSON.") from None
    if not isinstance(content, dict):
        raise FrameError('The frame must be a JSON object with a "type".')
    return content


def turn_fields(frame: dict[str, Any]) -> tuple[int | None, str]:
    """A ``send`` frame's conversation id (None: a new conversation) and message text.

    Raises:
        FrameError: no text, text that is not valid Unicode or too long, an id that is not a
            positive integer.
    """
    text = frame.get("content")
    if not isinstance(text, str) or not text.strip():
        raise FrameError("Type a message first.")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: JSON allows it, text does not
        raise FrameError("The message contains characters that are not valid text.") from None
    if len(text) > MAX_MESSAGE_CHARS:
        raise FrameError(f"The message is too long (at most {MAX_MESSAGE_CHARS} characters).")
    pk = frame.get("conversation_id")
    if pk is not None and (isinstance(pk, bool) or not isinstance(pk, int)
                           or not 0 < pk <= MAX_ID):
        raise FrameError('"conversation_id" must be the number of one of your conversations, '
                         "or null to start one.")
    return pk, text


def _is_id(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and 0 < value <= MAX_ID


def resume_fields(frame: dict[str, Any]) -> tuple[int, int | None, int | None]:
    """A ``resume`` frame's conversation id, answer id (None: the conversation's last) and the
    last ``seq`` the page has (None: none).

    Raises:
        FrameError: a conversation id that is not a positive integer, an answer id that is
            neither that nor null, an ``after_seq`` that is neither an integer from -1 nor null.
    """
    conversation_id = frame.get("conversation_id")
    if not _is_id(conversation_id):
        raise FrameError('"conversation_id" must be the number of one of your conversations.')
    message_id = frame.get("message_id")
    if message_id is not None and not _is_id(message_id):
        raise FrameError('"message_id" must be the number of an answer of that conversation, '
                         "or null for its last one.")
    after_seq = frame.get("after_seq")
    if after_seq is not None and (isinstance(after_seq, bool) or not isinstance(after_seq, int)
                                  or not -1 <= after_seq <= MAX_ID):
        raise FrameError('"after_seq" must be the last "seq" the page has (-1: none), or '
                         "null.")
    return conversation_id, message_id, after_seq


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
        except Exception:
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
            except Exception:  # noqa: BLE001 - the next frame or check decides
                log.warning("could not re-check a chat socket's authorization", exc_info=True)

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
