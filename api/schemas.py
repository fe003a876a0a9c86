"""Request bodies of the OpenAI-compatible endpoints, validated with pydantic.

Unknown fields are ignored. Known fields that would change the answer and that this server does
not offer (``tools``, ``response_format`` other than text, ``logprobs``, ...) are refused with a
400 naming the field.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from api.errors import APIError

MAX_STOP_SEQUENCES = 4


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class ChatMessage(BaseModel):
    """One chat message; content is a string or a list of text parts."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict[str, Any]]

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, value: str | list[dict[str, Any]]) -> str:
        if isinstance(value, str):
            return value
        texts = []
        for part in value:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts are supported")
            texts.append(part["text"])
        return "".join(texts)

    def as_dict(self) -> dict[str, str]:
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": self.content}


class GenerationRequest(BaseModel):
    """Fields shared by chat and text completions (extensions: top_k, min_tokens, ignore_eos)."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1)
    user: str | None = Field(None, max_length=256)
    stream: bool = False
    stream_options: StreamOptions | None = None
    top_k: int = Field(0, ge=-1)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> list[str]:
        if value is None:
            return []
        stops = [value] if isinstance(value, str) else value
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are supported")
        return [s for s in stops if s]

    @field_validator("n")
    @classmethod
    def _single_choice(cls, value: int) -> int:
        if value > 1:
            raise ValueError("n > 1 is not supported by this server; send n separate requests")
        return value

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling(self, max_tokens: int | None) -> dict[str, Any]:
        """Fields of ``inference.request.SamplingParams``; a None max_tokens: the worker decides."""
        return {
            "max_tokens": max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": max(self.top_k, 0),
            "seed": self.seed,
            "stop": list(self.stop or []),
            "min_tokens": self.min_tokens,
            "ignore_eos": self.ignore_eos,
        }


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(GenerationRequest):
    prompt: str | list[str]

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: str | list[str]) -> str:
        if isinstance(value, list):
            if len(value) != 1:
                raise ValueError("exactly one prompt string is supported per request")
            value = value[0]
        if not value:
            raise ValueError("the prompt is empty")
        return value

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


# Fields that would change the answer; refused unless absent or at their neutral value.
UNSUPPORTED_CHAT_FIELDS = {
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "logit_bias": (None, {}),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
}
UNSUPPORTED_COMPLETION_FIELDS = {
    "logprobs": (None, 0, False),
    "echo": (None, False),
    "suffix": (None, ""),
    "best_of": (None, 1),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
}


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """The JSON object in a request body.

    Raises:
        APIError: 400 ``invalid_json`` for a body that is not a JSON object.
    """
    try:
        body = json.loads(raw or b"")
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(400, f"The request body is not valid JSON: {exc}",
                       code="invalid_json") from exc
    if not isinstance(body, dict):
        raise APIError(400, "The request body must be a JSON object.", code="invalid_json")
    return body


def _refuse_unsupported(body: dict[str, Any], unsupported: dict[str, tuple]) -> None:
    for name, neutral in unsupported.items():
        if name in body and body[name] not in neutral:
            raise APIError(400, f"'{name}' is not supported by this server.", param=name,
                           code="unsupported_parameter")
    response_format = body.get("response_format")
    if response_format not in (None, {"type": "text"}):
        raise APIError(400, "'response_format' other than text is not supported by this server.",
                       param="response_format", code="unsupported_parameter")


def validate(model: type[GenerationRequest], body: dict[str, Any]) -> GenerationRequest:
    """Validate ``body`` against ``model``.

    Raises:
        APIError: 400 naming the first offending field.
    """
    unsupported = (UNSUPPORTED_CHAT_FIELDS if model is ChatCompletionRequest
                   else UNSUPPORTED_COMPLETION_FIELDS)
    _refuse_unsupported(body, unsupported)
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        message = first["msg"].removeprefix("Value error, ")
        if first["type"] == "missing":
            message = f"'{param}' is required."
        else:
            message = f"Invalid value for '{param}': {message}."
        raise APIError(400, message, param=param, code="invalid_value") from exc
