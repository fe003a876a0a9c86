"""Which request fields this server serves, and the refusal of the fields it does not serve.

Every top-level field of a request body is in one of four classes (``docs/platform.md``, "Request
fields, by what the server does with them"):

(a) honoured: the fields of :class:`api.schemas.ChatCompletionRequest` and
    :class:`api.schemas.CompletionRequest` that shape the answer, structured outputs included
    (OpenAI's ``response_format``, vLLM's ``structured_outputs``: :mod:`api.structured_fields`)
    and tool calling (``tools``, ``tool_choice``, ``parallel_tool_calls``:
    :mod:`api.tool_fields`);
(b) accepted: OpenAI fields that do not change the answer (``store``, ``metadata``, ...), declared
    on the same classes: type-checked, not used;
(c) not served: OpenAI fields that would change the answer (``logit_bias``, the deprecated
    ``functions``, ...) and
    vLLM's old guided decoding (``guided_json``, ...: its message points to ``response_format``
    and ``structured_outputs``): refused here with a 400 ``unsupported_parameter`` naming the
    field, unless ``null`` or at a value that asks for nothing (``functions: []``). So are
    the keys of ``structured_outputs`` other than its four constraints (``whitespace_pattern``,
    ``json_object``, ...), named by their path (``structured_outputs.whitespace_pattern``);
(d) unknown: any other field, refused by the body classes (:class:`api.fields.BodyObject`) with a
    400 ``unknown_parameter`` naming it, in OpenAI's words ("Unrecognized request argument
    supplied: X").

Messages follow the same rule, per role: every field of OpenAI's message schema for the role is
accepted (``name``, an assistant's ``refusal``, ``annotations`` and ``tool_calls``, a ``tool``
message's ``tool_call_id``, and ``audio`` and ``function_call`` when ``null``); a ``function``
message, an assistant message that carries an audio answer or a function call, and image, audio
and file content parts are refused (``unsupported_parameter``, naming the field's path); any
other field is unknown.
"""

from __future__ import annotations

from typing import Any

from api import field_errors
from gateway.errors import APIError

# (c), with the values (besides null) that ask for nothing.
UNSERVED_CHAT_FIELDS: dict[str, tuple[Any, ...]] = {
    "functions": ([],),
    "function_call": ("none",),
    "logit_bias": ({},),
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "audio": (),
    "modalities": (["text"],),
    "prediction": (),
    "reasoning_effort": ("none",),  # the model does not reason: "none" is what it does
    "verbosity": (),
    "web_search_options": (),
    "moderation": (),
}
UNSERVED_COMPLETION_FIELDS: dict[str, tuple[Any, ...]] = {
    "suffix": ("",),
    "best_of": (1,),
    "logit_bias": ({},),
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
}
# vLLM's old extensions for constrained output, on both endpoints (``structured_outputs`` took
# their place: :mod:`api.structured_fields`).
GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
                 "guided_decoding_backend", "guided_whitespace_pattern")
# The keys of vLLM's ``structured_outputs`` not served, with the values (besides null) that ask
# for nothing, and why.
UNSERVED_STRUCTURED_KEYS: dict[str, tuple[Any, ...]] = {
    "json_object": (False,),
    "structural_tag": (),
    "whitespace_pattern": (),
    "disable_any_whitespace": (False,),
    "disable_additional_properties": (False,),
    "disable_fallback": (False, True),  # one grammar library, which never falls back
}
STRUCTURED_REASONS = {
    "json_object": "ask for any JSON object with 'response_format' {\"type\": \"json_object\"}",
    "structural_tag": "it does not serve structural tags",
    "whitespace_pattern": "the whitespace of a JSON answer is the grammar library's",
    "disable_any_whitespace": "the whitespace of a JSON answer is the grammar library's",
    "disable_additional_properties": "a schema is applied as written: say "
                                     "'additionalProperties': false in it",
}
# Why a field is not served, where there is more to say than that.
REASONS = {
    "functions": "the deprecated function calling is not served: offer 'tools' instead",
    "function_call": "the deprecated function calling is not served: use 'tool_choice' with "
                     "'tools' instead",
    "modalities": 'it answers in text only: ["text"]',
    "reasoning_effort": 'the served model does not reason: only "none" is served',
    "best_of": "it does not rank samples: ask for 'n' choices and pick among them",
}

# The fields of a message of each role that this server knows (OpenAI's message schema; an
# assistant's ``annotations`` as the API answers them, which clients send back).
MESSAGE_FIELDS: dict[str, tuple[str, ...]] = {
    "system": ("role", "content", "name"),
    "developer": ("role", "content", "name"),
    "user": ("role", "content", "name"),
    "assistant": ("role", "content", "name", "refusal", "annotations", "audio",
                  "function_call", "tool_calls"),
    "tool": ("role", "content", "tool_call_id"),
}
UNSERVED_ROLES = ("function",)
# Fields of an assistant message that would change the answer, with the values (besides null)
# that ask for nothing.
UNSERVED_ASSISTANT_FIELDS: dict[str, tuple[Any, ...]] = {"function_call": (), "audio": ()}
ASSISTANT_REASONS = {"function_call": "the deprecated function calling (send 'tool_calls')",
                     "audio": "audio answers"}
UNSERVED_PART_TYPES = ("image_url", "input_audio", "file")
# The fields of each content part type served (a refusal part: an assistant's only).
PART_FIELDS: dict[str, tuple[str, ...]] = {
    "text": ("type", "text", "prompt_cache_breakpoint"),
    "refusal": ("type", "refusal"),
}


def asks_nothing(value: Any, neutral: tuple[Any, ...]) -> bool:
    """Whether ``value`` is null or one of ``neutral`` (of the same JSON type: ``false`` is not
    ``0``)."""
    return value is None or any(type(value) is type(n) and value == n for n in neutral)


def unsupported(param: str, message: str) -> APIError:
    """The 400 ``unsupported_parameter`` for the field ``param`` (its path, as written)."""
    return APIError(400, message, param=param, code="unsupported_parameter")


def unknown(loc: tuple[int | str, ...], why: str = "", *, param: str | None = None) -> APIError:
    """The error for a field this server does not know, at ``loc`` (``param``: the field named
    instead, as the errors of content parts name their message's ``content``)."""
    path = field_errors.written_path(loc)
    return APIError(400, field_errors.unknown_field_message(path, why), param=param or path,
                    code="unknown_parameter")


def key_not_unicode(body: dict[str, Any],
                    loc: tuple[int | str, ...]) -> tuple[int | str, ...] | None:
    """Where a key that is not valid Unicode text (a lone surrogate) is, in the object at ``loc``
    of ``body`` (pydantic reports such a key at its object, without naming it); None: none."""
    node: Any = body
    for part in loc:
        try:
            node = node[part]
        except (KeyError, IndexError, TypeError):
            return None
    for key in node if isinstance(node, dict) else ():
        try:
            key.encode("utf-8")
        except UnicodeEncodeError:
            return (*loc, key)
    return None


def _not_served(name: str) -> APIError:
    reason = REASONS.get(name)
    return unsupported(name, f"'{name}' is not supported by this server"
                             f"{f': {reason}' if reason else ''}.")


def refuse_unserved(body: dict[str, Any], *, chat: bool) -> dict[str, Any]:
    """``body`` without its fields of class (c), once each is found to ask for nothing.

    Raises:
        APIError: 400 ``unsupported_parameter`` naming the first field (or message field) that
            asks for what this server does not serve; ``unknown_parameter`` for a message field
            its role does not have.
    """
    unserved = UNSERVED_CHAT_FIELDS if chat else UNSERVED_COMPLETION_FIELDS
    for name, value in body.items():
        if name in GUIDED_FIELDS and value is not None:
            raise unsupported(name, (
                f"'{name}' (vLLM's old guided decoding) is not supported by this server: ask for "
                f"constrained output with 'response_format' (OpenAI's: json_object, json_schema) "
                f"or 'structured_outputs' (vLLM's: json, regex, choice, grammar)."))
        if name in unserved and not asks_nothing(value, unserved[name]):
            raise _not_served(name)
    options = body.get("stream_options")
    if isinstance(options, dict) and options.get("include_obfuscation") is True:
        raise unsupported("stream_options.include_obfuscation", (
            "'stream_options.include_obfuscation' is not supported by this server: its stream "
            "chunks carry no obfuscation field (send false or leave it out)."))
    if chat:
        _refuse_unserved_messages(body.get("messages"))
    served = {name: value for name, value in body.items()
              if name not in unserved and name not in GUIDED_FIELDS}
    if isinstance(served.get("structured_outputs"), dict):
        served["structured_outputs"] = _refuse_unserved_structured(served["structured_outputs"])
    return served


def _refuse_unserved_structured(fields: dict[str, Any]) -> dict[str, Any]:
    """``structured_outputs`` without its vLLM keys not served, once each asks for nothing."""
    for name, value in fields.items():
        if name in UNSERVED_STRUCTURED_KEYS and not asks_nothing(
                value, UNSERVED_STRUCTURED_KEYS[name]):
            reason = STRUCTURED_REASONS.get(name)
            raise unsupported(f"structured_outputs.{name}", (
                f"'structured_outputs.{name}' is not supported by this server"
                f"{f': {reason}' if reason else ''} (send null or leave it out)."))
    return {name: value for name, value in fields.items()
            if name not in UNSERVED_STRUCTURED_KEYS}


def _refuse_unserved_messages(messages: Any) -> None:
    """Refuse what a message asks for and this server does not serve; a message of another shape
    is left to the body classes, which name what is wrong with it."""
    if not isinstance(messages, list):
        return
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            continue
        where, role = f"messages[{i}]", message.get("role")
        if isinstance(role, str) and role in UNSERVED_ROLES:
            raise unsupported(f"{where}.role", (
                f"'{where}' is a '{role}' message, which is not supported by this server: the "
                f"deprecated function calling is not served (send a 'tool' message)."))
        if not (isinstance(role, str) and role in MESSAGE_FIELDS):
            continue
        for name, value in message.items():
            if name not in MESSAGE_FIELDS[role]:
                raise unknown(("messages", i, name),
                              f"a message of role '{role}' has no such field")
            if name in UNSERVED_ASSISTANT_FIELDS and not asks_nothing(
                    value, UNSERVED_ASSISTANT_FIELDS[name]):
                raise unsupported(f"{where}.{name}", (
                    f"'{where}.{name}' is not supported by this server: it does not serve "
                    f"{ASSISTANT_REASONS[name]}."))
        content = message.get("content")
        if isinstance(content, list):
            _refuse_unserved_parts(i, content)


def _refuse_unserved_parts(i: int, parts: list[Any]) -> None:
    """Content parts: their errors name the message's ``content``, as its other errors do."""
    param = f"messages[{i}].content"
    for j, part in enumerate(parts):
        if not isinstance(part, dict):
            continue
        kind = part.get("type")
        if isinstance(kind, str) and kind in UNSERVED_PART_TYPES:
            raise unsupported(param, (
                f"'{param}[{j}]' is a content part of type '{kind}', which is not supported by "
                f"this server: only text content parts are."))
        if isinstance(kind, str) and kind in PART_FIELDS:
            for name in part:
                if name not in PART_FIELDS[kind]:
                    raise unknown(("messages", i, "content", j, name),
                                  f"a content part of type '{kind}' has no such field",
                                  param=param)
