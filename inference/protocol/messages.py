"""The messages that cross Redis besides the events: a request, an abort, a usage report.

Their fields use the engine's terms of :mod:`inference.protocol.events` (finish reasons, errors,
usage); they are built and validated by both sides.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import (
    Field,
    SerializationInfo,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

from inference.protocol.events import (
    MAX_LOGPROBS,
    ChoiceEnd,
    ErrorInfo,
    FinishReason,
    Message,
    Usage,
)
from inference.protocol.models import adapter_key
from inference.protocol.structured import StructuredOutput


class ToolCall(Message):
    """A tool call of an assistant turn in a chat's history, in OpenAI's shape:
    ``{"id", "type": "function", "function": {"name", "arguments"}}`` (``arguments``: JSON
    text)."""

    id: str = ""
    type: Literal["function"] = "function"
    function: dict[str, str]


class ChatTurn(Message):
    """One chat message of a request; ``content`` is text.

    An assistant turn may carry ``tool_calls``; a ``tool`` turn is the result of the call
    ``tool_call_id`` (:mod:`inference.tokenization.chat_tools` renders both).
    """

    role: Literal["system", "user", "assistant", "tool"]
    content: str
    tool_calls: tuple[ToolCall, ...] | None = None
    tool_call_id: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """The turn for a chat template: ``role`` and ``content``, and its tool fields when
        set."""
        turn: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            turn["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            turn["tool_call_id"] = self.tool_call_id
        return turn


class Sampling(Message):
    """Decoding settings of a request (the engine's ``SamplingParams`` fields).

    ``max_tokens`` None means what is left of the model's context, capped by the request's
    ``default_max_tokens``. ``top_k`` 0 disables it. ``logprobs``: report each generated
    token's log-probability and this many likeliest tokens (None: none). ``prompt_logprobs``:
    the same for every prompt token (None: none); every prompt position is then computed, with
    no prefix-cache hit. A request queued again to go on from tokens already streamed (their
    prompt part of its new prompt) must not ask ``prompt_logprobs`` again: they were sent.
    ``structured``: the grammar the answer must match (None: unconstrained), checked by the web
    tier with :func:`inference.protocol.structured.check`. ``n``: independent choices sharing
    the prompt (the web tier bounds it by its ``MAX_N``; an engine refuses more than its
    ``max_batch_size`` with ``invalid_request``, ``param`` ``n``).
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
    n: int = Field(1, ge=1)


class ResumeChoice(Message):
    """One choice of a preempted request of ``n`` > 1 choices (``Resume.choices``).

    ``generated``: the tokens it generated so far (streamed already; empty once it ended).
    ``end``: how it ended, as the final event will say (None: it goes on). ``sampler_state``:
    its random generator's state, base64.
    """

    index: int = Field(ge=0)
    generated: tuple[int, ...] = ()
    end: ChoiceEnd | None = None
    sampler_state: str | None = None

    @model_validator(mode="after")
    def _ended_or_going_on(self) -> ResumeChoice:
        if (self.end is None) == (not self.generated):
            raise ValueError("a choice that goes on has generated tokens; one that ended has "
                             "its end and no tokens")
        return self


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
    random generator's state, base64 (a seeded request continues its draws). ``choices``: for a
    request of ``n`` > 1 choices (preempted as a whole, every choice at once), one
    :class:`ResumeChoice` per choice in index order; ``generated`` and ``sampler_state`` are then
    the choices' own (``generated`` here empty). Empty (and left out of the JSON) for one choice.
    """

    prompt_tokens: int = Field(ge=1)
    max_tokens: int = Field(ge=2)
    generated: tuple[int, ...] = ()
    next_seq: int = Field(ge=0)
    preemptions: int = Field(ge=1)
    cached_prompt_tokens: int = Field(0, ge=0)
    arrived_at: float
    admitted_at: float | None = None
    first_token_at: float | None = None
    requeued_at: float
    sampler_state: str | None = None
    choices: tuple[ResumeChoice, ...] = ()

    @model_validator(mode="after")
    def _tokens_or_choices(self) -> Resume:
        if self.choices:
            if self.generated or self.sampler_state is not None:
                raise ValueError("a request of n choices has its tokens in its choices")
            if [c.index for c in self.choices] != list(range(len(self.choices))):
                raise ValueError("choices holds one entry per choice, in index order")
            if all(c.end is not None for c in self.choices):
                raise ValueError("no choice is left to resume")
        elif not self.generated:
            raise ValueError("generated holds at least one token")
        return self

    @model_serializer(mode="wrap")
    def _without_empty_choices(self, handler: SerializerFunctionWrapHandler,
                               info: SerializationInfo) -> dict[str, Any]:
        data = handler(self)
        if not self.choices:  # one choice: as before n existed
            data.pop("choices", None)
        return data

    def usage(self) -> Usage:
        """What the request is billed for so far (every choice's tokens)."""
        choices = sum(c.end.completion_tokens if c.end is not None else len(c.generated)
                      for c in self.choices)
        return Usage(prompt_tokens=self.prompt_tokens,
                     cached_prompt_tokens=self.cached_prompt_tokens,
                     completion_tokens=len(self.generated) + choices)

    def ended_choices(self, reason: FinishReason,
                      error: ErrorInfo | None = None) -> tuple[ChoiceEnd, ...]:
        """``FinalEvent.choices`` of the request ending here as a whole with ``reason``: a
        choice that had ended keeps its end, the others end with ``reason``; ``()`` for one
        choice."""
        error = error if reason is FinishReason.ERROR else None
        return tuple(c.end if c.end is not None else ChoiceEnd(
            index=c.index, finish_reason=reason, error=error,
            completion_tokens=len(c.generated)) for c in self.choices)


# What separates a base model's name from its adapter's in the API's ``model`` (``base:adapter``).
ADAPTER_SEPARATOR = ":"



class AdapterRef(Message):
    """The LoRA adapter a request runs under (``docs/platform.md``, "LoRA adapters").

    ``name``: as the API calls it, ``{base}:{adapter}``. ``path``: the folder holding its
    ``adapter_config.json`` and ``adapter_model.safetensors``; a worker loads only a folder
    under its ``ADAPTER_ROOT``. ``digest``: the SHA-256 (hex) of the safetensors file as the
    registry validated it; the worker's adapter pool and its prefix cache key the adapter by it,
    so a replaced file is never mistaken for the one before, and a file that no longer has this
    digest fails its requests. ``rank``: its LoRA rank ``r``. ``revision``: its registry
    entry's revision (its id and the time of its check), part of :attr:`key`.
    """

    name: str = Field(min_length=3, max_length=300)
    path: str = Field(min_length=1, max_length=4096)
    digest: str = Field(pattern=r"^[0-9a-f]{64}$")
    rank: int = Field(ge=1)
    revision: str = Field("", max_length=64)

    @property
    def key(self) -> str:
        """:func:`adapter_key` of this adapter."""
        return adapter_key(self.name, self.revision, self.digest)


# What a batch request's fairness key ends with: batch work is charged to a key of its own.
BATCH_KEY_SUFFIX = ":batch"


def batch_fairness_key(key: str) -> str:
    """The fairness key batch work of ``key`` is charged to (``tenant-7`` ->
    ``tenant-7:batch``); a key that already is one is returned as it is."""
    return key if key.endswith(BATCH_KEY_SUFFIX) else key + BATCH_KEY_SUFFIX


class RequestMessage(Message):
    """One generation request, from the web tier to a worker.

    Exactly one of ``messages`` (chat) and ``prompt`` (completion) is set. ``enqueued_at`` is
    unix time (seconds) when the web tier accepted it; ``queue_deadline_s`` bounds the wait from
    then until a worker admits it (0: no deadline). ``meta`` is opaque to the worker and handed
    back in the :class:`UsageReport` (tenant and key ids, the reservations to settle).
    ``resume`` is set by a worker that preempted the request and put it back in the queue.

    Service class (``docs/design.md``, "The batch service class"): ``batch`` False (the
    default) is an interactive request; True a batch request, which sorts after every
    interactive one whatever the tiers, is charged to its own fairness key (``fairness_key``
    with :data:`BATCH_KEY_SUFFIX`, added here if missing), may be preempted in any phase by
    any interactive request, does not count in gate 1 and has no ``queue_deadline_s``:
    ``batch_deadline_at`` (unix seconds, 0: none) is its completion window's end, past
    which it ends with ``batch_expired`` wherever it is.
    """

    request_id: str = Field(min_length=1)
    tenant: str
    fairness_key: str
    priority: int = 0
    fairness_weight: float = Field(1.0, gt=0, allow_inf_nan=False)
    messages: tuple[ChatTurn, ...] | None = None
    # The function tools a chat offers (OpenAI's ``tools`` entries), rendered into its prompt.
    tools: tuple[dict[str, Any], ...] | None = None
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
    batch: bool = False
    batch_deadline_at: float = Field(0.0, ge=0, allow_inf_nan=False)
    # The LoRA adapter the answer is generated under; None: the bare base model.
    adapter: AdapterRef | None = None

    @model_validator(mode="after")
    def _one_prompt(self) -> RequestMessage:
        if (self.messages is None) == (self.prompt is None):
            raise ValueError("give exactly one of messages and prompt")
        return self

    @model_validator(mode="before")
    @classmethod
    def _batch_key(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("batch") and isinstance(
                data.get("fairness_key"), str):
            data = {**data, "fairness_key": batch_fairness_key(data["fairness_key"])}
        return data

    def chat(self) -> list[dict[str, Any]] | None:
        """``messages`` as plain dicts (for a chat template), or None for a completion."""
        if self.messages is None:
            return None
        return [m.as_dict() for m in self.messages]

    def deadline(self) -> float | None:
        """Unix time by which a worker must admit the request, or None (a preempted request:
        counted from its return to the queue); a batch request's is its own
        ``batch_deadline_at`` (by which it must end), never ``queue_deadline_s``."""
        if self.batch:
            return self.batch_deadline_at or None
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
