"""Response bodies in the OpenAI shapes: chat and text completions, stream chunks, models.

A request of ``n`` choices gets one :class:`Answer` per choice (:class:`Choices`): the worker's
token events say their choice (``TokenEvent.index``) and its final event how each ended
(``FinalEvent.choices``), and every chunk and body entry carries its choice's ``index``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from api.logprobs import CompletionLogprobs, chat_logprobs
from api.tool_calls import Piece, ToolCallParser
from inference.protocol.events import (
    Event,
    FinalEvent,
    FinishReason,
    PositionLogprobs,
    TokenEvent,
    Usage,
)


@dataclass(frozen=True)
class ResponseShape:
    """What every body of one response shares: ``kind`` is ``chat`` or ``text``.

    ``logprobs``: the choices carry log-probabilities. ``echo``: a text completion's prompt,
    sent back before the answer (None: not asked). ``tools``: a chat's answer may call tools
    (its text is read for calls: :mod:`api.tool_calls`; ``calls_only``: no text may come
    before a call). ``n``: the choices.
    """

    kind: str
    id: str
    model: str
    created: int
    include_usage: bool = False
    logprobs: bool = False
    echo: str | None = None
    tools: bool = False
    calls_only: bool = False
    n: int = 1

    @property
    def object(self) -> str:
        return "chat.completion" if self.kind == "chat" else "text_completion"

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.kind == "chat" else "text_completion"


def usage_body(usage: Usage) -> dict[str, Any]:
    """The standard ``usage`` object; prefix-cache hits in ``prompt_tokens_details``."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens},
    }


def finish_reason(reason: FinishReason, called: bool) -> str:
    """A choice's ``finish_reason``: ``tool_calls`` for an answer that ended where the model
    stopped after calling tools, else the worker's."""
    if called and reason is FinishReason.STOP:
        return "tool_calls"
    return reason.value


def _chunk(shape: ResponseShape, choice: dict[str, Any]) -> dict[str, Any]:
    chunk: dict[str, Any] = {"id": shape.id, "object": shape.chunk_object,
                             "created": shape.created, "model": shape.model, "choices": [choice]}
    if shape.include_usage:
        chunk["usage"] = None
    return chunk


def opening_chunks(shape: ResponseShape) -> list[dict[str, Any]]:
    """The chat stream's first chunk of each choice (the assistant role); none for text
    completions."""
    if shape.kind != "chat":
        return []
    return [_chunk(shape, {"index": i, "delta": {"role": "assistant", "content": ""},
                           "finish_reason": None, "logprobs": None}) for i in range(shape.n)]


def tool_calls_chunk(shape: ResponseShape, calls: list[dict[str, Any]],
                     index: int = 0) -> dict[str, Any]:
    """A chunk adding to choice ``index``'s tool calls: each entry ``{"index", "id", "type",
    "function": {"name", "arguments"}}`` for a call's start, ``{"index", "function":
    {"arguments"}}`` for more of its arguments."""
    return _chunk(shape, {"index": index, "delta": {"tool_calls": calls},
                          "finish_reason": None, "logprobs": None})


def text_chunk(shape: ResponseShape, text: str, logprobs: dict[str, Any] | None = None,
               index: int = 0) -> dict[str, Any]:
    """A chunk adding ``text`` (and the ``logprobs`` of its tokens) to choice ``index``."""
    if shape.kind == "chat":
        return _chunk(shape, {"index": index, "delta": {"content": text},
                              "finish_reason": None, "logprobs": logprobs})
    return _chunk(shape, {"index": index, "text": text, "finish_reason": None,
                          "logprobs": logprobs})


def merged_text_chunks(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``chunks`` with each run of consecutive text chunks (:func:`text_chunk`) of one choice
    merged into one: its text the run's texts joined, its logprobs' lists the run's joined (a
    streamed delta may carry several tokens, as OpenAI's do). Other chunks (tool calls, a role,
    a finish) and their neighbours stay as they are. One chunk a write instead of one a token:
    a stream's events reach the web tier two ticks at a time (``EVENT_HOLD_MS``).

    With several choices (``n``) the chunks are first grouped by choice, each choice's in their
    order, the choices in the order they first appear (a client follows each choice by its
    ``index``; the order between choices means nothing), so that each choice's run is whole."""
    indexes = [c["choices"][0].get("index") if len(c.get("choices") or ()) == 1 else None
               for c in chunks]
    if None not in indexes and len(set(indexes)) > 1:
        order = {index: i for i, index in reversed(list(enumerate(indexes)))}
        chunks = [c for _, c in sorted(zip(indexes, chunks, strict=True),
                                       key=lambda pair: order[pair[0]])]
    out: list[dict[str, Any]] = []
    for chunk in chunks:
        if out and _text_choice(out[-1]) is not None and _text_choice(chunk) is not None:
            last, new = out[-1]["choices"][0], chunk["choices"][0]
            logprobs = _joined_logprobs(last["logprobs"], new["logprobs"])
            if last["index"] == new["index"] and logprobs is not False:
                merged = dict(last, logprobs=logprobs)
                if "delta" in last:
                    merged["delta"] = {"content": last["delta"]["content"]
                                       + new["delta"]["content"]}
                else:
                    merged["text"] = last["text"] + new["text"]
                out[-1] = dict(out[-1], choices=[merged])
                continue
        out.append(chunk)
    return out


def _text_choice(chunk: dict[str, Any]) -> dict[str, Any] | None:
    """The choice of a :func:`text_chunk`, or None for any other chunk."""
    choices = chunk.get("choices")
    if not choices or len(choices) != 1 or choices[0].get("finish_reason") is not None:
        return None
    choice = choices[0]
    delta = choice.get("delta")
    if delta is not None:
        return choice if set(delta) == {"content"} and isinstance(delta["content"], str) else None
    return choice if isinstance(choice.get("text"), str) else None


def _joined_logprobs(a: dict[str, Any] | None,
                     b: dict[str, Any] | None) -> dict[str, Any] | None | bool:
    """Two chunks' logprobs joined list by list, their other fields equal (``refusal``: None);
    None if both are; False when they cannot be (one has none, or their fields differ)."""
    if a is None or b is None:
        return None if a is None and b is None else False
    if set(a) != set(b):
        return False
    joined = {}
    for key, value in a.items():
        if isinstance(value, list) and isinstance(b[key], list):
            joined[key] = value + b[key]
        elif value is None and b[key] is None:
            joined[key] = None
        else:
            return False
    return joined


def finish_chunk(shape: ResponseShape, reason: str, index: int = 0) -> dict[str, Any]:
    """The single chunk carrying choice ``index``'s ``finish_reason``."""
    if shape.kind == "chat":
        return _chunk(shape, {"index": index, "delta": {}, "finish_reason": reason,
                              "logprobs": None})
    return _chunk(shape, {"index": index, "text": "", "finish_reason": reason,
                          "logprobs": None})


def usage_chunk(shape: ResponseShape, final: FinalEvent) -> dict[str, Any]:
    """The ``stream_options.include_usage`` chunk: empty ``choices`` and the usage."""
    return {"id": shape.id, "object": shape.chunk_object, "created": shape.created,
            "model": shape.model, "choices": [], "usage": usage_body(final.usage)}


def model_object(name: str, created: int = 0, *, owned_by: str | None = None,
                 parent: str | None = None) -> dict[str, Any]:
    """A model as ``GET /v1/models`` lists it (``created``: a unix time, 0 when unknown;
    ``owned_by``: None, the platform's); a LoRA adapter's names its base model as ``parent``."""
    body = {"id": name, "object": "model", "created": created,
            "owned_by": owned_by or "llm-platform"}
    return body if parent is None else {**body, "parent": parent}


@dataclass(frozen=True)
class Part:
    """What one event adds to one choice: its ``text``, the ``logprobs`` of its tokens, and
    whether it is the choice's end (``reason``: how it ended; None: more follows)."""

    text: str
    logprobs: Sequence[PositionLogprobs] | None = None
    reason: FinishReason | None = None


@dataclass
class Answer:
    """One choice's text (and tool calls) and log-probabilities, built from its parts as they
    come: the chunks of a stream (:meth:`chunks`), or the whole body entry (:meth:`add`, then
    :meth:`entry`).

    An echoed prompt comes first, with the prompt's logprobs (the worker sends them on the
    request's first event); then each token's text with its logprobs. A token's logprobs come
    with its text (the worker holds both back while a stop string may be forming, and drops
    those past one), so the entries' texts join to the answer's.
    """

    shape: ResponseShape
    index: int = 0
    _echo_pending: bool = field(init=False)
    _texts: list[str] = field(init=False, default_factory=list)
    _entries: list[PositionLogprobs] = field(init=False, default_factory=list)
    _offsets: CompletionLogprobs = field(init=False, default_factory=CompletionLogprobs)
    _calls: ToolCallParser | None = field(init=False, default=None)
    _tool_calls: list[dict[str, Any]] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self._echo_pending = self.shape.echo is not None
        if self.shape.tools:
            self._calls = ToolCallParser(calls_only=self.shape.calls_only)

    @property
    def called(self) -> bool:
        """Whether the answer so far called a tool."""
        return self._calls is not None and self._calls.calls > 0

    def finish_reason(self, reason: FinishReason) -> str:
        """The choice's ``finish_reason`` (:func:`finish_reason`)."""
        return finish_reason(reason, self.called)

    def _pieces(self, part: Part, prompt: Sequence[PositionLogprobs] | None,
                ) -> list[tuple[str, list[PositionLogprobs]]]:
        """The ``(text, logprob entries)`` pieces ``part`` adds to the answer, in order."""
        pieces = []
        if self._echo_pending:
            self._echo_pending = False
            pieces.append((self.shape.echo or "",
                           list(prompt or ()) if self.shape.logprobs else []))
        entries = list(part.logprobs or ()) if self.shape.logprobs else []
        if part.text or entries:
            pieces.append((part.text, entries))
        return pieces

    def _tool_pieces(self, part: Part) -> list[Piece]:
        assert self._calls is not None
        pieces = self._calls.feed(part.text)
        return pieces + self._calls.finish() if part.reason is not None else pieces

    def _logprobs(self, entries: list[PositionLogprobs]) -> dict[str, Any] | None:
        if not self.shape.logprobs:
            return None
        return chat_logprobs(entries) if self.shape.kind == "chat" else self._offsets.render(
            entries)

    def chunks(self, part: Part,
               prompt: Sequence[PositionLogprobs] | None = None) -> list[dict[str, Any]]:
        """The stream chunks of ``part`` (an end's: before its finish chunk); ``prompt``: the
        prompt's logprobs, for an echo."""
        if self._calls is not None:
            return [text_chunk(self.shape, p.text, index=self.index) if p.kind == "content"
                    else tool_calls_chunk(self.shape, [_call_delta(p)], self.index)
                    for p in self._tool_pieces(part)]
        return [text_chunk(self.shape, text, self._logprobs(entries), self.index)
                for text, entries in self._pieces(part, prompt)]

    def add(self, part: Part, prompt: Sequence[PositionLogprobs] | None = None) -> None:
        """Take ``part`` into the whole body."""
        if self._calls is not None:
            for piece in self._tool_pieces(part):
                if piece.kind == "content":
                    self._texts.append(piece.text)
                elif piece.kind == "call":
                    self._tool_calls.append({"id": piece.call_id, "type": "function",
                                             "function": {"name": piece.name, "arguments": ""}})
                else:
                    self._tool_calls[piece.index]["function"]["arguments"] += piece.text
            return
        for text, entries in self._pieces(part, prompt):
            self._texts.append(text)
            self._entries.extend(entries)

    def entry(self, reason: FinishReason) -> dict[str, Any]:
        """The choice's entry of the non-streaming body, once all its parts were added."""
        text, logprobs = "".join(self._texts), self._logprobs(self._entries)
        done = self.finish_reason(reason)
        if self.shape.kind != "chat":
            return {"index": self.index, "text": text, "finish_reason": done,
                    "logprobs": logprobs}
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self._tool_calls:
            message = {"role": "assistant", "content": text or None,
                       "tool_calls": self._tool_calls}
        return {"index": self.index, "message": message, "finish_reason": done,
                "logprobs": logprobs}


def _call_delta(piece: Piece) -> dict[str, Any]:
    """A stream's ``tool_calls`` entry for ``piece`` (a call's start, or its arguments)."""
    if piece.kind == "call":
        return {"index": piece.index, "id": piece.call_id, "type": "function",
                "function": {"name": piece.name, "arguments": ""}}
    return {"index": piece.index, "function": {"arguments": piece.text}}


def ends(final: FinalEvent, n: int) -> list[tuple[int, Part]]:
    """How each of ``n`` choices ended, from the request's final event: its ``choices``, else
    (one choice, or a request that ended as a whole before its choices ran) the final event's own
    text and reason for choice 0 and its reason for the others."""
    if final.choices:
        return [(c.index, Part(c.text, c.logprobs, c.finish_reason)) for c in final.choices]
    return [(0, Part(final.text, final.logprobs, final.finish_reason))] + [
        (i, Part("", None, final.finish_reason)) for i in range(1, n)]


def failed(final: FinalEvent) -> bool:
    """Whether the request failed as a whole (every choice with an error), so that its client
    gets the error instead of an answer."""
    if final.error is None:
        return False
    return not final.choices or all(c.error is not None for c in final.choices)


class Choices:
    """The ``n`` choices of one response, from the worker's events (see the module docstring).

    Feed each event to :meth:`chunks` (a stream) or :meth:`add` (a whole body); after the final
    event, :meth:`finish_chunks` or :meth:`body`.
    """

    def __init__(self, shape: ResponseShape):
        self.shape = shape
        self.answers = [Answer(shape, i) for i in range(shape.n)]
        self._prompt: Sequence[PositionLogprobs] | None = None

    def _parts(self, event: Event) -> list[tuple[int, Part]]:
        if event.prompt_logprobs and self._prompt is None:
            self._prompt = event.prompt_logprobs
        if isinstance(event, TokenEvent):
            return [(event.index, Part(event.text, event.logprobs))]
        return ends(event, self.shape.n)

    def chunks(self, event: Event) -> list[dict[str, Any]]:
        """The stream chunks of ``event`` (a final event's: before the finish chunks)."""
        return [chunk for i, part in self._parts(event)
                for chunk in self.answers[i].chunks(part, self._prompt)]

    def add(self, event: Event) -> None:
        """Take ``event`` into the whole body."""
        for i, part in self._parts(event):
            self.answers[i].add(part, self._prompt)

    def finish_chunks(self, final: FinalEvent) -> list[dict[str, Any]]:
        """One chunk per choice, in index order, with its ``finish_reason``."""
        return [finish_chunk(self.shape, self.answers[i].finish_reason(part.reason or
                                                                         final.finish_reason), i)
                for i, part in ends(final, self.shape.n)]

    def body(self, final: FinalEvent) -> dict[str, Any]:
        """The non-streaming response, once every event (``final`` the last) was added."""
        shape = self.shape
        return {"id": shape.id, "object": shape.object, "created": shape.created,
                "model": shape.model,
                "choices": [self.answers[i].entry(part.reason or final.finish_reason)
                            for i, part in ends(final, shape.n)],
                "usage": usage_body(final.usage)}
