"""A request of ``n`` > 1 choices: one prefill, a fork into ``n`` decode rows, one end.

Such a request waits, is admitted and is prefilled as one row: one prompt computation, one
prefix-cache lookup. Its reservation is that of all its choices: ``prompt_len + n * max_tokens``
tokens of the active-KV budget (gate 2), and, for gate 3, the blocks of choice 0 plus each other
choice's growth past the prompt's full blocks
(:meth:`~inference.engine.kv_cache.KVCacheManager.blocks_demand`); it takes ``n`` rows of the
batch. When its prompt is done (:meth:`~inference.engine.sched.lifecycle.RowLifecycle.
_promote_to_decode`), :func:`fork` turns it into ``n`` rows: the request itself is choice 0 and
``n - 1`` new rows (ids ``<request_id>#<i>``) share its full prompt blocks (a reference each) and
get a copy of its last, partial prompt block (copy-on-write, :meth:`ModelBackend.copy_block`).
Each row has its own generator, detokenizer, stop-string state, logprobs state, grammar state (a
copy of the one compiled grammar's matcher), token counts and finish reason; each draws its first
token from the same last-position logits. The reservation is split among the rows (choice 0
keeps ``prompt_len + max_tokens``, each other ``max_tokens`` and its blocks), and each row gives
its part back when it ends; the prompt's ``prompt_len`` moves on to a live row when the row that
holds it ends first (:meth:`ChoiceGroup.hand_on_prompt_share`), so it goes with the last.

With a seed, choice ``i`` draws from a generator seeded with :func:`choice_seed`: choice 0 with
the request's seed (as the same request with ``n`` = 1), every choice the same draws each time
the request runs. Without a seed, every choice draws independently.

Every row's token events carry the request's id, the row's ``index`` and the one ``seq`` counter
of the request. A choice ends alone (its stop, its length, its own error: the others go on); the
request has one :class:`~inference.protocol.events.FinalEvent`, after its last choice ended
(:meth:`ChoiceGroup.end`), with one :class:`~inference.protocol.events.ChoiceEnd` per choice.
An abort ends every choice at once. VTC charges every choice's tokens to the request's fairness
key (the prompt once). A forked request is preempted as a whole, every choice at once
(:mod:`inference.engine.sched.choice_resume`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from dataclasses import dataclass, field

from inference.engine.detokenizer import IncrementalDetokenizer
from inference.engine.logprobs import new_logprob_state, take_prompt
from inference.engine.request import (
    SEED_RANGE,
    ErrorCode,
    ErrorInfo,
    FinalEvent,
    FinishReason,
    Request,
    RequestPhase,
    SamplingParams,
    Usage,
)
from inference.engine.sched.outputs import released_end
from inference.engine.sched.state import SchedulerState
from inference.protocol.events import ChoiceEnd, whole_request_choices

log = logging.getLogger(__name__)


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice ``index`` of a request seeded with ``seed``: ``seed`` itself for
    choice 0, else a number derived from both (SHA-256), within
    :data:`~inference.engine.request.SEED_RANGE`; the same for the same pair on every engine."""
    if index == 0:
        return seed
    digest = hashlib.sha256(f"choice:{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % SEED_RANGE[1]


def choice_row_id(request_id: str, index: int) -> str:
    """The row id of choice ``index`` of request ``request_id``: the request's own for choice
    0, ``<request_id>#<index>`` for the others."""
    return request_id if index == 0 else f"{request_id}#{index}"


@dataclass(eq=False)
class ChoiceGroup:
    """The rows of one forked request, how each choice ended, and what the request shares.

    Attributes:
        request_id: the request's id (its events').
        sampling: the request's settings as submitted (``n`` choices, ``max_tokens`` each).
        prompt_len, cached_prompt_tokens: its original prompt and that prompt's prefix hits at
            its first admission (its usage).
        arrival_time, admitted_time, first_token_time: on the scheduler's clock (its timings).
        queue_wait_s: its admission allowance (None: no deadline), for a preemption.
        preemptions: times the request has been preempted.
        event_seq: the ``seq`` of its next event (one counter for every choice).
        rows: the row of each choice that has one, by index (a choice that had ended before a
            preemption has none after it).
        ends: the :class:`ChoiceEnd` of each choice that ended, by index.
        prompt_row: the row that computed the prompt (its prompt logprobs, if asked).
        aborted: the request as a whole was aborted (its final event says ``abort``).
    """

    request_id: str
    sampling: SamplingParams
    prompt_len: int
    cached_prompt_tokens: int
    arrival_time: float
    admitted_time: float | None
    first_token_time: float | None = None
    queue_wait_s: float | None = None
    preemptions: int = 0
    event_seq: int = 0
    rows: dict[int, Request] = field(default_factory=dict)
    ends: dict[int, ChoiceEnd] = field(default_factory=dict)
    prompt_row: Request | None = None
    aborted: bool = False

    @classmethod
    def of(cls, request: Request, sampling: SamplingParams) -> ChoiceGroup:
        """The group of ``request`` (prompt all computed), submitted with ``sampling``."""
        resume = request.resume
        return cls(request.request_id, sampling,
                   resume.prompt_len if resume is not None else request.prompt_len,
                   (resume.cached_prompt_tokens if resume is not None
                    else request.num_cached_tokens),
                   request.arrival_time, request.admitted_time, request.first_token_time,
                   request.queue_wait_s, request.preemptions, request.event_seq,
                   prompt_row=request)

    @property
    def n(self) -> int:
        return self.sampling.n

    def next_seq(self) -> int:
        """The ``seq`` of the request's next event (any choice's)."""
        seq = self.event_seq
        self.event_seq += 1
        return seq

    def live_rows(self) -> list[Request]:
        """The rows not ended yet, in index order."""
        return [self.rows[i] for i in sorted(self.rows)
                if self.rows[i].phase is not RequestPhase.FINISHED]

    def hand_on_prompt_share(self, row: Request) -> None:
        """Before ``row`` (ended, still holding its reservation) releases it: the part beyond
        its own growth (the prompt's ``prompt_len`` tokens, which the other choices' shared
        blocks still hold) moves to another live row, so the request's rows always reserve
        ``prompt_len + live rows * max_tokens`` and the prompt's part goes with the last."""
        own = row.prompt_len + row.max_tokens - self.prompt_len
        surplus = row.reserved_kv_tokens - own
        others = [r for r in self.live_rows() if r is not row]
        if surplus > 0 and others:
            others[0].reserved_kv_tokens += surplus
            row.reserved_kv_tokens -= surplus

    def end(self, row: Request, reason: FinishReason, error: ErrorInfo | None,
            now: float) -> FinalEvent | None:
        """Record the end of ``row`` (already out of its queue, its KV freed).

        ``now``: the scheduler's clock (monotonic seconds). Returns the request's final event
        when this was its last live choice, else None. Sets the row's ``finish_reason`` and
        ``error`` (releasing its held text may turn a normal end into an error).
        """
        if reason is FinishReason.ABORT:
            self.aborted = True
        text, logprobs, reason, error = released_end(row, reason, error)
        row.finish_reason, row.error = reason, error
        if row.first_token_time is not None:
            self.first_token_time = min(self.first_token_time or row.first_token_time,
                                        row.first_token_time)
        self.ends[row.choice_index] = ChoiceEnd(
            index=row.choice_index, finish_reason=reason, text=text, logprobs=logprobs,
            completion_tokens=row.usage().completion_tokens, error=error)
        if len(self.ends) < self.n:
            return None
        return self._final(now)

    def _final(self, now: float) -> FinalEvent:
        choices = tuple(self.ends[i] for i in range(self.n))
        if self.aborted:
            reason, error = FinishReason.ABORT, None
        else:
            reason, error = choices[0].finish_reason, choices[0].error
        usage = Usage(prompt_tokens=self.prompt_len,
                      cached_prompt_tokens=min(self.cached_prompt_tokens, self.prompt_len),
                      completion_tokens=sum(c.completion_tokens for c in choices))
        timings = {"queue_s": (self.admitted_time or now) - self.arrival_time,
                   "e2e_s": now - self.arrival_time}
        if self.first_token_time is not None:
            timings["ttft_s"] = self.first_token_time - self.arrival_time
        prompt = take_prompt(self.prompt_row) if self.prompt_row is not None else None
        return FinalEvent(request_id=self.request_id, seq=self.next_seq(),
                          finish_reason=reason, usage=usage, error=error, timings=timings,
                          prompt_logprobs=prompt, choices=choices)


def unforked_choices(request: Request, event: FinalEvent) -> FinalEvent:
    """The final event of a request of ``n`` > 1 choices that ended before its fork (refused,
    timed out, aborted or failed while pending or prefilling): every choice ends as it (a
    choice that had ended before a preemption keeps its end)."""
    resume = request.resume
    if resume is not None and resume.choices:  # resumed after a preemption: ends kept
        error = event.error if event.finish_reason is FinishReason.ERROR else None
        ends = tuple(c.end if c.end is not None else ChoiceEnd(
            index=c.index, finish_reason=event.finish_reason, error=error,
            completion_tokens=len(c.generated)) for c in resume.choices)
        return event.model_copy(update={"choices": ends})
    if request.sampling.n == 1:
        return event
    return event.model_copy(update={"choices": whole_request_choices(
        request.sampling.n, event.finish_reason, event.error)})


def fork(state: SchedulerState, request: Request
         ) -> tuple[list[Request], list[tuple[Request, ErrorInfo]]]:
    """Fork a request of ``n`` > 1 choices whose prompt is all computed into its ``n`` rows
    (module docstring).

    Returns:
        The rows in index order, ``request`` first, all in ``active``; and the rows whose copy
        of the partial prompt block failed, each with its error (it ends at once, alone).

    Raises:
        RuntimeError: its reservation does not cover the rows (a scheduler bug).
    """
    params = request.sampling
    n = params.n
    one = dataclasses.replace(params, n=1)
    group = ChoiceGroup.of(request, params)
    group.rows[0] = request
    request.sampling = one
    request.group = group
    total_kv = request.reserved_kv_tokens
    failed: list[tuple[Request, ErrorInfo]] = []
    for index in range(1, n):
        seed = None if params.seed is None else choice_seed(params.seed, index)
        child = Request(
            request_id=choice_row_id(request.request_id, index),
            prompt_token_ids=request.prompt_token_ids,
            sampling=dataclasses.replace(one, seed=seed, prompt_logprobs=None),
            tenant=request.tenant, fairness_key=request.fairness_key,
            priority=request.priority, fairness_weight=request.fairness_weight,
            arrival_seq=request.arrival_seq, arrival_time=request.arrival_time,
            phase=RequestPhase.ACTIVE, admitted_time=request.admitted_time,
            admit_seq=request.admit_seq, group=group, choice_index=index,
            batch=request.batch, expires_at=request.expires_at, adapter=request.adapter)
        child.detokenizer = IncrementalDetokenizer(state.tokenizer, one.stop)
        child.logprobs = new_logprob_state(child, state.tokenizer)
        if request.grammar is not None:
            child.grammar = request.grammar.fork()
        error = copy_prompt_kv(state, request, child)
        if error is not None:
            failed.append((child, error))
        child.reserved_kv_tokens = one.max_tokens
        request.reserved_kv_tokens -= one.max_tokens
        state.add_row(child)
        group.rows[index] = child
        state.active.append(child)
    assert sum(r.reserved_kv_tokens for r in group.rows.values()) == total_kv
    state.groups[request.request_id] = group
    state.forked_requests += 1
    state.forked_choices += n
    return list(group.rows.values()), failed


def copy_prompt_kv(state: SchedulerState, parent: Request, child: Request) -> ErrorInfo | None:
    """Give ``child`` the prompt KV of ``parent`` (:meth:`KVCacheManager.fork`: shared full
    blocks, a copy of the partial one); the error that ends the child alone if the backend's
    copy failed (its blocks are its own, freed when it ends)."""
    copy = state.kv.fork(parent, child)
    if copy is None:
        return None
    try:
        state.backend.copy_block(*copy)
    except Exception:
        log.exception("copying KV block %d to %d for %s failed", *copy, child.request_id)
        return ErrorInfo(code=ErrorCode.ENGINE_ERROR, retryable=True,
                         message="copying the prompt's KV for this choice failed; only this "
                                 "choice was ended", details={"phase": "fork"})
    return None
