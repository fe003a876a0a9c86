"""Response bodies in the OpenAI shapes: chat and text completions, stream chunks, models."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from api.logprobs import CompletionLogprobs, chat_logprobs
from inference.protocol.events import Event, FinalEvent, PositionLogprobs, TokenEvent, Usage


@dataclass(frozen=True)
class ResponseShape:
    """What every body of one response shares: ``kind`` is ``chat`` or ``text``.

    ``logprobs``: the choices carry log-probabilities. ``echo``: a text completion's prompt,
    sent back before the answer (None: not asked).
    """

    kind: str
    id: str
    model: str
    created: int
    include_usage: bool = False
    logprobs: bool = False
    echo: str | None = None

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


def full_response(shape: ResponseShape, text: str, final: FinalEvent,
                  logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """A non-streaming response for the answer ``text`` and the worker's final event."""
    if shape.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "finish_reason": final.finish_reason.value, "logprobs": logprobs}
    else:
        choice = {"index": 0, "text": text, "finish_reason": final.finish_reason.value,
                  "logprobs": logprobs}
    return {"id": shape.id, "object": shape.object, "created": shape.created,
            "model": shape.model, "choices": [choice], "usage": usage_body(final.usage)}


def _chunk(shape: ResponseShape, choice: dict[str, Any]) -> dict[str, Any]:
    chunk: dict[str, Any] = {"id": shape.id, "object": shape.chunk_object,
                             "created": shape.created, "model": shape.model, "choices": [choice]}
    if shape.include_usage:
        chunk["usage"] = None
    return chunk


def opening_chunk(shape: ResponseShape) -> dict[str, Any] | None:
    """The chat stream's first chunk (the assistant role); None for text completions."""
    if shape.kind != "chat":
        return None
    return _chunk(shape, {"index": 0, "delta": {"role": "assistant", "content": ""},
                          "finish_reason": None, "logprobs": None})


def text_chunk(shape: ResponseShape, text: str,
               logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """A chunk adding ``text`` (and the ``logprobs`` of its tokens) to the answer."""
    if shape.kind == "chat":
        return _chunk(shape, {"index": 0, "delta": {"content": text}, "finish_reason": None,
                              "logprobs": logprobs})
    return _chunk(shape, {"index": 0, "text": text, "finish_reason": None, "logprobs": logprobs})


@dataclass
class Answer:
    """One choice's text and log-probabilities, built from the worker's events as they come:
    the chunks of a stream (:meth:`chunks`), or the whole body (:meth:`add`, then :meth:`body`).

    An echoed prompt comes first, with the prompt's logprobs (the worker sends them on the
    request's first event); then each token's text with its logprobs. A token's logprobs come
    with its text (the worker holds both back while a stop string may be forming, and drops
    those past one), so the entries' texts join to the answer's.
    """

    shape: ResponseShape
    _echo_pending: bool = field(init=False)
    _texts: list[str] = field(init=False, default_factory=list)
    _entries: list[PositionLogprobs] = field(init=False, default_factory=list)
    _offsets: CompletionLogprobs = field(init=False, default_factory=CompletionLogprobs)

    def __post_init__(self) -> None:
        self._echo_pending = self.shape.echo is not None

    def _pieces(self, event: Event) -> list[tuple[str, list[PositionLogprobs]]]:
        """The ``(text, logprob entries)`` pieces ``event`` adds to the answer, in order."""
        pieces = []
        if self._echo_pending:
            self._echo_pending = False
            prompt = list(event.prompt_logprobs or ()) if self.shape.logprobs else []
            pieces.append((self.shape.echo or "", prompt))
        entries = []
        if isinstance(event, TokenEvent | FinalEvent) and self.shape.logprobs and event.logprobs:
            entries = list(event.logprobs)
        if event.text or entries:
            pieces.append((event.text, entries))
        return pieces

    def _logprobs(self, entries: list[PositionLogprobs]) -> dict[str, Any] | None:
        if not self.shape.logprobs:
            return None
        return chat_logprobs(entries) if self.shape.kind == "chat" else self._offsets.render(
            entries)

    def chunks(self, event: Event) -> list[dict[str, Any]]:
        """The stream chunks of ``event`` (a final event's: before its finish chunk)."""
        return [text_chunk(self.shape, text, self._logprobs(entries))
                for text, entries in self._pieces(event)]

    def add(self, event: Event) -> None:
        """Take ``event`` into the whole body."""
        for text, entries in self._pieces(event):
            self._texts.append(text)
            self._entries.extend(entries)

    def body(self, final: FinalEvent) -> dict[str, Any]:
        """The non-streaming response, once every event (``final`` the last) was added."""
        return full_response(self.shape, "".join(self._texts), final,
                             self._logprobs(self._entries))


def finish_chunk(shape: ResponseShape, finish_reason: str) -> dict[str, Any]:
    """The single chunk carrying the choice's ``finish_reason``."""
    if shape.kind == "chat":
        return _chunk(shape, {"index": 0, "delta": {}, "finish_reason": finish_reason,
                              "logprobs": None})
    return _chunk(shape, {"index": 0, "text": "", "finish_reason": finish_reason,
                          "logprobs": None})


def usage_chunk(shape: ResponseShape, final: FinalEvent) -> dict[str, Any]:
    """The ``stream_options.include_usage`` chunk: empty ``choices`` and the usage."""
    return {"id": shape.id, "object": shape.chunk_object, "created": shape.created,
            "model": shape.model, "choices": [], "usage": usage_body(final.usage)}


def model_object(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "llm-platform"}
