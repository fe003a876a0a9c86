"""A Responses request as the chat completion it asks for (``docs/platform.md``, "The Responses
API"): its items (after those of the ``previous_response_id`` chain, and ``instructions`` as the
system message) become chat messages (:class:`Turn`), its function ``tools``, ``tool_choice`` and
``text.format`` the chat's ``tools``, ``tool_choice`` and ``response_format``,
``max_output_tokens`` the chat's ``max_completion_tokens``; the result is validated as a chat
completion (:func:`api.schemas.validate`), so every limit and check is the chat's. An error found
there names the field as the Responses request wrote it (:func:`responses_param`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from api import served_fields
from api.response_fields import ResponsesRequest, shown
from api.schemas import ChatCompletionRequest, validate
from gateway.errors import APIError


@dataclass
class Turn:
    """One chat message built from stored items, with the field each part came from: ``origin``
    (``input[3]``, ``instructions``, ``previous_response_id``) and, for an assistant turn, the
    origin of each of its ``tool_calls`` (``calls``)."""

    message: dict[str, Any]
    origin: str
    calls: list[str] = field(default_factory=list)


def chat_messages(items: list[dict[str, Any]], origin: str) -> list[Turn]:
    """Stored items (input items, or a response's output items) as chat messages, each with the
    field it came from (``origin``, or ``origin[i]`` when ``origin`` is ``input``): a
    ``function_call`` joins the assistant turn before it (else starts one), a
    ``function_call_output`` is a ``tool`` message."""
    out: list[Turn] = []
    for i, item in enumerate(items):
        where = f"{origin}[{i}]" if origin == "input" else origin
        if item["type"] == "message":
            text = "".join(p.get("text", p.get("refusal", "")) for p in item["content"])
            out.append(Turn({"role": item["role"], "content": text}, where))
        elif item["type"] == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = out[-1] if out else None
            if last is None or last.message["role"] != "assistant":
                last = Turn({"role": "assistant", "content": None}, where)
                out.append(last)
            last.message.setdefault("tool_calls", []).append(call)
            last.calls.append(where)
        elif item["type"] == "function_call_output":
            out.append(Turn({"role": "tool", "tool_call_id": item["call_id"],
                             "content": item["output"]}, where))
    return out


def check_outputs(turns: list[Turn]) -> None:
    """Every function call has exactly one ``function_call_output``, after it and before the
    next message, as OpenAI requires.

    Raises:
        APIError: 400 naming the call left without an output (``input`` when it came from the
            ``previous_response_id`` chain), or the second output of a call.
    """
    waiting: dict[str, str] = {}  # call id -> where the call came from
    answered: set[str] = set()
    for turn in [*turns, Turn({"role": "user"}, "input")]:
        role = turn.message["role"]
        if role == "tool":
            call_id = turn.message["tool_call_id"]
            if call_id not in waiting and call_id not in answered:
                raise APIError(400, f"Invalid value for '{turn.origin}.call_id': no function "
                                    f"call just before this output has the call id "
                                    f"{call_id!r}.", param=f"{turn.origin}.call_id",
                               code="invalid_value")
            if call_id in answered:
                raise APIError(400, f"Invalid value for '{turn.origin}.call_id': the function "
                                    f"call {call_id!r} has an output already.",
                               param=f"{turn.origin}.call_id", code="invalid_value")
            waiting.pop(call_id, None)
            answered.add(call_id)
            continue
        if waiting:
            call_id, where = next(iter(waiting.items()))
            param = f"{where}.call_id" if where.startswith("input[") else "input"
            raise APIError(400, f"No function_call_output found for the function call "
                                f"{call_id!r} ('{where}'): each call needs its output before "
                                f"the next message.", param=param, code="invalid_value")
        answered = set()
        for call, where in zip(turn.message.get("tool_calls") or (), turn.calls, strict=False):
            waiting[call["id"]] = where


def chat_tools(tools: list[Any] | None) -> list[Any] | None:
    """Responses function tools (``{"type": "function", "name", "parameters", ...}``) in the chat
    shape; any other tool type gets a 400 naming it."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise served_fields.unsupported(f"tools[{i}].type", (
                f"Tools of type {shown(kind)} are not supported by this server: it serves "
                f"function tools ({{'type': 'function', 'name': ..., 'parameters': ...}})."))
        out.append({"type": "function",
                    "function": {k: v for k, v in tool.items() if k != "type"}})
    return out


def chat_tool_choice(choice: Any) -> Any:
    """``tool_choice`` in the chat shape: a string as is, ``{"type": "function", "name"}`` as
    the chat's named function; another object (built-in tools, ``allowed_tools``) gets a 400."""
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and set(choice) == {
            "type", "name"}:
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(400, "Invalid value for 'tool_choice': expected \"none\", \"auto\", "
                        "\"required\" or {\"type\": \"function\", \"name\": ...}.",
                   param="tool_choice", code="invalid_value")


def response_format(req: ResponsesRequest) -> dict[str, Any] | None:
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    schema = {k: v for k, v in {"name": fmt.name, "schema": fmt.schema_,
                                "description": fmt.description, "strict": fmt.strict}.items()
              if v is not None}
    return {"type": "json_schema", "json_schema": schema}


_PARAMS = [(re.compile(r"^tools\[(\d+)\]\.function"), r"tools[\1]"),
           (re.compile(r"^tool_choice\.function"), "tool_choice"),
           (re.compile(r"^response_format(\.json_schema)?"), "text.format"),
           (re.compile(r"^(max_completion_tokens|max_tokens)$"), "max_output_tokens")]
# A call's field in the chat shape (under tool_calls[j]), as its function_call item names it.
_CALL_FIELDS = {".id": ".call_id", ".function.name": ".name", ".function.arguments": ".arguments"}


def _message_param(turn: Turn, rest: str) -> str:
    """A chat message's field (``rest``: ``.content``, ``.tool_calls[0].id``...) as the item it
    came from names it."""
    if not turn.origin.startswith("input["):
        return turn.origin
    if (call := re.match(r"^\.tool_calls\[(\d+)\](.*)$", rest)) is not None:
        j = int(call.group(1))
        where = turn.calls[j] if j < len(turn.calls) else turn.origin
        return where + _CALL_FIELDS.get(call.group(2), "")
    if rest == ".tool_call_id":
        return turn.origin + ".call_id"
    if rest.startswith(".content"):
        return turn.origin + (".output" if turn.message["role"] == "tool" else ".content")
    return turn.origin


def responses_param(param: str | None, turns: list[Turn]) -> str | None:
    """A chat completion's field (``messages[3].content``, ``tools[0].function.name``) as the
    Responses request wrote it (``input[1].content``, ``tools[0].name``)."""
    if param is None:
        return None
    if (found := re.match(r"^messages(?:\[(\d+)\](.*))?$", param)) is not None:
        index = found.group(1)
        if index is None or int(index) >= len(turns):
            return "input"
        return _message_param(turns[int(index)], found.group(2) or "")
    for pattern, written in _PARAMS:
        param = pattern.sub(written, param)
    return param


def as_chat(exc: APIError, turns: list[Turn]) -> APIError:
    """``exc`` (a chat completion's error) naming the Responses request's field instead."""
    written = responses_param(exc.param, turns)
    if written != exc.param and exc.param is not None:
        exc.message = exc.message.replace(exc.param, written or "")
        exc.param = written
    return exc


def chat_request(req: ResponsesRequest, turns: list[Turn]
                 ) -> tuple[ChatCompletionRequest, list[Turn]]:
    """The chat completion ``req`` asks for, over ``turns``, and the turns with its
    ``instructions`` (for :func:`as_chat`).

    Raises:
        APIError: 400 naming the Responses request's field, as :func:`api.schemas.validate`
            refuses the chat completion (or :func:`check_outputs` the function calls).
    """
    if req.instructions:
        turns = [Turn({"role": "system", "content": req.instructions}, "instructions"), *turns]
    tools = chat_tools(req.tools)
    check_outputs(turns)
    body = {"model": req.model, "messages": [t.message for t in turns],
            "max_completion_tokens": req.max_output_tokens, "temperature": req.temperature,
            "top_p": req.top_p, "stream": req.stream, "tools": tools,
            "tool_choice": chat_tool_choice(req.tool_choice),
            "parallel_tool_calls": req.parallel_tool_calls if tools else None,
            "response_format": response_format(req), "user": req.user,
            "metadata": req.metadata, "service_tier": req.service_tier,
            "prompt_cache_key": req.prompt_cache_key,
            "prompt_cache_retention": req.prompt_cache_retention,
            "safety_identifier": req.safety_identifier}
    try:
        chat = validate(ChatCompletionRequest, {k: v for k, v in body.items() if v is not None})
    except APIError as exc:
        raise as_chat(exc, turns) from exc
    assert isinstance(chat, ChatCompletionRequest)
    return chat, turns
