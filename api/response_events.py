"""The Responses API's shapes: the response object, its output items, and the typed stream events.

The worker's events are read as a chat answer is (:class:`api.responses.Answer`: its text, and
with tools the calls in it, :mod:`api.tool_calls`), and what each adds becomes output items:
an assistant ``message`` with one ``output_text`` part, and a ``function_call`` per call.
:class:`ResponseOutput` builds them and, for a stream, the events that tell them, in OpenAI's
order: ``response.output_item.added``, ``response.content_part.added``,
``response.output_text.delta``... ``response.output_text.done``, ``response.content_part.done``,
``response.output_item.done`` for a message; ``response.output_item.added``,
``response.function_call_arguments.delta``... ``.done``, ``response.output_item.done`` for a
call. The stream's ``sequence_number`` and its first and last events (``response.created``,
``response.in_progress``; one of ``response.completed``, ``response.incomplete``,
``response.failed``) are the view's (:mod:`api.response_views`).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from api import responses
from gateway.errors import APIError
from inference.protocol.events import Event, FinalEvent, FinishReason, TokenEvent, Usage

# The status and the end event of a response that ended each way.
END_EVENTS = {"completed": "response.completed", "incomplete": "response.incomplete",
              "failed": "response.failed", "cancelled": "response.failed"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass(frozen=True)
class OutputShape:
    """How an answer's text is read: for tool calls (``tools``), and whether no text may come
    before a call (``calls_only``), as :class:`api.responses.ResponseShape` says."""

    tools: bool = False
    calls_only: bool = False

    def as_dict(self) -> dict[str, bool]:
        return {"tools": self.tools, "calls_only": self.calls_only}


def usage_object(usage: Usage) -> dict[str, Any]:
    """The Responses API's ``usage``: input tokens (prefix-cache hits in ``cached_tokens``) and
    output tokens, as the client got them."""
    return {"input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_prompt_tokens,
                                     "cache_write_tokens": 0},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


def error_object(exc: APIError) -> dict[str, Any]:
    """A failed response's ``error``: OpenAI's codes (``rate_limit_exceeded``,
    ``invalid_prompt``, else ``server_error``), this server's code in ``type``."""
    code = ("rate_limit_exceeded" if exc.status == 429 else
            "invalid_prompt" if 400 <= exc.status < 500 else "server_error")
    return {"code": code, "message": exc.message, "param": exc.param, "type": exc.code}


def outcome(final: FinalEvent, error: APIError | None
            ) -> tuple[str, dict[str, Any] | None, dict[str, Any] | None]:
    """How a response ended: (status, ``incomplete_details``, ``error``). ``error``: the client's
    error for a request that failed as a whole (:func:`api.responses.failed`)."""
    if error is not None:
        return "failed", None, error_object(error)
    if final.finish_reason is FinishReason.LENGTH:
        return "incomplete", {"reason": "max_output_tokens"}, None
    if final.finish_reason is FinishReason.ABORT:
        return "cancelled", None, None
    return "completed", None, None


def ended(body: dict[str, Any], status: str, output: list[dict[str, Any]], *,
          usage: Usage | None = None, incomplete: dict[str, Any] | None = None,
          error: dict[str, Any] | None = None) -> dict[str, Any]:
    """The response object ``body`` (as created) once it ended ``status``."""
    return {**body, "status": status, "output": output, "error": error,
            "incomplete_details": incomplete,
            "usage": usage_object(usage) if usage is not None else None,
            "completed_at": int(time.time()) if status == "completed" else None}


class ResponseOutput:
    """A response's output items, from the worker's events (see the module docstring).

    :meth:`feed` each event (it returns the stream events it adds), then :meth:`finish` with the
    response's status (it returns the events that close the open item); :attr:`items` is the
    output. Only the request's one choice is read (the Responses API has no ``n``).
    """

    def __init__(self, shape: OutputShape):
        self._answer = responses.Answer(responses.ResponseShape(
            kind="chat", id="", model="", created=0, tools=shape.tools,
            calls_only=shape.calls_only))
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._text: list[str] = []
        self._ended = False  # the answer's end was read (its parser flushed)

    @property
    def text(self) -> str:
        """The output's text (its messages' ``output_text``), as ``output_text`` joins it."""
        return "".join(part["text"] for item in self.items if item["type"] == "message"
                       for part in item["content"])

    def feed(self, event: Event) -> list[dict[str, Any]]:
        """The stream events ``event`` adds (a final event: its last text, before
        :meth:`finish`)."""
        if isinstance(event, TokenEvent):
            if event.index != 0:
                return []
            part = responses.Part(event.text)
        else:
            part = responses.ends(event, 1)[0][1]
            self._ended = True
        return self._feed(part)

    def _feed(self, part: responses.Part) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for chunk in self._answer.chunks(part):
            delta = chunk["choices"][0]["delta"]
            if delta.get("content"):
                out += self._add_text(delta["content"])
            for call in delta.get("tool_calls") or ():
                out += self._add_call(call)
        return out

    def _index(self) -> int:
        return len(self.items) - 1

    def _add_text(self, text: str) -> list[dict[str, Any]]:
        out = []
        if self._open is None or self._open["type"] != "message":
            out += self._close("completed")
            item = {"id": new_id("msg"), "type": "message", "status": "in_progress",
                    "role": "assistant", "content": []}
            self.items.append(item)
            self._open, self._text = item, []
            out.append({"type": "response.output_item.added", "output_index": self._index(),
                        "item": _copy(item)})
            out.append({"type": "response.content_part.added", "item_id": item["id"],
                        "output_index": self._index(), "content_index": 0,
                        "part": _text_part("")})
        self._text.append(text)
        out.append({"type": "response.output_text.delta", "item_id": self._open["id"],
                    "output_index": self._index(), "content_index": 0, "delta": text,
                    "logprobs": []})
        return out

    def _add_call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        out = []
        if "id" in call:  # a call's start
            out += self._close("completed")
            item = {"id": new_id("fc"), "type": "function_call", "status": "in_progress",
                    "call_id": call["id"], "name": call["function"]["name"], "arguments": ""}
            self.items.append(item)
            self._open = item
            out.append({"type": "response.output_item.added", "output_index": self._index(),
                        "item": _copy(item)})
        arguments = call["function"].get("arguments") or ""
        if arguments and self._open is not None and self._open["type"] == "function_call":
            self._open["arguments"] += arguments
            out.append({"type": "response.function_call_arguments.delta",
                        "item_id": self._open["id"], "output_index": self._index(),
                        "delta": arguments})
        return out

    def _close(self, status: str) -> list[dict[str, Any]]:
        item, self._open = self._open, None
        if item is None:
            return []
        index = self.items.index(item)
        item["status"] = status
        if item["type"] == "message":
            text = "".join(self._text)
            item["content"] = [_text_part(text)]
            out = [{"type": "response.output_text.done", "item_id": item["id"],
                    "output_index": index, "content_index": 0, "text": text, "logprobs": []},
                   {"type": "response.content_part.done", "item_id": item["id"],
                    "output_index": index, "content_index": 0, "part": _text_part(text)}]
        else:
            out = [{"type": "response.function_call_arguments.done", "item_id": item["id"],
                    "output_index": index, "arguments": item["arguments"],
                    "name": item["name"]}]
        return [*out, {"type": "response.output_item.done", "output_index": index,
                       "item": _copy(item)}]

    def finish(self, status: str) -> list[dict[str, Any]]:
        """The events closing the open item, which ends ``completed``, or ``incomplete`` when
        the response did not complete. A response that completed with no output gets an empty
        message, so that its ``output_text`` is there (empty)."""
        out = []
        if not self._ended:  # cut short: what its parser holds back is the answer's too
            self._ended = True
            out += self._feed(responses.Part("", reason=FinishReason.ABORT))
        if not self.items and status in ("completed", "incomplete"):
            out += self._add_text("")
        item_status = "completed" if status == "completed" else "incomplete"
        return out + self._close(item_status)


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    return {**item, "content": list(item["content"])} if "content" in item else dict(item)


def output_from_events(events: list[Event], shape: OutputShape, tokens: int | None,
                       status: str) -> list[dict[str, Any]]:
    """The output items of a response's first ``tokens`` token events (None: all of them, and
    its final event's last text), for a response stored after its relay died (what its client
    was billed for)."""
    output = ResponseOutput(shape)
    seen = 0
    for event in events:
        if isinstance(event, TokenEvent):
            if tokens is not None and seen >= tokens:
                break
            seen += 1
            output.feed(event)
        elif tokens is None:
            output.feed(event)
    output.finish(status)
    return output.items


_DELTAS = ("response.output_text.delta", "response.function_call_arguments.delta")


def merged_deltas(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``events`` with each run of consecutive delta events of one item (``output_text`` or a
    call's arguments) merged into one: its ``delta`` the run's joined, its ``logprobs`` too. A
    stream's events reach the web tier two ticks at a time (``EVENT_HOLD_MS``): one event a
    write, not one a token."""
    out: list[dict[str, Any]] = []
    for event in events:
        last = out[-1] if out else None
        if (last is not None and event["type"] in _DELTAS and last["type"] == event["type"]
                and last["item_id"] == event["item_id"]
                and last.get("content_index") == event.get("content_index")):
            merged = dict(last, delta=last["delta"] + event["delta"])
            if "logprobs" in last:
                merged["logprobs"] = [*last["logprobs"], *event.get("logprobs", [])]
            out[-1] = merged
            continue
        out.append(event)
    return out

