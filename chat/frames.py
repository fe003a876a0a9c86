"""The chat websocket's frames: what the page sends and gets, and the checks of what it sends.

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
    one of the application close codes of :mod:`chat.authorization`, or with 4503 of
    :mod:`chat.outages` when the database cannot serve, which the page reconnects after; an
    error the server expects to pass also has ``code``, ``retryable`` and ``retry_after_ms``).

A frame from the page that cannot be read (binary, not JSON, JSON that is not an object, fields
of the wrong type, a frame longer than :data:`MAX_FRAME_CHARS`) raises :class:`FrameError` here;
the consumer (:mod:`chat.consumers`) answers it with an ``error`` frame.
"""

from __future__ import annotations

import json
from typing import Any

MAX_MESSAGE_CHARS = 32_000
# Longer frames are refused unread. A message of MAX_MESSAGE_CHARS fits even with every
# character JSON-escaped (12 characters for one outside the BMP: "\ud83d\ude00").
MAX_FRAME_CHARS = 12 * MAX_MESSAGE_CHARS + 1024
# Conversation ids are 64-bit database keys.
MAX_ID = 2**63 - 1


class FrameError(ValueError):
    """A frame the socket cannot act on; the message is shown in the page as it is."""


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
