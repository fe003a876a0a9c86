"""What an engine emits, as both sides build and validate it: token and final events, errors
(an :class:`ErrorCode`, never an HTTP status), usage and log-probabilities.

This part of the contract is what the engine itself uses (:mod:`inference.engine.request`): it
imports only pydantic, neither Redis nor the environment."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Literal, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializationInfo,
    SerializerFunctionWrapHandler,
    TypeAdapter,
    model_serializer,
    model_validator,
)


class Message(BaseModel):
    """Base of every message that crosses Redis: strict about unknown fields, immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    def to_json(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_json(cls, data: str | bytes) -> Self:
        """Parse and validate a message.

        Raises:
            pydantic.ValidationError: malformed JSON or a field of the wrong shape.
        """
        return cls.model_validate_json(data)


class FinishReason(StrEnum):
    """Why a request ended; ``error`` carries an :class:`ErrorInfo`."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


class ErrorCode(StrEnum):
    """Why a request was refused or failed. The web tier maps each code to an HTTP status."""

    QUEUE_FULL = "queue_full"  # gate 1
    KV_BUDGET_EXCEEDED = "kv_budget_exceeded"  # gate 2, hard-reject
    KV_POOL_EXCEEDED = "kv_pool_exceeded"  # gate 3, hard-reject
    QUEUE_TIMEOUT = "queue_timeout"  # not admitted within MAX_QUEUE_WAIT_S
    BATCH_EXPIRED = "batch_expired"  # a batch request not done by its own deadline
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    INVALID_REQUEST = "invalid_request"
    ENGINE_ERROR = "engine_error"
    WORKER_SHUTDOWN = "worker_shutdown"
    WORKER_LOST = "worker_lost"  # its worker died while running it
    STATE_LOST = "state_lost"  # Redis lost its data (restarted without it) while it ran
    INTERRUPTED = "interrupted"  # stopped by the server, not by its client (a drain's end)
    # Its tenant already has STRUCTURED_COMPILES_PER_TENANT grammars compiling on that worker.
    GRAMMAR_BUSY = "grammar_busy"
    # Its LoRA adapter could not be loaded on the worker (a file gone, changed or unreadable).
    ADAPTER_UNAVAILABLE = "adapter_unavailable"


class ErrorInfo(Message):
    """A structured refusal or failure.

    ``gate`` is the backpressure gate (1 to 3) of a refusal; ``retryable`` says whether the same
    request may succeed later; ``details`` carries the numbers (and ``param``, the request field
    at fault, when there is one).
    """

    code: ErrorCode
    message: str
    gate: int | None = Field(None, ge=1, le=3)
    retryable: bool = False
    details: dict[str, Any] = Field(default_factory=dict)


class Usage(Message):
    """Token counts of one request; ``cached_prompt_tokens`` were prefix-cache hits."""

    prompt_tokens: int = Field(0, ge=0)
    cached_prompt_tokens: int = Field(0, ge=0)
    completion_tokens: int = Field(0, ge=0)


# Most alternatives a request may ask per position (``logprobs``, ``prompt_logprobs``).
MAX_LOGPROBS = 20
# A log-probability below this (a token the model rules out, -inf) is reported as this, as vLLM
# does: JSON has no -inf.
LOGPROB_FLOOR = -9999.0


class TokenLogprob(Message):
    """One token and its log-probability at a position (natural log, <= 0).

    ``token`` is its text; where its bytes are not whole UTF-8 characters (a piece of a
    character split across tokens) it is ``"bytes:"`` followed by ``\\xNN`` escapes, and
    ``raw_bytes`` holds the bytes. ``raw_bytes`` None: the bytes are ``token``'s UTF-8.
    """

    token_id: int
    token: str
    logprob: float = Field(ge=LOGPROB_FLOOR, le=0.0)
    raw_bytes: tuple[int, ...] | None = None

    def utf8_bytes(self) -> list[int]:
        """The token's bytes."""
        return list(self.raw_bytes) if self.raw_bytes is not None else list(
            self.token.encode("utf-8"))


class PositionLogprobs(Message):
    """The token at one position of a sequence, its log-probability and the likeliest tokens.

    Values are the log-softmax (fp32) of the model's raw logits at the position before, before
    temperature, top-k and top-p. ``logprob`` is None only for a prompt's first token, which
    nothing predicts. ``top``: the most likely tokens, most likely first (as many as the request
    asked), whether or not they include this token.
    """

    token_id: int
    token: str
    logprob: float | None = Field(ge=LOGPROB_FLOOR, le=0.0)
    raw_bytes: tuple[int, ...] | None = None
    top: tuple[TokenLogprob, ...] = ()

    def utf8_bytes(self) -> list[int]:
        """The token's bytes."""
        return list(self.raw_bytes) if self.raw_bytes is not None else list(
            self.token.encode("utf-8"))


class TokenEvent(Message):
    """One generated token: its id and the text it adds (valid UTF-8, maybe empty).

    ``logprobs``: for a request that asked (``Sampling.logprobs``), the entries of the tokens
    whose text this event completes, in order (None: none). An entry waits with its token's text
    while it is held back for a possible stop string; a token past a stop string has none, and
    the token a stop string starts inside has its ``token`` cut to the returned text, so the
    entries' texts join to the answer's text.
    ``prompt_logprobs``: one entry per prompt token, on the request's first event only (this
    one, or the final event when no token was streamed), for a request that asked
    (``Sampling.prompt_logprobs``).
    """

    type: Literal["token"] = "token"
    request_id: str
    seq: int = Field(ge=0)
    token_id: int
    text: str
    logprobs: tuple[PositionLogprobs, ...] | None = None
    prompt_logprobs: tuple[PositionLogprobs, ...] | None = None
    index: int = Field(0, ge=0)

    @model_serializer(mode="wrap")
    def _without_default_index(self, handler: SerializerFunctionWrapHandler,
                               info: SerializationInfo) -> dict[str, Any]:
        # A request of one choice (index 0) serializes exactly as before ``n`` existed.
        data = handler(self)
        if self.index == 0:
            data.pop("index", None)
        return data


class ChoiceEnd(Message):
    """How one choice of a request with ``n`` > 1 ended (an entry of ``FinalEvent.choices``).

    ``index``: the choice (0 to n - 1, as :attr:`TokenEvent.index`). ``text`` and ``logprobs``:
    what this choice held back and released at its end (as ``FinalEvent.text`` and
    ``FinalEvent.logprobs`` for one choice). ``completion_tokens``: the tokens this choice
    generated. ``error`` is set exactly when ``finish_reason`` is ``error`` (this choice alone
    failed, or the whole request did).
    """

    index: int = Field(ge=0)
    finish_reason: FinishReason
    text: str = ""
    logprobs: tuple[PositionLogprobs, ...] | None = None
    completion_tokens: int = Field(0, ge=0)
    error: ErrorInfo | None = None

    @model_validator(mode="after")
    def _error_iff_failed(self) -> ChoiceEnd:
        if (self.error is not None) != (self.finish_reason is FinishReason.ERROR):
            raise ValueError("error is set exactly when finish_reason is 'error'")
        return self


class FinalEvent(Message):
    """The last event of a request: exactly one, and nothing after it.

    ``text`` is text held back while a stop string might have been forming and released at the
    end (usually empty). ``error`` is set exactly when ``finish_reason`` is ``error``.
    ``timings`` (seconds) may hold ``queue_s``, ``ttft_s`` and ``e2e_s``. ``prompt_logprobs``:
    as :class:`TokenEvent`'s, here when the request streamed no token (its first was EOS).
    ``logprobs``: the entries still held back with ``text`` (as :class:`TokenEvent`'s).

    A request with ``n`` > 1 choices has one final event too, after every choice ended:
    ``choices`` holds one :class:`ChoiceEnd` per choice, in index order (each with its own held
    text and logprobs; ``text`` and ``logprobs`` here are then empty); ``finish_reason`` is
    ``abort`` or ``error`` when the request as a whole was aborted or failed, else choice 0's;
    ``usage`` counts the prompt once and the completion tokens of every choice. For ``n`` = 1
    ``choices`` is empty (and left out of the JSON).
    """

    type: Literal["final"] = "final"
    request_id: str
    seq: int = Field(0, ge=0)
    finish_reason: FinishReason
    usage: Usage = Usage()
    text: str = ""
    error: ErrorInfo | None = None
    timings: dict[str, float] = Field(default_factory=dict)
    prompt_logprobs: tuple[PositionLogprobs, ...] | None = None
    logprobs: tuple[PositionLogprobs, ...] | None = None
    choices: tuple[ChoiceEnd, ...] = ()

    @model_validator(mode="after")
    def _error_iff_failed(self) -> FinalEvent:
        if (self.error is not None) != (self.finish_reason is FinishReason.ERROR):
            raise ValueError("error is set exactly when finish_reason is 'error'")
        if [c.index for c in self.choices] != list(range(len(self.choices))):
            raise ValueError("choices holds one entry per choice, in index order")
        return self

    @model_serializer(mode="wrap")
    def _without_empty_choices(self, handler: SerializerFunctionWrapHandler,
                               info: SerializationInfo) -> dict[str, Any]:
        # A request of one choice serializes exactly as before ``n`` existed.
        data = handler(self)
        if not self.choices:
            data.pop("choices", None)
        return data


def whole_request_choices(n: int, reason: FinishReason,
                          error: ErrorInfo | None = None) -> tuple[ChoiceEnd, ...]:
    """``FinalEvent.choices`` of a request of ``n`` choices that ended as a whole (refused,
    timed out, aborted or failed before its choices ran, or lost): every choice ends as the
    request, with no text; ``()`` for ``n`` = 1."""
    if n <= 1:
        return ()
    error = error if reason is FinishReason.ERROR else None
    return tuple(ChoiceEnd(index=i, finish_reason=reason, error=error) for i in range(n))


Event = TokenEvent | FinalEvent
_EVENT = TypeAdapter(Annotated[Event, Field(discriminator="type")])


def encode_event(event: Event) -> dict[str, str]:
    """Stream fields of one event: ``{"data": json}``."""
    return {"data": event.model_dump_json()}


def decode_event(fields: dict[bytes | str, bytes | str]) -> Event:
    """The event of a stream entry's fields.

    Raises:
        pydantic.ValidationError: the entry is not a valid event.
    """
    raw = fields.get(b"data", fields.get("data"))
    return _EVENT.validate_json(raw or b"")
