"""The messages both sides build and validate: a request, its events, an abort, a usage report."""

from __future__ import annotations

import time
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

    ``logprobs``: the token's log-probabilities, for a request that asked (``Sampling.logprobs``).
    ``prompt_logprobs``: one entry per prompt token, on the request's first event only (this
    one, or the final event when no token was streamed), for a request that asked
    (``Sampling.prompt_logprobs``).
    """

    type: Literal["token"] = "token"
    request_id: str
    seq: int = Field(ge=0)
    token_id: int
    text: str
    logprobs: PositionLogprobs | None = None
    prompt_logprobs: tuple[PositionLogprobs, ...] | None = None


class FinalEvent(Message):
    """The last event of a request: exactly one, and nothing after it.

    ``text`` is text held back while a stop string might have been forming and released at the
    end (usually empty). ``error`` is set exactly when ``finish_reason`` is ``error``.
    ``timings`` (seconds) may hold ``queue_s``, ``ttft_s`` and ``e2e_s``. ``prompt_logprobs``:
    as :class:`TokenEvent`'s, here when the request streamed no token (its first was EOS).
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


class ChatTurn(Message):
    """One chat message of a request; ``content`` is text."""

    role: Literal["system", "user", "assistant"]
    content: str


class Sampling(Message):
    """Decoding settings of a request (the engine's ``SamplingParams`` fields).

    ``max_tokens`` None means what is left of the model's context, capped by the request's
    ``default_max_tokens``. ``top_k`` 0 disables it. ``logprobs``: report each generated
    token's log-probability and this many likeliest tokens (None: none). ``prompt_logprobs``:
    the same for every prompt token (None: none); every prompt position is then computed, with
    no prefix-cache hit. A request queued again to go on from tokens already streamed (their
    prompt part of its new prompt) must not ask ``prompt_logprobs`` again: they were sent.
    """

    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(0.0, ge=0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


class Resume(Message):
    """Where a request preempted for a higher tier stopped: what the next worker to take it
    needs to continue it with no token lost or repeated (``docs/design.md``, "Preemption across
    priority tiers").

    ``generated``: every token generated so far (streamed already); they follow the prompt when
    it is admitted again. ``max_tokens``: the budget as first resolved (``generated`` counts
    against it). ``next_seq``: the ``seq`` of its next event. ``cached_prompt_tokens``: the
    prefix hits of its first admission (its usage). ``arrived_at``, ``admitted_at``,
    ``first_token_at``, ``requeued_at``: unix seconds (its timings, TTFT included, are its first
    run's; its admission deadline counts again from ``requeued_at``). ``sampler_state``: its
    random generator's state, base64 (a seeded request continues its draws).
    """

    prompt_tokens: int = Field(ge=1)
    max_tokens: int = Field(ge=2)
    generated: tuple[int, ...] = Field(min_length=1)
    next_seq: int = Field(ge=0)
    preemptions: int = Field(ge=1)
    cached_prompt_tokens: int = Field(0, ge=0)
    arrived_at: float
    admitted_at: float | None = None
    first_token_at: float | None = None
    requeued_at: float
    sampler_state: str | None = None

    def usage(self) -> Usage:
        """What the request is billed for so far."""
        return Usage(prompt_tokens=self.prompt_tokens,
                     cached_prompt_tokens=self.cached_prompt_tokens,
                     completion_tokens=len(self.generated))


class RequestMessage(Message):
    """One generation request, from the web tier to a worker.

    Exactly one of ``messages`` (chat) and ``prompt`` (completion) is set. ``enqueued_at`` is
    unix time (seconds) when the web tier accepted it; ``queue_deadline_s`` bounds the wait from
    then until a worker admits it (0: no deadline). ``meta`` is opaque to the worker and handed
    back in the :class:`UsageReport` (tenant and key ids, the reservations to settle).
    ``resume`` is set by a worker that preempted the request and put it back in the queue.
    """

    request_id: str = Field(min_length=1)
    tenant: str
    fairness_key: str
    priority: int = 0
    fairness_weight: float = Field(1.0, gt=0, allow_inf_nan=False)
    messages: tuple[ChatTurn, ...] | None = None
    prompt: str | None = None
    sampling: Sampling = Sampling()
    default_max_tokens: int = Field(512, ge=1)
    enqueued_at: float = Field(default_factory=time.time)
    queue_deadline_s: float = Field(0.0, ge=0)
    # The web process streaming the answer (its heartbeat in ``{p}:web``): when it dies, the
    # worker stops generating for nobody. Empty: no process waits (tools, tests).
    origin: str = ""
    meta: dict[str, Any] = Field(default_factory=dict)
    resume: Resume | None = None

    @model_validator(mode="after")
    def _one_prompt(self) -> RequestMessage:
        if (self.messages is None) == (self.prompt is None):
            raise ValueError("give exactly one of messages and prompt")
        return self

    def chat(self) -> list[dict[str, str]] | None:
        """``messages`` as plain dicts (for a chat template), or None for a completion."""
        if self.messages is None:
            return None
        return [{"role": m.role, "content": m.content} for m in self.messages]

    def deadline(self) -> float | None:
        """Unix time by which a worker must admit the request, or None (a preempted request:
        counted from its return to the queue)."""
        if not self.queue_deadline_s:
            return None
        start = self.resume.requeued_at if self.resume is not None else self.enqueued_at
        return start + self.queue_deadline_s


class ControlMessage(Message):
    """A command to every worker: ``abort`` one request."""

    type: Literal["abort"]
    request_id: str = Field(min_length=1)


class UsageReport(Message):
    """What a worker reports of one finished request, for billing (the Celery usage task).

    ``first_token_at`` and ``finished_at`` are unix times (seconds); ``meta`` is the request
    message's. The web tier derives the HTTP status to record from the finish reason and error.
    """

    request_id: str
    meta: dict[str, Any] = Field(default_factory=dict)
    usage: Usage
    finish_reason: FinishReason
    error: ErrorInfo | None = None
    enqueued_at: float
    first_token_at: float | None = None
    finished_at: float

    @property
    def ttft_s(self) -> float | None:
        return self.first_token_at - self.enqueued_at if self.first_token_at else None

    @property
    def duration_s(self) -> float:
        return self.finished_at - self.enqueued_at
