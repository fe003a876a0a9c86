"""Request bodies of the OpenAI-compatible endpoints, validated with pydantic.

The rules every body object follows (strict JSON types, valid Unicode text, unknown fields
ignored, ``null`` as the default) are :mod:`api.fields`'; how an error is told to the client,
:mod:`api.field_errors`'. Known fields that would change the answer and that this server does not
offer (``tools``, ``response_format`` other than text, ``logit_bias``, ...) are refused with a 400
naming the field.

Log-probabilities, as the OpenAI API bounds them: chat ``logprobs`` (a boolean) and
``top_logprobs`` (0 to 20, only with ``logprobs``); completions ``logprobs`` (0 to 5 likeliest
tokens besides the chosen one) and ``echo`` (the prompt comes back before the answer, with its
logprobs when ``logprobs`` is given).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, ValidationError, ValidationInfo, field_validator

from api import field_errors
from api.fields import BodyObject, Text, unicode_text, wrong_type
from gateway.errors import APIError

MAX_STOP_SEQUENCES = 4
# Upper bound of the token counts a request may name (an int32, as most servers take).
MAX_TOKENS_LIMIT = 2**31 - 1
# A sampling seed seeds a ``torch.Generator``, which takes this range.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
# The OpenAI API's bounds: chat ``top_logprobs``, completions ``logprobs``.
MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5


class StreamOptions(BodyObject):
    include_usage: bool = False


class ChatMessage(BodyObject):
    """One chat message; content is a string or a list of text parts (null: an assistant's
    empty turn, as the OpenAI API allows for an assistant message)."""

    role: Literal["system", "developer", "user", "assistant"]
    content: Text
    # The participant's name (OpenAI's field); checked, not used.
    name: Annotated[str, Field(max_length=256), AfterValidator(unicode_text)] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any, info: ValidationInfo) -> Any:
        """A string, or the text of a list of ``{"type": "text", "text": ...}`` parts."""
        if isinstance(value, str):
            return value
        if value is None and info.data.get("role") == "assistant":
            return ""
        if not isinstance(value, list):
            raise wrong_type("a string or an array of text content parts")
        texts = []
        for part in value:
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise ValueError("only text content parts are supported")
            texts.append(part["text"])
        return "".join(texts)

    def as_dict(self) -> dict[str, str]:
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": self.content}


class GenerationRequest(BodyObject):
    """Fields shared by chat and text completions (extensions: top_k, min_tokens, ignore_eos).

    Every optional field may be sent as ``null``, meaning its default (:class:`BodyObject`).
    """

    model: Annotated[str, Field(min_length=1), AfterValidator(unicode_text)]
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: list[Text] = []
    n: int = Field(1, ge=1)
    user: Annotated[str, Field(max_length=256), AfterValidator(unicode_text)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    top_k: int = Field(0, ge=-1, le=MAX_TOKENS_LIMIT)
    min_tokens: int = Field(0, ge=0, le=MAX_TOKENS_LIMIT)
    ignore_eos: bool = False

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, value: Any) -> Any:
        """A string, an array of strings or null; a lone string is reported as ``stop``."""
        if value is None:
            return []
        if isinstance(value, str):
            return [unicode_text(value)]
        if not isinstance(value, list):
            raise wrong_type("a string, an array of strings or null")
        if len(value) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are supported")
        return value

    @field_validator("stop")
    @classmethod
    def _drop_empty_stops(cls, value: list[str]) -> list[str]:
        return [s for s in value if s]

    @field_validator("n")
    @classmethod
    def _single_choice(cls, value: int) -> int:
        if value > 1:
            raise ValueError("n > 1 is not supported by this server; send n separate requests")
        return value

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def max_tokens_param(self) -> str | None:
        """The field that set the requested max_tokens, as the client named it (None: omitted)."""
        return "max_tokens" if self.max_tokens is not None else None

    @property
    def prompt_param(self) -> str:
        """The field that carries the prompt."""
        raise NotImplementedError

    @property
    def token_logprobs(self) -> int | None:
        """Likeliest tokens to report with each generated token's logprob (None: no logprobs)."""
        return None

    @property
    def prompt_logprobs(self) -> int | None:
        """The same for each prompt token (None: none)."""
        return None

    @property
    def echoed_prompt(self) -> str | None:
        """The prompt text to send back before the answer (None: not asked)."""
        return None

    def sampling(self, max_tokens: int | None) -> dict[str, Any]:
        """Fields of ``inference.engine.request.SamplingParams``; a None max_tokens: the worker
        decides."""
        return {
            "max_tokens": max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": max(self.top_k, 0),
            "seed": self.seed,
            "stop": list(self.stop or []),
            "min_tokens": self.min_tokens,
            "ignore_eos": self.ignore_eos,
            "logprobs": self.token_logprobs,
            "prompt_logprobs": self.prompt_logprobs,
        }


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @field_validator("top_logprobs")
    @classmethod
    def _only_with_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):
            raise ValueError("'logprobs' must be true when 'top_logprobs' is more than 0")
        return value

    @property
    def token_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def max_tokens_param(self) -> str | None:
        if self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return super().max_tokens_param

    @property
    def prompt_param(self) -> str:
        return "messages"


class CompletionRequest(GenerationRequest):
    prompt: Text
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool = False

    @field_validator("logprobs", mode="before")
    @classmethod
    def _false_is_none(cls, value: Any) -> Any:
        """``false``, which some clients send for "no logprobs", is the default."""
        return None if value is False else value

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        """A string, or an array of exactly one string (reported as ``prompt``)."""
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            if len(value) != 1:
                raise ValueError("exactly one prompt string is supported per request")
            return value[0]
        if not isinstance(value, str):
            raise wrong_type("a string or an array of one string")
        return value

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, value: str) -> str:
        if not value:
            raise ValueError("the prompt is empty")
        return value

    @property
    def prompt_param(self) -> str:
        return "prompt"

    @property
    def token_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def prompt_logprobs(self) -> int | None:
        return self.logprobs if self.echo else None

    @property
    def echoed_prompt(self) -> str | None:
        return self.prompt if self.echo else None


# Fields that would change the answer; refused unless absent or at their neutral value.
UNSUPPORTED_CHAT_FIELDS = {
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "logit_bias": (None, {}),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
}
UNSUPPORTED_COMPLETION_FIELDS = {
    "suffix": (None, ""),
    "best_of": (None, 1),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
}


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _too_deep() -> APIError:
    return APIError(400, "The request body is nested too deeply to be a request.",
                    code="invalid_json")


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """The JSON object in a request body.

    Raises:
        APIError: 400 ``invalid_json`` for a body that is not a JSON object (not JSON, not
            UTF-8, ``NaN`` or ``Infinity``, nested deeper than the parser goes, an integer of
            more than 4300 digits).
    """
    try:
        body = json.loads(raw or b"", parse_constant=_refuse_constant)
    except RecursionError as exc:
        raise _too_deep() from exc
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
        APIError: 400 naming the first offending field, as the client wrote it.
    """
    unsupported = (UNSUPPORTED_CHAT_FIELDS if model is ChatCompletionRequest
                   else UNSUPPORTED_COMPLETION_FIELDS)
    _refuse_unsupported(body, unsupported)
    try:
        req = model.model_validate(body)
    except RecursionError as exc:
        raise _too_deep() from exc
    except ValidationError as exc:
        first = exc.errors()[0]
        param = field_errors.param(first["loc"])
        raise APIError(400, field_errors.message(model, first, param), param=param,
                       code="invalid_value") from exc
    most = req.requested_max_tokens
    if most is not None and req.min_tokens > most:
        raise APIError(400, f"Invalid value for 'min_tokens': expected at most "
                            f"'{req.max_tokens_param}' ({most}), but got {req.min_tokens}.",
                       param="min_tokens", code="invalid_value")
    return req
