"""Request bodies of the OpenAI-compatible endpoints, validated with pydantic.

The rules every body object follows (strict JSON types, valid Unicode text, unknown fields
refused, ``null`` as the default) are :mod:`api.fields`'; how an error is told to the client,
:mod:`api.field_errors`'. Which fields are honoured, accepted without changing the answer, refused
as not served (``tools``, ``logit_bias``, vLLM's old ``guided_json``, ...) or unknown:
:mod:`api.served_fields`.

Structured outputs, on both endpoints: OpenAI's ``response_format`` (``text``, ``json_object``,
``json_schema``) and vLLM's ``structured_outputs`` (one of ``json``, ``regex``, ``choice``,
``grammar``), whose shapes and checks are :mod:`api.structured_fields`'; the request's
:attr:`GenerationRequest.structured` goes to the worker in its sampling settings.

Log-probabilities, as the OpenAI API bounds them: chat ``logprobs`` (a boolean) and
``top_logprobs`` (0 to 20, only with ``logprobs``); completions ``logprobs`` (0 to 5 likeliest
tokens besides the chosen one) and ``echo`` (the prompt comes back before the answer, with its
logprobs when ``logprobs`` is given).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from api import field_errors, served_fields, structured_fields
from api.fields import BodyObject, Text, unicode_text, wrong_type
from api.structured_fields import ResponseFormat, StructuredOutputs
from gateway.conf import platform_settings
from gateway.errors import APIError
from inference.protocol.structured import StructuredOutput

MAX_STOP_SEQUENCES = 4
# Upper bound of the token counts a request may name (an int32, as most servers take).
MAX_TOKENS_LIMIT = 2**31 - 1
# A sampling seed seeds a ``torch.Generator``, which takes this range.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
# The OpenAI API's bounds: chat ``top_logprobs``, completions ``logprobs``.
MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
# The OpenAI API's bounds of ``metadata``.
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512

Name = Annotated[str, Field(max_length=256), AfterValidator(unicode_text)]


class StreamOptions(BodyObject):
    include_usage: bool = False
    # Accepted when false (served_fields refuses true): no chunk carries an obfuscation field.
    include_obfuscation: bool = False


class PromptCacheOptions(BodyObject):
    """OpenAI's prompt-cache options: checked, not used (this server's prefix cache needs none)."""

    mode: Literal["implicit", "explicit"] | None = None
    ttl: Text | None = None


class ChatMessage(BodyObject):
    """One chat message, of any role's fields in OpenAI's message schema
    (:data:`api.served_fields.MESSAGE_FIELDS` says which role has which).

    Content is a string or a list of text parts (an assistant's: text and refusal parts); an
    assistant's content may be null or left out (an empty turn). An assistant's ``refusal`` is
    part of its turn: the turn's text is its content, then its refusal. ``audio``,
    ``function_call`` and ``tool_calls`` are accepted empty only (``api.served_fields`` refuses
    the rest); ``name`` and ``annotations`` are checked, not used (the chat template has no place
    for them).
    """

    role: Literal["system", "developer", "user", "assistant"]
    content: Text
    name: Name | None = None
    refusal: Text | None = None
    annotations: list[Any] | None = None
    audio: None = None
    function_call: None = None
    tool_calls: Annotated[list[Any], Field(max_length=0)] | None = None

    @model_validator(mode="before")
    @classmethod
    def _assistant_content_optional(cls, data: Any) -> Any:
        """An assistant message without content is an empty turn, as with null content."""
        if isinstance(data, dict) and data.get("role") == "assistant" and "content" not in data:
            return {**data, "content": None}
        return data

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any, info: ValidationInfo) -> Any:
        """A string, or the text of a list of ``{"type": "text", "text": ...}`` parts (and, in an
        assistant's message, ``{"type": "refusal", "refusal": ...}`` parts)."""
        assistant = info.data.get("role") == "assistant"
        if isinstance(value, str):
            return value
        if value is None and assistant:
            return ""
        if not isinstance(value, list):
            raise wrong_type("a string or an array of text content parts")
        texts = []
        for part in value:
            kind = part.get("type") if isinstance(part, dict) else None
            key = "text" if kind == "text" else "refusal" if kind == "refusal" and assistant \
                else None
            if key is None or not isinstance(part.get(key), str):
                raise ValueError("only text content parts are supported" if not assistant else
                                 "only text and refusal content parts are supported")
            if not isinstance(part.get("prompt_cache_breakpoint"), dict | None):
                raise ValueError("a content part's 'prompt_cache_breakpoint' must be an object")
            texts.append(part[key])
        return "".join(texts)

    def as_dict(self) -> dict[str, str]:
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": self.content + (self.refusal or "")}


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
    n: int = Field(1, ge=1)  # served_fields refuses n > 1
    user: Name | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    top_k: int = Field(0, ge=-1, le=MAX_TOKENS_LIMIT)
    min_tokens: int = Field(0, ge=0, le=MAX_TOKENS_LIMIT)
    ignore_eos: bool = False
    # Structured outputs (api.structured_fields): OpenAI's, and vLLM's; at most one asks.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # OpenAI fields that do not change the answer: checked, not used (taken on both endpoints,
    # so that a client may send the same options to each).
    store: bool | None = None
    metadata: dict[Text, Text] | None = None
    # OpenAI's tiers (the openai package's ``service_tier`` Literal); all served alike here.
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "fast"] | None = None
    prompt_cache_key: Name | None = None
    prompt_cache_retention: Name | None = None
    prompt_cache_options: PromptCacheOptions | None = None
    safety_identifier: Name | None = None

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

    @field_validator("metadata")
    @classmethod
    def _metadata_bounds(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        """At most 16 pairs, keys of at most 64 characters, values of at most 512."""
        if value is None:
            return value
        if len(value) > MAX_METADATA_PAIRS:
            raise ValueError(f"expected at most {MAX_METADATA_PAIRS} key-value pairs, but got "
                             f"{len(value)}")
        if any(len(key) > MAX_METADATA_KEY for key in value):
            raise ValueError(f"a key is longer than {MAX_METADATA_KEY} characters")
        if any(len(text) > MAX_METADATA_VALUE for text in value.values()):
            raise ValueError(f"a value is longer than {MAX_METADATA_VALUE} characters")
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

    @property
    def structured(self) -> StructuredOutput | None:
        """What the answer must match (None: unconstrained), as :func:`validate` checked it."""
        return structured_fields.requested(self.response_format, self.structured_outputs)

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
            "structured": self.structured,
        }


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # Accepted, not used: no tool is ever offered (served_fields refuses tools).
    parallel_tool_calls: bool | None = None

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


def validate(model: type[GenerationRequest], body: dict[str, Any]) -> GenerationRequest:
    """Validate ``body`` against ``model``.

    Raises:
        APIError: 400 naming the first offending field, as the client wrote it:
            ``unsupported_parameter`` for a field this server does not serve,
            ``unknown_parameter`` for a field it does not know, ``invalid_json_schema`` or
            ``invalid_structured_output`` for a structured-output spec the grammar library cannot
            apply (:func:`api.structured_fields.check`), else ``invalid_value``.
    """
    body = served_fields.refuse_unserved(body, chat=model is ChatCompletionRequest)
    try:
        req = model.model_validate(body)
    except RecursionError as exc:
        raise _too_deep() from exc
    except ValidationError as exc:
        first = exc.errors()[0]
        if first["type"] == field_errors.UNKNOWN_FIELD:
            raise served_fields.unknown(first["loc"]) from exc
        if first["type"] == "string_unicode" and (
                key := served_fields.key_not_unicode(body, first["loc"])):
            raise served_fields.unknown(key) from exc  # no field's name is a lone surrogate
        param = field_errors.param(first["loc"])
        raise APIError(400, field_errors.message(model, first, param), param=param,
                       code="invalid_value") from exc
    most = req.requested_max_tokens
    if most is not None and req.min_tokens > most:
        raise APIError(400, f"Invalid value for 'min_tokens': expected at most "
                            f"'{req.max_tokens_param}' ({most}), but got {req.min_tokens}.",
                       param="min_tokens", code="invalid_value")
    try:
        structured_fields.check_request(req, platform_settings()["STRUCTURED_MAX_SPEC_BYTES"])
    except RecursionError as exc:  # a schema as deep as the parser goes, written back as JSON
        raise _too_deep() from exc
    return req
