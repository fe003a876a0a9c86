"""Response bodies in the OpenAI shapes: chat and text completions, stream chunks, models."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from inference.protocol import FinalEvent, Usage


@dataclass(frozen=True)
class ResponseShape:
    """What every body of one response shares: ``kind`` is ``chat`` or ``text``."""

    kind: str
    id: str
    model: str
    created: int
    include_usage: bool = False

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


def full_response(shape: ResponseShape, text: str, final: FinalEvent) -> dict[str, Any]:
    """A non-streaming response for the answer ``text`` and the worker's final event."""
    if shape.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "finish_reason": final.finish_reason.value, "logprobs": None}
    else:
        choice = {"index": 0, "text": text, "finish_reason": final.finish_reason.value,
                  "logprobs": None}
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


def text_chunk(shape: ResponseShape, text: str) -> dict[str, Any]:
    """A chunk adding ``text`` to the answer."""
    if shape.kind == "chat":
        return _chunk(shape, {"index": 0, "delta": {"content": text}, "finish_reason": None,
                              "logprobs": None})
    return _chunk(shape, {"index": 0, "text": text, "finish_reason": None, "logprobs": None})


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
