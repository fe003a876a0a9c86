"""Request state inside the engine, and the decoding settings of a request.

The events a request emits and its errors are the messages of :mod:`inference.protocol`
(re-exported here): the engine emits exactly what the web tier reads. A :class:`Request` knows
its prompt, its output so far, its KV block table and how many of its tokens are computed or
came from the prefix cache. The scheduler only moves requests between queues; the request itself
carries the state.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from inference.protocol.events import (
    MAX_LOGPROBS,
    ChoiceEnd,
    ErrorCode,
    ErrorInfo,
    Event,
    FinalEvent,
    FinishReason,
    TokenEvent,
    Usage,
)
from inference.protocol.models import adapter_key
from inference.protocol.structured import StructuredOutput

__all__ = ["BATCH_TIER", "SAMPLING_EPS", "SEED_RANGE", "ChoiceState", "ErrorCode", "ErrorInfo",
           "Event", "FinalEvent", "FinishReason", "Request", "RequestPhase", "ResumeState",
           "SamplingParams", "TokenEvent", "Usage"]

# A temperature below this is greedy decoding: vLLM's rule (``_SAMPLING_EPS = 1e-5`` in
# ``vllm/sampling_params.py``, where ``temperature < _SAMPLING_EPS`` selects greedy sampling).
# Dividing logits by a smaller temperature overflows float32 and leaves nothing to sample from.
SAMPLING_EPS = 1e-5
# Seeds ``torch.Generator.manual_seed`` accepts (the REST API's bounds too).
SEED_RANGE = (-(2**63), 2**64 - 1)


class RequestPhase(StrEnum):
    """Which queue a live request is in (or ``finished``)."""

    PENDING = "pending"
    PREFILLING = "prefilling"
    ACTIVE = "active"
    FINISHED = "finished"


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings.

    Attributes:
        max_tokens: generated tokens at most (>= 1).
        temperature: 0 (or anything below :data:`SAMPLING_EPS`) means greedy; any finite value
            above it samples (a huge one tends to the uniform choice among allowed tokens).
        top_p: nucleus mass in (0, 1]; the most likely token always stays.
        top_k: keep the k best logits; 0 or less, or at least the vocabulary, disables it.
        seed: seeds this request's own generator, so its samples do not depend on its batch;
            within :data:`SEED_RANGE`.
        stop: strings that end the answer; they are never streamed, not even in part.
        min_tokens: EOS and stop strings are ignored before this many tokens.
        ignore_eos: never stop at EOS (fixed-length benchmarks).
        logprobs: report each generated token's log-probability with this many likeliest
            tokens, 0 to :data:`~inference.protocol.events.MAX_LOGPROBS` (None: none).
        prompt_logprobs: the same for every prompt token (None: none).
        structured: the grammar every answer must match (None: unconstrained): a JSON schema,
            any JSON object, a regex, a choice of strings or a Lark/GBNF grammar
            (:mod:`inference.engine.structured`).
        n: independent choices sharing the prompt (>= 1): the prompt is prefilled once, then
            forked into ``n`` decode rows (:mod:`inference.engine.sched.choices`).

    Raises:
        ValueError: for a value out of range, naming the field.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured: StructuredOutput | None = None
    n: int = 1

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise ValueError(f"seed must be in [{SEED_RANGE[0]}, {SEED_RANGE[1]}], got {self.seed}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(s for s in self.stop if s))

    @property
    def greedy(self) -> bool:
        """Whether the next token is the argmax: a temperature below :data:`SAMPLING_EPS`."""
        return self.temperature < SAMPLING_EPS


_arrival_counter = itertools.count()
# Where a tier is asked of a batch row (a worker's preemptible rows): below every priority tier,
# so a request of any tier may take its row (docs/design.md, "The batch service class").
BATCH_TIER = -(2**31)


@dataclass
class ChoiceState:
    """Where one choice of a preempted request of ``n`` > 1 choices stopped.

    Attributes:
        index: the choice (0 to n - 1).
        generated: the tokens it generated so far (streamed already; empty once it ended).
        end: how it ended, if it had (its entry of the final event, kept as it was).
        sampler_state: its random generator's state (``torch.Generator.get_state``), if any.
        generator, detokenizer, grammar: its live objects, handed on only within one engine.
    """

    index: int
    generated: tuple[int, ...] = ()
    end: ChoiceEnd | None = None
    sampler_state: bytes | None = None
    generator: Any = None
    detokenizer: Any = None
    grammar: Any = None

    @property
    def completion_tokens(self) -> int:
        """The tokens this choice was billed for so far."""
        return self.end.completion_tokens if self.end is not None else len(self.generated)


@dataclass
class ResumeState:
    """Where a preempted request stopped: what continuing it needs, on this engine or another.

    The request continues with ``prompt + generated`` as its prompt (recomputed, mostly from the
    prefix cache) and the rest of its budget; its events continue at ``next_seq``. Times are
    unix seconds, so the state can travel to another worker.

    Attributes:
        prompt_len: tokens of the original prompt.
        sampling: the original settings (``max_tokens`` as first resolved).
        generated: every token generated so far (at least one), streamed already.
        next_seq: the ``seq`` of the request's next event.
        preemptions: times the request has been preempted, this one included.
        cached_prompt_tokens: prefix-cache hits of its first admission (its usage reports them).
        arrived_at, admitted_at, first_token_at: when it reached the first engine, was first
            admitted, and streamed its first token.
        queue_wait_s: its admission allowance (None: no deadline); it counts again from its
            return to a queue.
        sampler_state: its random generator's state (``torch.Generator.get_state``), if any.
        generator, detokenizer, grammar: the live objects, handed on only within one engine
            (another engine replays ``generated`` into new ones).
        choices: for a request of ``n`` > 1 choices (``sampling.n``), one :class:`ChoiceState`
            per choice in index order (``generated`` is then empty and ``sampler_state`` and
            the live objects are the choices' own); empty for one choice.
    """

    request_id: str
    prompt_len: int
    sampling: SamplingParams
    generated: tuple[int, ...]
    next_seq: int
    preemptions: int
    cached_prompt_tokens: int
    arrived_at: float
    admitted_at: float | None = None
    first_token_at: float | None = None
    queue_wait_s: float | None = None
    sampler_state: bytes | None = None
    generator: Any = None
    detokenizer: Any = None
    grammar: Any = None
    choices: tuple[ChoiceState, ...] = ()

    @property
    def completion_tokens(self) -> int:
        """The tokens the request was billed for so far (every choice's)."""
        return len(self.generated) + sum(c.completion_tokens for c in self.choices)


@dataclass(frozen=True)
class AdapterSpec:
    """The adapter a request runs under: ``name`` (``base:adapter``, for errors and stats),
    ``path`` (its folder), ``digest`` (SHA-256 of its safetensors file, hex: its files are
    checked against it), ``rank`` and ``revision`` (its registry entry's); :attr:`key`
    identifies it (the pool and the prefix cache key it by)."""

    name: str
    path: str
    digest: str
    rank: int
    revision: str = ""

    @property
    def key(self) -> str:
        """:func:`inference.protocol.messages.adapter_key` of this adapter."""
        return adapter_key(self.name, self.revision, self.digest)


@dataclass(eq=False)
class Request:
    """A request inside the engine and its mutable serving state.

    Attributes:
        prompt_token_ids: the prompt, ``[prompt_len]`` token ids.
        output_token_ids: generated tokens so far.
        block_table: physical KV block ids, one per ``block_size`` tokens of prompt + output.
        num_computed_tokens: tokens whose KV is in the pool (prefix hits included).
        num_cached_tokens: prompt tokens that were prefix-cache hits at admission.
        reserved_blocks: blocks promised to this row that it has not allocated yet (gate 3).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    tenant: str = "default"
    fairness_key: str = ""
    priority: int = 0
    fairness_weight: float = 1.0
    arrival_seq: int = field(default_factory=lambda: next(_arrival_counter))
    arrival_time: float = field(default_factory=time.monotonic)

    phase: RequestPhase = RequestPhase.PENDING
    output_token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    reserved_blocks: int = 0
    reserved_kv_tokens: int = 0
    event_seq: int = 0
    abort_requested: bool = False
    finish_reason: FinishReason | None = None
    error: ErrorInfo | None = None
    first_token_time: float | None = None
    admitted_time: float | None = None
    # Monotonic time by which the request must leave ``_pending`` (None: no deadline).
    queue_deadline: float | None = None
    detokenizer: Any = None
    sampler_state: Any = None
    # ``inference.engine.logprobs.LogprobState`` of a request that asked for logprobs, else None.
    logprobs: Any = None
    # Admission order (the most recently admitted lower-tier row is preempted first).
    admit_seq: int = 0
    # Times this request has been preempted (at most ``MAX_PREEMPTIONS``).
    preemptions: int = 0
    # ``inference.engine.structured.RowGrammar`` of a constrained request (its grammar's state
    # after its output so far), else None; ``grammar_error``: why it could not be compiled.
    grammar: Any = None
    grammar_error: ErrorInfo | None = None
    # Set when the request continues after a preemption: ``prompt_token_ids`` is then the
    # original prompt followed by ``resume.generated``, and ``sampling`` counts what is left.
    resume: ResumeState | None = None
    # A request with ``sampling.n`` > 1 once forked into its choices: every row of it (choice
    # 0 is the request itself) holds the same ``inference.engine.sched.choices.ChoiceGroup``,
    # and ``choice_index`` is the row's choice.
    group: Any = None
    choice_index: int = 0
    # The batch service class (docs/design.md, "The batch service class"): it sorts after every
    # interactive request, may be preempted in any phase, and ``expires_at`` (monotonic; None:
    # never) ends it with ``batch_expired`` in any phase. ``recomputed_prefix``: prompt tokens
    # computed (and charged) before a preemption while it prefilled: charged to nobody again;
    # ``first_cached_tokens``: then the prefix hits of its first admission (its usage's).
    batch: bool = False
    expires_at: float | None = None
    recomputed_prefix: int = 0
    first_cached_tokens: int = 0
    # The LoRA adapter it runs under (None: the bare base model); docs/engine.md, "LoRA
    # adapters". ``parked``: it waits out of the order for its adapter to load.
    adapter: AdapterSpec | None = None
    parked: bool = False

    def __post_init__(self) -> None:
        if not self.fairness_key:
            self.fairness_key = self.tenant

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def queue_wait_s(self) -> float | None:
        """Its admission allowance (seconds; None: no deadline), as it counts again from a
        return to a queue after a preemption."""
        if self.resume is not None:
            return self.resume.queue_wait_s
        if self.queue_deadline is not None:
            return self.queue_deadline - self.arrival_time
        return None

    @property
    def max_tokens(self) -> int:
        return self.sampling.max_tokens

    @property
    def kv_demand(self) -> int:
        """Tokens this row reserves against the active-KV budget: ``prompt_len + max_tokens``,
        and ``prompt_len + n * max_tokens`` for a request of ``n`` choices (the prompt once,
        each choice's whole growth)."""
        return self.prompt_len + self.sampling.n * self.sampling.max_tokens

    @property
    def num_rows(self) -> int:
        """Rows of the batch this request takes once decoding: ``sampling.n``."""
        return self.sampling.n

    @property
    def event_id(self) -> str:
        """The request id its events carry: the forked request's own for each of its rows."""
        return self.group.request_id if self.group is not None else self.request_id

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def prefill_done(self) -> bool:
        return self.num_computed_tokens >= self.prompt_len

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether prompt logprobs are still owed: each prompt chunk then asks its every
        position's logits, and the prompt gets no prefix-cache hit."""
        return self.logprobs is not None and self.logprobs.prompt_pending

    def next_event_seq(self) -> int:
        """The ``seq`` of this request's next event; the choices of a forked request count on
        one counter (their group's)."""
        if self.group is not None:
            return self.group.next_seq()
        seq = self.event_seq
        self.event_seq += 1
        return seq

    def debug_row(self) -> dict[str, Any]:
        """This row's sizes, reservations and blocks (the scheduler's debug snapshot)."""
        return {"request_id": self.request_id, "prompt_len": self.prompt_len,
                "max_tokens": self.max_tokens, "reserved_kv_tokens": self.reserved_kv_tokens,
                "blocks": list(self.block_table), "reserved_blocks": self.reserved_blocks,
                "num_computed_tokens": self.num_computed_tokens,
                "output_tokens": len(self.output_token_ids), "preemptions": self.preemptions,
                "priority": self.priority, "stopped": self.finish_reason is not None,
                "n": self.sampling.n, "event_id": self.event_id, "batch": self.batch,
                "choice_index": self.choice_index}

    def usage(self) -> Usage:
        """Token counts as the client is billed: each token once, however often the request
        was preempted (a recomputed prompt is neither prompt nor cached tokens again). A request
        stopped before its prompt was all computed (aborted while pending or prefilling) counts
        the prompt tokens computed or found in the prefix cache so far."""
        resume = self.resume
        if resume is None:
            computed = (self.prompt_len if self.output_token_ids
                        else min(self.prompt_len, self.num_computed_tokens))
            return Usage(prompt_tokens=computed,
                         cached_prompt_tokens=min(self.num_cached_tokens, computed),
                         completion_tokens=len(self.output_token_ids))
        return Usage(prompt_tokens=resume.prompt_len,
                     cached_prompt_tokens=resume.cached_prompt_tokens,
                     completion_tokens=resume.completion_tokens + len(self.output_token_ids))
