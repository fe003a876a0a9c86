"""The messages that cross Redis besides the events: a request, an abort, a usage report.

Their fields use the engine's terms of :mod:`inference.protocol.events` (finish reasons, errors,
usage); they are built and validated by both sides.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import Field, model_validator

from inference.protocol.events import MAX_LOGPROBS, ErrorInfo, FinishReason, Message, Usage
from inference.protocol.structured import StructuredOutput


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
    ``structured``: the grammar the answer must match (None: unconstrained), checked by the web
    tier with :func:`inference.protocol.structured.check`.
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
    structured: StructuredOutput | None = None


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
