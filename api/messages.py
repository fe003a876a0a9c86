"""Chat messages of a request body, every role of OpenAI's message schema that is served.

A message of each role has the fields :data:`api.served_fields.MESSAGE_FIELDS` lists. Content is
a string or a list of text parts (an assistant's: text and refusal parts); an assistant's content
may be null or left out (an empty turn, or one that only calls tools). An assistant turn's
``tool_calls`` and a ``tool`` message (``tool_call_id``, the result of one call) make a chat's
history of tool use; :func:`check_tool_history` checks that each result answers a call of the
assistant turn before it, as OpenAI does. ``name`` and ``annotations`` are checked, not used
(the chat template has no place for them).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from api.fields import BodyObject, Name, Text, wrong_type
from gateway.errors import APIError

# OpenAI's rule for a function's name.
FUNCTION_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"
FunctionName = Annotated[str, Field(pattern=FUNCTION_NAME_PATTERN)]
# A tool call's id, as clients send them back (OpenAI's are ``call_`` and 24 characters).
CallId = Annotated[Text, Field(min_length=1, max_length=256)]


class CalledFunction(BodyObject):
    """The function an assistant turn called: its name and its arguments (JSON text, as the
    API gave them; sent back as they were)."""

    name: FunctionName
    arguments: Text


class AssistantToolCall(BodyObject):
    """One tool call of an assistant turn in the history. ``index`` (a streamed call's, which
    some clients keep when they send the turn back) is checked, not used."""

    id: CallId
    index: int | None = Field(None, ge=0)
    type: Literal["function"]
    function: CalledFunction


class ChatMessage(BodyObject):
    """One chat message, of any served role (see the module docstring).

    An assistant's ``refusal`` is part of its turn: the turn's text is its content, then its
    refusal. ``audio`` and ``function_call`` are accepted empty only (``api.served_fields``
    refuses the rest).
    """

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text
    name: Name | None = None
    refusal: Text | None = None
    annotations: list[Any] | None = None
    audio: None = None
    function_call: None = None
    tool_calls: Annotated[list[AssistantToolCall], Field(max_length=128)] | None = None
    tool_call_id: CallId | None = None

    @model_validator(mode="before")
    @classmethod
    def _assistant_content_optional(cls, data: Any) -> Any:
        """An assistant message without content is an empty turn, as with null content."""
        if isinstance(data, dict) and data.get("role") == "assistant" and "content" not in data:
            return {**data, "content": None}
        return data

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any, info: ValidationInfo) -> Any:
        """A string, or the text of a list of ``{"type": "text", "text": ...}`` parts (and, in an
        assistant's message, ``{"type": "refusal", "refusal": ...}`` parts)."""
        assistant = info.data.get("role") == "assistant"
        if isinstance(value, str):
            return value
        if value is None and assistant:
            return ""
        if not isinstance(value, list):
            raise wrong_type("a string or an array of text content parts")
        texts = []
        for part in value:
            kind = part.get("type") if isinstance(part, dict) else None
            key = "text" if kind == "text" else "refusal" if kind == "refusal" and assistant \
                else None
            if key is None or not isinstance(part.get(key), str):
                raise ValueError("only text content parts are supported" if not assistant else
                                 "only text and refusal content parts are supported")
            if not isinstance(part.get("prompt_cache_breakpoint"), dict | None):
                raise ValueError("a content part's 'prompt_cache_breakpoint' must be an object")
            texts.append(part[key])
        return "".join(texts)

    @model_validator(mode="after")
    def _tool_result_names_its_call(self) -> ChatMessage:
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a message of role 'tool' needs 'tool_call_id', the id of the call "
                             "it answers")
        return self

    def as_dict(self) -> dict[str, Any]:
        """The turn for the worker (``inference.protocol.messages.ChatTurn``'s fields)."""
        role = "system" if self.role == "developer" else self.role
        turn: dict[str, Any] = {"role": role, "content": self.content + (self.refusal or "")}
        if self.tool_calls:
            turn["tool_calls"] = [call.model_dump(exclude={"index"}) for call in self.tool_calls]
        if self.tool_call_id is not None:
            turn["tool_call_id"] = self.tool_call_id
        return turn


def check_tool_history(messages: list[ChatMessage]) -> None:
    """Each ``tool`` message answers a call of the assistant turn before it (other results of
    that turn may come between), each call of a turn gets exactly one result before the next
    message (as OpenAI checks), and the calls of one turn have distinct ids.

    Raises:
        APIError: 400 ``invalid_value`` naming ``messages[i].tool_call_id`` (or
            ``messages[i].role`` for a result with no call before it), or
            ``messages[i].tool_calls[j].id`` for an id given twice or a call left without a
            result.
    """
    calls: set[str] | None = None
    waiting: dict[str, str] = {}  # the turn's call ids without a result yet -> their field
    for i, message in enumerate([*messages, None]):
        if message is not None and message.role == "tool":
            if calls is None:
                raise APIError(400, (
                    f"Invalid value for 'messages[{i}].role': a message of role 'tool' must "
                    f"answer a tool call of the assistant message before it."),
                    param=f"messages[{i}].role", code="invalid_value")
            if message.tool_call_id not in calls:
                raise APIError(400, (
                    f"Invalid value for 'messages[{i}].tool_call_id': no tool call of the "
                    f"assistant message before it has the id {message.tool_call_id!r}."),
                    param=f"messages[{i}].tool_call_id", code="invalid_value")
            if message.tool_call_id not in waiting:
                raise APIError(400, (
                    f"Invalid value for 'messages[{i}].tool_call_id': the tool call "
                    f"{message.tool_call_id!r} has a result already."),
                    param=f"messages[{i}].tool_call_id", code="invalid_value")
            del waiting[message.tool_call_id]
            continue
        if waiting:
            call_id, where = next(iter(waiting.items()))
            raise APIError(400, (
                f"Invalid value for '{where}': an assistant message with 'tool_calls' must be "
                f"followed by a tool message answering each call; {call_id!r} has none."),
                param=where, code="invalid_value")
        calls = None
        if message is None:
            break
        if message.role == "assistant" and message.tool_calls:
            calls = set()
            for j, call in enumerate(message.tool_calls):
                waiting[call.id] = f"messages[{i}].tool_calls[{j}].id"
                if call.id in calls:
                    raise APIError(400, (
                        f"Invalid value for 'messages[{i}].tool_calls[{j}].id': the id "
                        f"{call.id!r} is given to two calls of one message."),
                        param=f"messages[{i}].tool_calls[{j}].id", code="invalid_value")
                calls.add(call.id)
