"""What an engine emits, as both sides build and validate it: token and final events, errors
(an :class:`ErrorCode`, never an HTTP status), usage and log-probabilities.

This part of the contract is what the engine itself uses (:mod:`inference.engine.request`): it
imports only pydantic, neither Redis nor the environment."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, model_validator


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
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    INVALID_REQUEST = "invalid_request"
    ENGINE_ERROR = "engine_error"
    WORKER_SHUTDOWN = "worker_shutdown"
    WORKER_LOST = "worker_lost"  # its worker died while running it
    STATE_LOST = "state_lost"  # Redis lost its data (restarted without it) while it ran
    INTERRUPTED = "interrupted"  # stopped by the server, not by its client (a drain's end)
    # Its tenant already has STRUCTURED_COMPILES_PER_TENANT grammars compiling on that worker.
    GRAMMAR_BUSY = "grammar_busy"


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


class FinalEvent(Message):
    """The last event of a request: exactly one, and nothing after it.

    ``text`` is text held back while a stop string might have been forming and released at the
    end (usually empty). ``error`` is set exactly when ``finish_reason`` is ``error``.
    ``timings`` (seconds) may hold ``queue_s``, ``ttft_s`` and ``e2e_s``. ``prompt_logprobs``:
    as :class:`TokenEvent`'s, here when the request streamed no token (its first was EOS).
    ``logprobs``: the entries still held back with ``text`` (as :class:`TokenEvent`'s).
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

    @model_validator(mode="after")
    def _error_iff_failed(self) -> FinalEvent:
        if (self.error is not None) != (self.finish_reason is FinishReason.ERROR):
            raise ValueError("error is set exactly when finish_reason is 'error'")
        return self


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
