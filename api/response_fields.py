"""The body of ``POST /v1/responses``: its fields, and its ``input`` as stored items.

Input items served: messages (``role`` user, system, developer or assistant; content a string or
``input_text`` parts, an assistant's ``output_text`` or ``refusal`` parts), ``function_call`` and
``function_call_output``. Other items (images, files, reasoning, item references, built-in tools'
calls) get a 400 naming the item's ``type``. What the request asks of the model is checked as a
chat completion (:mod:`api.response_chat`).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field

from api import field_errors, served_fields
from api.bodies import parse_model
from api.fields import BodyObject, Name, Text, unicode_text
from api.response_events import new_id
from api.schemas import MAX_TOKENS_LIMIT
from gateway.errors import APIError

ROLES = ("user", "system", "developer", "assistant")
MAX_CALL_ID = 256  # characters of a call id, as a chat tool call's
# The keys each input item type may have (besides ``type``), and each content part type.
ITEM_KEYS = {
    "message": {"role", "content", "id", "status", "phase"},
    "function_call": {"call_id", "name", "arguments", "id", "status", "namespace"},
    "function_call_output": {"call_id", "output", "id", "status"},
}
PART_KEYS = {"input_text": {"text"}, "output_text": {"text", "annotations", "logprobs"},
             "refusal": {"refusal"}}
# Fields served only when they ask for nothing (null, or one of these values).
UNSERVED: dict[str, tuple[Any, ...] | None] = {
    "reasoning": (), "background": (False,), "max_tool_calls": (), "top_logprobs": (0,),
    "include": ([],), "conversation": (), "prompt": (), "context_management": (),
    "moderation": (), "image": (), "access_programs": (), "background_options": (),
    "truncation": ("disabled",), "stream_options": None,
}
REASONS = {
    "reasoning": "the served model does not reason", "background": "background responses",
    "include": "no extra output data is kept", "conversation": "use previous_response_id",
    "prompt": "stored prompt templates", "truncation": "only 'disabled' is served",
    "top_logprobs": "log-probabilities in the Responses API",
}


class TextFormat(BodyObject):
    type: Literal["text", "json_object", "json_schema"]
    name: Name | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: Text | None = None
    strict: bool | None = None


class TextConfig(BodyObject):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None


class ResponsesRequest(BodyObject):
    """``POST /v1/responses`` (see the module docstring); ``store`` defaults to true."""

    model: Annotated[str, Field(min_length=1), AfterValidator(unicode_text)]
    input: Text | list[Any]
    instructions: Text | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    metadata: dict[Text, Text] | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: Name | None = None
    text: TextConfig | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    user: Name | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "fast"] | None = None
    prompt_cache_key: Name | None = None
    prompt_cache_retention: Name | None = None
    safety_identifier: Name | None = None

    @property
    def text_format(self) -> dict[str, Any]:
        """``text.format`` as the response object echoes it."""
        fmt = self.text.format if self.text is not None else None
        if fmt is None:
            return {"type": "text"}
        return fmt.model_dump(by_alias=True, exclude_none=True)


def parse_request(body: dict[str, Any]) -> ResponsesRequest:
    """The request in ``body``.

    Raises:
        APIError: 400 naming the first field that is wrong, unknown (``unknown_parameter``) or
            asks for what this server does not serve (``unsupported_parameter``).
    """
    for name, neutral in UNSERVED.items():
        if neutral is None:  # checked on its own
            continue
        if name in body and not served_fields.asks_nothing(body[name], neutral):
            reason = REASONS.get(name)
            raise served_fields.unsupported(name, f"'{name}' is not supported by this server"
                                                  f"{f': {reason}' if reason else ''}.")
    _check_stream_options(body.get("stream_options"))
    req = parse_model(ResponsesRequest, {k: v for k, v in body.items() if k not in UNSERVED})
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_schema":
        for key, value in (("name", fmt.name), ("schema", fmt.schema_)):
            if value is None:
                raise APIError(400, f"Missing required parameter: 'text.format.{key}' (a "
                                    f"json_schema format needs it).",
                               param=f"text.format.{key}", code="missing_required_parameter")
    if body.get("stream_options") is not None and not req.stream:
        raise _bad("stream_options", "only allowed when 'stream' is enabled.")
    if req.previous_response_id == "":
        raise _bad("previous_response_id", "expected a response id, not an empty string.")
    return req


def _check_stream_options(options: Any) -> None:
    """``stream_options``: null, or an object whose only key ``include_obfuscation`` is false."""
    if options is None:
        return
    if not isinstance(options, dict):
        raise _bad("stream_options", "expected an object or null.")
    for key, value in options.items():
        if key != "include_obfuscation":
            path = field_errors.written_path(("stream_options", key))
            raise APIError(400, field_errors.unknown_field_message(path), param=path,
                           code="unknown_parameter")
        if value is True:
            raise served_fields.unsupported("stream_options.include_obfuscation", (
                "'stream_options.include_obfuscation' is not supported by this server: its "
                "events carry no obfuscation field (send false or leave it out)."))
        if value is not None and value is not False:
            raise _bad("stream_options.include_obfuscation", "expected a boolean.")


def _bad(param: str, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, f"Invalid value for '{param}': {message}", param=param, code=code)


def _text(value: Any, param: str) -> str:
    if not isinstance(value, str):
        raise _bad(param, "expected a string.")
    try:
        return unicode_text(value)
    except ValueError as exc:
        raise _bad(param, str(exc)) from exc


def _keys(obj: dict[str, Any], allowed: set[str], param: str) -> None:
    for key in obj:
        if key != "type" and key not in allowed:
            path = field_errors.written_path((*_loc(param), key))
            raise APIError(400, field_errors.unknown_field_message(path), param=path,
                           code="unknown_parameter")


def shown(kind: Any) -> str:
    """A ``type`` as an error names it: a short string quoted, any other value by its JSON
    type (a value is never echoed whole)."""
    if isinstance(kind, str) and len(kind) <= 40:
        return repr(kind)
    return field_errors.json_type(kind)


def _loc(param: str) -> tuple[int | str, ...]:
    """``input[2].content[0]`` as a location: ``("input", 2, "content", 0)``."""
    return tuple(int(part) if part.isdigit() else part
                 for part in re.findall(r"[^.\[\]]+", param))


def _content_text(content: Any, role: str, param: str, owner: str = "") -> str:
    """A message's content as text: a string, or its text parts joined (``owner``: what the
    content is of, as an error names it)."""
    if isinstance(content, str):
        return _text(content, param)
    if not isinstance(content, list):
        raise _bad(param, "expected a string or an array of content parts.")
    served = ("output_text", "refusal") if role == "assistant" else ("input_text",)
    texts = []
    for j, part in enumerate(content):
        where = f"{param}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in served:
            raise served_fields.unsupported(f"{where}.type", (
                f"A content part of type {shown(kind)} is not supported here: "
                f"{owner or f'a message of role {role!r}'} takes "
                f"{' and '.join(repr(s) for s in served)} parts."))
        _keys(part, PART_KEYS[kind], where)
        key = "refusal" if kind == "refusal" else "text"
        texts.append(_text(part.get(key), f"{where}.{key}"))
    return "".join(texts)


def input_items(value: str | list[Any]) -> list[dict[str, Any]]:
    """The request's ``input`` as stored items (each with an ``id`` and ``status``): a string is
    one user message.

    Raises:
        APIError: 400 naming the item (``input[2].type``...) that is malformed or not served.
    """
    if isinstance(value, str):
        value = [{"role": "user", "content": value}]
    if not value:
        raise _bad("input", "expected at least one item.")
    return [_item(raw, f"input[{i}]") for i, raw in enumerate(value)]


def _item(raw: Any, param: str) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise _bad(param, "expected an object (an input item).")
    kind = raw.get("type", "message" if "role" in raw else None)
    if kind is None:
        raise _bad(f"{param}.type", "an input item needs its 'type' ('message', "
                                    "'function_call', 'function_call_output'), or a message "
                                    "its 'role'.")
    if not isinstance(kind, str) or kind not in ITEM_KEYS:
        raise served_fields.unsupported(f"{param}.type", (
            f"Input items of type {shown(kind)} are not supported by this server: it serves "
            f"'message', 'function_call' and 'function_call_output'."))
    _keys(raw, ITEM_KEYS[kind], param)
    item_id = raw.get("id")
    item_id = _text(item_id, f"{param}.id") if item_id is not None else None
    if kind == "message":
        role = raw.get("role")
        if role not in ROLES:
            raise _bad(f"{param}.role", f"expected one of {', '.join(ROLES)}.")
        text = _content_text(raw.get("content"), role, f"{param}.content")
        if role == "assistant":
            return {"id": item_id or new_id("msg"), "type": "message", "role": role,
                    "status": "completed", "content": [{"type": "output_text", "text": text,
                                                        "annotations": []}]}
        return {"id": item_id or new_id("msg"), "type": "message", "role": role,
                "status": "completed", "content": [{"type": "input_text", "text": text}]}
    call_id = _text(raw.get("call_id"), f"{param}.call_id")
    if not 1 <= len(call_id) <= MAX_CALL_ID:
        raise _bad(f"{param}.call_id", f"expected 1 to {MAX_CALL_ID} characters, but got "
                                       f"{len(call_id)}.")
    if kind == "function_call":
        return {"id": item_id or new_id("fc"), "type": kind, "status": "completed",
                "call_id": call_id, "name": _text(raw.get("name"), f"{param}.name"),
                "arguments": _text(raw.get("arguments"), f"{param}.arguments")}
    output = raw.get("output")
    text = (_content_text(output, "user", f"{param}.output", "a function call's output")
            if isinstance(output, list)
            else _text(output, f"{param}.output"))
    return {"id": item_id or new_id("fco"), "type": kind, "status": "completed",
            "call_id": call_id, "output": text}
