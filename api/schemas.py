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

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    Field,
    ValidationInfo,
    field_validator,
)

from api import served_fields, structured_fields, tool_fields
from api.bodies import parse_model, too_deep
from api.fields import BodyObject, Name, Text, unicode_text, wrong_type
from api.messages import ChatMessage, check_tool_history
from api.structured_fields import ResponseFormat, StructuredOutputs
from gateway.conf import platform_settings
from gateway.errors import APIError
from inference.protocol.structured import ANY_OBJECT_SCHEMA, StructuredOutput

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

def metadata_bounds(value: dict[str, str] | None) -> dict[str, str] | None:
    """OpenAI's bounds of ``metadata``: at most 16 pairs, keys of at most 64 characters, values
    of at most 512 (a pydantic validator's ``ValueError`` otherwise)."""
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


class StreamOptions(BodyObject):
    include_usage: bool = False
    # Accepted when false (served_fields refuses true): no chunk carries an obfuscation field.
    include_obfuscation: bool = False


class PromptCacheOptions(BodyObject):
    """OpenAI's prompt-cache options: checked, not used (this server's prefix cache needs none)."""

    mode: Literal["implicit", "explicit"] | None = None
    ttl: Text | None = None


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
    n: int = Field(1, ge=1)  # at most MAX_N (validate)
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
        return metadata_bounds(value)

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
            "n": self.n,
        }


class ChatCompletionRequest(GenerationRequest):
    """A chat completion; tool calling (``tools``, ``tool_choice``, ``parallel_tool_calls``) is
    :mod:`api.tool_fields`'."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: tool_fields.Tools | None = None
    tool_choice: tool_fields.ToolChoice | None = None
    parallel_tool_calls: bool = True

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _named_choice_shape(cls, value: Any) -> Any:
        """An object is a named function, in OpenAI's chat shape (a message that says so)."""
        if isinstance(value, dict) and (set(value) != {"type", "function"} or value["type"] !=
                                        "function" or not isinstance(value["function"], dict)):
            raise ValueError('expected "none", "auto", "required" or {"type": "function", '
                             '"function": {"name": ...}}')
        return value

    @property
    def calls_tools(self) -> bool:
        """Whether the answer may call tools (:func:`api.tool_fields.offered`)."""
        return tool_fields.offered(self.tools, self.tool_choice)

    @property
    def calls_only(self) -> bool:
        """Whether the grammar lets no text come before a call (``required``, a named function,
        or ``auto`` with a JSON ``response_format``)."""
        fmt = self.response_format
        return self.calls_tools and (self.tool_choice not in (None, "auto") or (
            fmt is not None and fmt.type != "text"))

    @property
    def prompt_tools(self) -> list[dict[str, Any]] | None:
        """The tools the prompt offers (None: none; ``tool_choice: none`` offers none)."""
        return [t.for_prompt() for t in self.tools or ()] if self.calls_tools else None

    @property
    def structured(self) -> StructuredOutput | None:
        """The tool-call grammar when tools are offered (a text answer's ``response_format``
        schema inside it), else the request's structured output."""
        out = super().structured
        if not self.calls_tools:
            return out
        text_schema = None
        if out is not None:
            text_schema = out.spec if out.kind == "json_schema" else ANY_OBJECT_SCHEMA
        return StructuredOutput(kind="grammar", param="tools", spec=tool_fields.tool_grammar(
            self.tools or [], self.tool_choice, self.parallel_tool_calls, text_schema))

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
    req = parse_model(model, body)
    both = (getattr(req, "max_completion_tokens", None), req.max_tokens)
    if None not in both and both[0] != both[1]:
        raise APIError(400, f"Invalid value for 'max_completion_tokens': 'max_tokens' "
                            f"({both[1]}) says otherwise; give one of them.",
                       param="max_completion_tokens", code="invalid_value")
    most = req.requested_max_tokens
    if most is not None and req.min_tokens > most:
        raise APIError(400, f"Invalid value for 'min_tokens': expected at most "
                            f"'{req.max_tokens_param}' ({most}), but got {req.min_tokens}.",
                       param="min_tokens", code="invalid_value")
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "The 'stream_options' parameter is only allowed when 'stream' is "
                            "enabled.", param="stream_options", code="invalid_value")
    conf = platform_settings()
    if req.n > conf["MAX_N"]:
        raise APIError(400, f"Invalid value for 'n': expected at most {conf['MAX_N']} choices "
                            f"(MAX_N), but got {req.n}.", param="n", code="invalid_value")
    if isinstance(req, ChatCompletionRequest):
        check_tool_history(req.messages)
        tool_fields.check_request(req, max_tools=conf["MAX_TOOLS"],
                                  max_bytes=conf["MAX_TOOLS_BYTES"])
        for spec in tool_fields.parameter_specs(req.tools or []):
            structured_fields.check(spec, conf["STRUCTURED_MAX_SPEC_BYTES"])
    try:
        structured_fields.check_request(req, conf["STRUCTURED_MAX_SPEC_BYTES"])
    except RecursionError as exc:  # a schema as deep as the parser goes, written back as JSON
        raise too_deep() from exc
    return req
