"""Tool definitions and tool-call turns in a chat prompt, torch-free (both tiers render with it).

A chat that offers tools, or whose history holds tool calls and tool results, is rendered by the
model's own chat template when that template renders tools (it reads the variable ``tools``:
Qwen2.5, Hermes, Llama 3.1 and most recent instruct models); the messages then reach the
template in the shape Hugging Face templates take (a tool call's ``function.arguments`` as an
object, a ``tool`` message with its ``tool_call_id``).

Any other template gets the fallback, :func:`fallback_messages`: plain ``system``/``user``/
``assistant`` turns in the Hermes format that Qwen2.5's template writes (its words, verbatim):

- the tool definitions go at the end of the system message (one is added first when the chat has
  none), one JSON object per line between ``<tools>`` and ``</tools>``, with the instruction to
  answer a call as ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``;
- an assistant turn's tool calls follow its text, each in that form;
- the results of consecutive ``tool`` messages become one ``user`` turn, each between
  ``<tool_response>`` and ``</tool_response>``.

Answers are read back in the same format (``api.tool_calls``), whichever template wrote the
prompt: the calls of the models the platform serves with tools are Hermes ``<tool_call>`` blocks.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
RESPONSE_OPEN = "<tool_response>"
RESPONSE_CLOSE = "</tool_response>"

# Qwen2.5's tool section of the system message, as its chat template writes it.
TOOLS_HEADER = ("\n\n# Tools\n\nYou may call one or more functions to assist with the user "
                "query.\n\nYou are provided with function signatures within <tools></tools> XML "
                "tags:\n<tools>")
TOOLS_FOOTER = ("\n</tools>\n\nFor each function call, return a json object with function name "
                "and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
                "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>")

Messages = Sequence[Mapping[str, Any]]
Tools = Sequence[Mapping[str, Any]]


def uses_tools(messages: Messages, tools: Tools | None) -> bool:
    """Whether rendering ``messages`` needs this module: tools are offered, or a turn is a tool
    call or a tool result."""
    return bool(tools) or any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)


def call_text(name: str, arguments: Any) -> str:
    """One tool call as the Hermes format writes it: ``<tool_call>\\n{json}\\n</tool_call>``.

    ``arguments``: the call's arguments, a JSON object (or, when a client sent back text that is
    not JSON, that text).
    """
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{CALL_OPEN}\n{body}\n{CALL_CLOSE}"


def parsed_arguments(arguments: Any) -> Any:
    """A tool call's ``function.arguments`` (JSON text, as the API carries it) as the object it
    encodes; text that is not JSON stays text."""
    if not isinstance(arguments, str):
        return arguments
    try:
        return json.loads(arguments)
    except (ValueError, RecursionError):  # not JSON, or nested deeper than the parser goes
        return arguments


def template_messages(messages: Messages) -> list[dict[str, Any]]:
    """``messages`` in the shape a chat template that renders tools takes (arguments as
    objects)."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [
                {**call, "function": {**call["function"], "arguments": parsed_arguments(
                    call["function"].get("arguments"))}} for call in m["tool_calls"]]
        out.append(m)
    return out


def tools_section(tools: Tools) -> str:
    """The tool definitions' part of the fallback's system message."""
    lines = "".join("\n" + json.dumps(dict(t), ensure_ascii=False) for t in tools)
    return f"{TOOLS_HEADER}{lines}{TOOLS_FOOTER}"


def fallback_messages(messages: Messages, tools: Tools | None) -> list[dict[str, str]]:
    """``messages`` (with ``tools`` offered, or None) as plain ``role``/``content`` turns in the
    Hermes format (see the module docstring), for a chat template that does not render tools."""
    out: list[dict[str, str]] = []
    if tools:
        if messages and messages[0].get("role") == "system":
            first, rest = messages[0], messages[1:]
            out.append({"role": "system",
                        "content": str(first.get("content") or "") + tools_section(tools)})
        else:
            rest = messages
            out.append({"role": "system", "content": tools_section(tools).lstrip("\n")})
    else:
        rest = messages
    for m in rest:
        role, content = m.get("role"), str(m.get("content") or "")
        if role == "tool":
            block = f"{RESPONSE_OPEN}\n{content}\n{RESPONSE_CLOSE}"
            if out and out[-1].get("tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "tool_results": "1"})
            continue
        if role == "assistant" and m.get("tool_calls"):
            calls = [call_text(c["function"]["name"],
                               parsed_arguments(c["function"].get("arguments")))
                     for c in m["tool_calls"]]
            content = "\n".join(([content] if content else []) + calls)
        out.append({"role": str(role), "content": content})
    return [{"role": m["role"], "content": m["content"]} for m in out]
