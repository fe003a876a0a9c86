"""Tool calling in a chat request: ``tools``, ``tool_choice``, ``parallel_tool_calls``, their
checks and limits, and the grammar that makes the model's calls valid (``docs/platform.md``,
"Tool calling").

- ``tools``: function tools, ``{"type": "function", "function": {"name", "description",
  "parameters", "strict"}}``; a name is OpenAI's (1 to 64 of a-z, A-Z, 0-9, ``_``, ``-``) and
  unique; ``parameters`` is a JSON Schema checked by the grammar library like a
  ``response_format`` schema (left out: the function takes no arguments, ``{}``). At most
  ``MAX_TOOLS`` tools, whose JSON is at most ``MAX_TOOLS_BYTES``.
- ``tool_choice``: ``none`` (the tools are not offered: not in the prompt, no call is read from
  the answer), ``auto`` (the default with tools: the model answers in text or calls tools),
  ``required`` (at least one call) or ``{"type": "function", "function": {"name"}}`` (exactly
  that call). Without tools only ``none`` asks nothing.
- ``parallel_tool_calls`` (default true): more than one call per answer; false: at most one.

Every choice but ``none`` constrains the answer with one Lark grammar (llguidance's dialect,
:func:`tool_grammar`): a call is ``<tool_call>\\n{"name":...,"arguments":...}\\n</tool_call>``
(the Hermes format of :mod:`inference.tokenization.chat_tools`) whose name is one of the
tools' and whose arguments match that tool's ``parameters``, written compactly. ``auto`` lets
the text run free until the model writes ``<tool_call>``, then holds the call to the grammar
(with a ``response_format`` JSON schema, a text answer matches it instead); ``required`` and a
named choice allow calls only.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field

from api.fields import BodyObject, Text
from api.messages import FunctionName
from gateway.errors import APIError
from inference.protocol.structured import JSON_OPTIONS, StructuredOutput, canonical_json
from inference.tokenization.chat_tools import CALL_CLOSE, CALL_OPEN

# The arguments of a function that declares no parameters: exactly ``{}``.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {},
                                 "additionalProperties": False}


class FunctionDefinition(BodyObject):
    name: FunctionName
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    # Checked, not used: every schema is applied exactly (as api.structured_fields says).
    strict: bool | None = None


class FunctionTool(BodyObject):
    type: Literal["function"]
    function: FunctionDefinition

    def for_prompt(self) -> dict[str, Any]:
        """The tool as the prompt shows it (OpenAI's shape, fields left out when not given)."""
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}

    @property
    def arguments_schema(self) -> dict[str, Any]:
        """The JSON Schema of its arguments (:data:`NO_PARAMETERS` when it declares none; an
        object schema without ``type``, ``{"properties": ...}``, gets ``"type": "object"``)."""
        parameters = self.function.parameters
        if not parameters:
            return NO_PARAMETERS
        return parameters if "type" in parameters else {"type": "object", **parameters}


class ChosenFunction(BodyObject):
    name: FunctionName


class NamedToolChoice(BodyObject):
    type: Literal["function"]
    function: ChosenFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
Tools = Annotated[list[FunctionTool], Field(min_length=0)]


def _invalid(param: str, message: str) -> APIError:
    return APIError(400, f"Invalid value for '{param}': {message}", param=param,
                    code="invalid_value")


def check_tools(tools: list[FunctionTool] | None, choice: ToolChoice | None, *,
                max_tools: int, max_bytes: int) -> None:
    """The limits and rules of ``tools`` and ``tool_choice`` (see the module docstring); the
    ``parameters`` schemas are checked apart (:func:`parameter_specs`).

    Raises:
        APIError: 400 ``invalid_value`` naming ``tools`` (over ``max_tools`` tools, or over
            ``max_bytes`` of JSON), ``tools[i].function.name`` (a name given twice), or
            ``tool_choice`` (a choice other than ``none`` without tools, a named function that
            is not a tool).
    """
    if not tools:
        if choice is not None and choice != "none":
            raise _invalid("tool_choice", "'tool_choice' is only allowed when 'tools' are "
                                          "specified.")
        return
    if len(tools) > max_tools:
        raise _invalid("tools", f"expected at most {max_tools} tools (MAX_TOOLS), but got "
                                f"{len(tools)}.")
    size = len(json.dumps([t.for_prompt() for t in tools], ensure_ascii=False).encode())
    if size > max_bytes:
        raise _invalid("tools", f"the tool definitions are {size} bytes of JSON, over the "
                                f"limit of {max_bytes} bytes (MAX_TOOLS_BYTES).")
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        if tool.function.name in seen:
            raise _invalid(f"tools[{i}].function.name", f"the name "
                           f"{tool.function.name!r} is given to two tools.")
        seen.add(tool.function.name)
    if isinstance(choice, NamedToolChoice) and choice.function.name not in seen:
        raise _invalid("tool_choice.function.name", f"no tool is named "
                       f"{choice.function.name!r}.")


def check_request(req: Any, *, max_tools: int, max_bytes: int) -> None:
    """:func:`check_tools` of a chat request, and the structured outputs its tools cannot go
    with.

    Raises:
        APIError: as :func:`check_tools`; 400 ``invalid_value`` naming ``structured_outputs``
            beside tools offered, or ``response_format`` (other than text) beside a
            ``required`` or named ``tool_choice`` (the answer is calls only);
            ``unsupported_parameter`` naming ``logprobs`` beside tools offered.
    """
    check_tools(req.tools, req.tool_choice, max_tools=max_tools, max_bytes=max_bytes)
    if not offered(req.tools, req.tool_choice):
        return
    if req.structured_outputs is not None:
        raise _invalid("structured_outputs", "'structured_outputs' cannot be combined with "
                       "'tools' (give 'tool_choice': 'none', or ask for JSON with "
                       "'response_format').")
    if req.logprobs:
        raise APIError(400, "'logprobs' is not supported together with 'tools': an answer's "
                            "calls are not text its log-probabilities could follow.",
                       param="logprobs", code="unsupported_parameter")
    fmt = req.response_format
    if fmt is not None and fmt.type != "text" and req.tool_choice not in (None, "auto"):
        raise _invalid("response_format", "with 'tool_choice' 'required' or a named function "
                       "the answer is tool calls only: no text answer is left to format.")


def offered(tools: list[FunctionTool] | None, choice: ToolChoice | None) -> bool:
    """Whether the answer may call tools (tools given, and a choice other than ``none``)."""
    return bool(tools) and choice != "none"


def parameter_specs(tools: list[FunctionTool]) -> list[StructuredOutput]:
    """Each tool's ``parameters`` as a JSON-schema spec naming its field, for
    :func:`api.structured_fields.check`.

    Raises:
        APIError: 400 ``invalid_json_schema`` naming ``tools[i].function.parameters`` for a
            schema of anything but an object (a call's arguments are keyword arguments, as
            OpenAI requires), or one holding a number JSON cannot write (``1e400``).
    """
    specs = []
    for i, tool in enumerate(tools):
        if not tool.function.parameters:
            continue
        param = f"tools[{i}].function.parameters"
        schema = tool.arguments_schema
        if schema.get("type") != "object":
            raise APIError(400, f"'{param}' must be the JSON Schema of an object (\"type\": "
                                f"\"object\"): a call's arguments are named.", param=param,
                           code="invalid_json_schema")
        try:
            spec = canonical_json(schema)
        except ValueError as exc:
            raise APIError(400, f"'{param}' holds a number out of range (it reads as "
                                f"infinity): {exc}.", param=param,
                           code="invalid_json_schema") from exc
        specs.append(StructuredOutput(kind="json_schema", spec=spec, param=param))
    return specs


def _rebased(schema: Any, base: str) -> Any:
    """``schema`` with each local ``$ref`` (``#/...``) pointing below ``base`` instead of its own
    root: the schema is placed at ``base`` inside the call's schema."""
    if isinstance(schema, dict):
        return {key: (base + value[1:] if key == "$ref" and isinstance(value, str)
                      and value.startswith("#") else _rebased(value, base))
                for key, value in schema.items()}
    if isinstance(schema, list):
        return [_rebased(item, base) for item in schema]
    return schema


def _call_rule(tool: FunctionTool) -> str:
    schema = {"type": "object",
              "properties": {"name": {"const": tool.function.name},
                             "arguments": _rebased(tool.arguments_schema,
                                                   "#/properties/arguments")},
              "required": ["name", "arguments"], "additionalProperties": False,
              "x-guidance": JSON_OPTIONS}
    return f"%json {canonical_json(schema)}"


def tool_grammar(tools: list[FunctionTool], choice: ToolChoice | None, parallel: bool,
                 text_schema: str | None = None) -> str:
    """The Lark grammar (llguidance's dialect) an answer offered ``tools`` must match.

    Args:
        tools: the tools offered (at least one).
        choice: ``auto`` (or None), ``required``, or a named function.
        parallel: more than one call may follow the first.
        text_schema: with ``auto``, the JSON schema (compact text) a text answer must match
            instead of free text (a ``response_format``: the answer is then that JSON, or calls
            with no text before them), or None.
    """
    if isinstance(choice, NamedToolChoice):
        called = [t for t in tools if t.function.name == choice.function.name]
    else:
        called = tools
    open_, close = json.dumps(CALL_OPEN + "\n"), json.dumps("\n" + CALL_CLOSE)
    rules = [f"call_{i}: {_call_rule(t)}" for i, t in enumerate(called)]
    rules.insert(0, "body: " + " | ".join(f"call_{i}" for i in range(len(called))))
    tail = ""
    if parallel and not isinstance(choice, NamedToolChoice):
        tail = " more"
        rules.insert(0, f'more: ("\\n" {open_} body {close})*')
    if choice in (None, "auto") and text_schema:
        # A text answer is the formatted JSON, else the answer is calls only.
        schema = {**json.loads(text_schema), "x-guidance": JSON_OPTIONS}
        start = [f"start: text | {open_} body {close}{tail}",
                 f"text: %json {canonical_json(schema)}"]
    elif choice in (None, "auto"):
        start = [f"start: text | head \"\\n\" body {close}{tail}",
                 "text: /(.|\\n)*/",
                 f"head[suffix={json.dumps(CALL_OPEN)}]: /(.|\\n)*/"]
    else:
        start = [f"start: {open_} body {close}{tail}"]
    return "\n".join([*start, *rules]) + "\n"
