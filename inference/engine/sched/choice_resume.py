"""Preemption of a request of ``n`` > 1 choices, as a whole, and its resumption.

A forked request (:mod:`inference.engine.sched.choices`) is preempted with every live choice at
once, never one choice alone: all its rows leave the batch together, each releasing its part of
the reservation and its blocks (the shared full prompt blocks become evictable cached blocks
once the last reference drops). Its :class:`~inference.engine.request.ResumeState` carries what
the request shares (its original prompt's length and settings, the next ``seq`` of its one
counter, its timings and usage) and one :class:`~inference.engine.request.ChoiceState` per
choice: the tokens it generated, its random generator, its detokenizer and grammar state (the
live objects within one engine; another engine replays the tokens into new ones), or its
:class:`~inference.protocol.events.ChoiceEnd` when it had ended.

Resumed, it is again one request (:func:`resumed_group_request`): its prompt is the original
prompt, prefilled once (mostly prefix-cache hits, charged to nobody), and it reserves
``prompt_len + n_live * max_tokens`` for its ``n_live`` unfinished choices. When that prompt is
done, :func:`fork_resumed` gives each unfinished choice its row again: the first takes over the
prompt's row and blocks, the others share its full blocks and copy its partial one (as a fresh
fork does); each row's prompt is then the original prompt followed by its own generated tokens,
which it recomputes as a prefill (charged to nobody) before it samples its next token with its
own generator. The finished choices keep their ends; the request's final event comes when the
last choice ends.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

from inference.engine.logprobs import new_logprob_state
from inference.engine.request import (
    ChoiceState,
    ErrorInfo,
    Request,
    RequestPhase,
    ResumeState,
    SamplingParams,
)
from inference.engine.sched.choices import (
    ChoiceGroup,
    choice_row_id,
    choice_seed,
    copy_prompt_kv,
)
from inference.engine.sched.preemption import preempted_state, restore_times, resumed_request
from inference.engine.sched.state import SchedulerState


def choice_sampling(sampling: SamplingParams, index: int) -> SamplingParams:
    """The settings of choice ``index`` of a request submitted with ``sampling``: one choice,
    its own seed (:func:`~inference.engine.sched.choices.choice_seed`), no prompt logprobs
    (the request's own go out once)."""
    seed = None if sampling.seed is None else choice_seed(sampling.seed, index)
    return dataclasses.replace(sampling, n=1, seed=seed,
                               prompt_logprobs=sampling.prompt_logprobs if index == 0 else None)


def preempted_group_state(group: ChoiceGroup, clock: Callable[[], float]) -> ResumeState:
    """Where the forked request of ``group`` stops, every live row a decode row (unix
    seconds; ``clock``: the scheduler's)."""
    offset = time.time() - clock()

    def unix(t: float | None) -> float | None:
        return None if t is None else t + offset

    choices = []
    first_tokens = [group.first_token_time] if group.first_token_time is not None else []
    for index in range(group.n):
        end = group.ends.get(index)
        if end is not None:
            choices.append(ChoiceState(index, end=end))
            continue
        row = group.rows[index]
        if row.first_token_time is not None:
            first_tokens.append(row.first_token_time)
        one = preempted_state(row, clock)
        choices.append(ChoiceState(index, generated=one.generated, generator=one.generator,
                                   detokenizer=one.detokenizer, grammar=one.grammar))
    return ResumeState(
        request_id=group.request_id, prompt_len=group.prompt_len, sampling=group.sampling,
        generated=(), next_seq=group.event_seq, preemptions=group.preemptions + 1,
        cached_prompt_tokens=group.cached_prompt_tokens,
        arrived_at=unix(group.arrival_time) or 0.0, admitted_at=unix(group.admitted_time),
        first_token_at=unix(min(first_tokens)) if first_tokens else None,
        queue_wait_s=group.queue_wait_s, choices=tuple(choices))


def resumed_group_request(state: ResumeState, prompt_token_ids: Sequence[int], *, tenant: str,
                          fairness_key: str, priority: int, fairness_weight: float,
                          clock: Callable[[], float],
                          arrival_seq: int | None = None) -> Request:
    """The request that continues the forked request of ``state`` (``state.choices`` set): its
    prompt is ``prompt_token_ids`` (the original prompt), its ``n`` its unfinished choices.

    Raises:
        ValueError: ``prompt_token_ids`` is not the prompt the state was generated from, no
            choice is left, or a choice's tokens leave it nothing to generate.
    """
    if len(prompt_token_ids) != state.prompt_len:
        raise ValueError(f"the prompt has {len(prompt_token_ids)} tokens; the preempted "
                         f"request's had {state.prompt_len}")
    live = [c for c in state.choices if c.end is None]
    if [c.index for c in state.choices] != list(range(state.sampling.n)) or not live:
        raise ValueError("the choices of the state are not those of the request")
    for choice in live:
        if not 0 < len(choice.generated) < state.sampling.max_tokens:
            raise ValueError(f"choice {choice.index}: {len(choice.generated)} tokens generated "
                             f"of max_tokens {state.sampling.max_tokens}: nothing to resume")
    sampling = dataclasses.replace(state.sampling, n=len(live), prompt_logprobs=None)
    extra = {} if arrival_seq is None else {"arrival_seq": arrival_seq}
    request = Request(request_id=state.request_id, prompt_token_ids=list(prompt_token_ids),
                      sampling=sampling, tenant=tenant, fairness_key=fairness_key,
                      priority=priority, fairness_weight=fairness_weight, **extra)
    restore_times(request, state, clock)
    request.event_seq = state.next_seq
    request.preemptions = state.preemptions
    request.resume = state  # its choices' live objects go to their rows at the fork
    return request


def fork_resumed(state: SchedulerState, parent: Request) -> tuple[list[Request],
                                                                  list[tuple[Request, ErrorInfo]]]:
    """Give each unfinished choice of a resumed forked request (its original prompt all
    computed, out of ``prefilling``) its row again (module docstring), each in ``prefilling``
    with its generated tokens left to recompute.

    Returns:
        The rows in index order, and the rows whose grammar did not take their generated
        tokens again or whose copy of the partial prompt block failed (each with its error:
        it ends at once).
    """
    resume = parent.resume
    assert resume is not None and resume.choices
    group = ChoiceGroup.of(parent, resume.sampling)
    group.prompt_row = None  # its prompt logprobs went out with its first event
    group.ends = {c.index: c.end for c in resume.choices if c.end is not None}
    max_tokens = resume.sampling.max_tokens
    rows: list[Request] = []
    failed: list[tuple[Request, ErrorInfo]] = []
    prompt = parent.prompt_token_ids
    for choice in (c for c in resume.choices if c.end is None):
        one = dataclasses.replace(
            resume, sampling=choice_sampling(resume.sampling, choice.index),
            generated=choice.generated, sampler_state=choice.sampler_state,
            generator=choice.generator, detokenizer=choice.detokenizer, grammar=choice.grammar,
            choices=())
        row = resumed_request(one, prompt, tenant=parent.tenant,
                              fairness_key=parent.fairness_key, priority=parent.priority,
                              fairness_weight=parent.fairness_weight,
                              tokenizer=state.tokenizer, eos_token_ids=state.eos_token_ids,
                              clock=state.clock, arrival_seq=parent.arrival_seq)
        row.request_id = choice_row_id(parent.request_id, choice.index)
        row.group, row.choice_index = group, choice.index
        row.adapter = parent.adapter
        row.admit_seq, row.admitted_time = parent.admit_seq, parent.admitted_time
        row.queue_deadline = None
        row.batch, row.expires_at = parent.batch, parent.expires_at
        row.logprobs = new_logprob_state(row, state.tokenizer)
        if row.grammar is None and parent.grammar is not None:  # another engine's: replayed
            row.grammar = parent.grammar.fork()
            for token in choice.generated:
                error = row.grammar.consume(token)
                if error is not None:
                    failed.append((row, error))
                    break
        if rows:
            error = copy_prompt_kv(state, parent, row)
            if error is not None:
                failed.append((row, error))
            row.reserved_kv_tokens = max_tokens
            parent.reserved_kv_tokens -= max_tokens
            state.add_row(row)
        rows.append(row)
    first = rows[0]  # takes over the prompt's row, its blocks and the rest of its reservation
    first.block_table, parent.block_table = parent.block_table, []
    first.block_hashes = parent.block_hashes
    first.reserved_blocks, parent.reserved_blocks = parent.reserved_blocks, 0
    first.num_computed_tokens = parent.num_computed_tokens
    first.num_cached_tokens = parent.num_cached_tokens
    first.reserved_kv_tokens, parent.reserved_kv_tokens = parent.reserved_kv_tokens, 0
    if first.request_id != parent.request_id:  # choice 0 had ended: another row id
        state.backend.remove_row(parent.request_id)
        state.add_row(first)
    parent.phase = RequestPhase.FINISHED
    for row in rows:
        row.phase = RequestPhase.PREFILLING
        group.rows[row.choice_index] = row
        state.prefilling.append(row)
    state.groups[group.request_id] = group
    return rows, failed
