"""Priority preemption by recompute (``docs/design.md``, "Preemption across priority
tiers").

When the head of ``_pending`` finds no free row or no active-KV budget (gate 2) and decode rows
of a lower priority tier are running, the scheduler may preempt some of them for it: the lowest
tier first, within it the most recently admitted first, only rows preempted fewer than
``MAX_PREEMPTIONS`` times, and only as many as let the head in (a free row, gate 2 and gate 3 are
all checked on the rows' release before anything is preempted; if no choice lets it in, nothing
is preempted and the head waits as before). Within one tier nothing is preempted: a request that
fits waits for room (soft-hold). A preempted row:

- releases its row, its reservation (``active_kv_reserved`` drops by its ``prompt_len +
  max_tokens``) and its KV blocks: the full ones, registered in the prefix cache as they filled,
  become evictable cached blocks, so its recomputation is mostly prefix hits;
- keeps what it generated: those tokens follow its prompt when it is admitted again, its
  ``max_tokens`` still counts them, its events continue at the next ``seq``, its text where its
  detokenizer stopped (so no text is lost or repeated, stop strings and characters split across
  tokens included), a seeded request's random generator where it was, and its timings (TTFT) and
  usage are those of its first run: each token is billed once;
- goes back to ``_pending`` at its fair place (its arrival is kept), or, in a worker, leaves the
  engine (``Scheduler.hand_out_preempted``) to go back to the shared queue, where any worker may
  take it: :class:`~inference.engine.request.ResumeState` is everything another engine needs.

VTC: the recomputed prompt (the original prompt and the tokens generated before) is charged to
nobody, as the key did not ask for the work (the engine counts it in
``preempted_tokens_recomputed``); the tokens the request then generates are charged as usual.

The choice of rows and the preemption itself are part of admission
(:mod:`inference.engine.sched.admission`); this module turns a preempted row into its
:class:`~inference.engine.request.ResumeState` and a state back into a request.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch

from inference.engine.backends.base import Tokenizer
from inference.engine.detokenizer import IncrementalDetokenizer
from inference.engine.request import Request, ResumeState


def generator_state(generator: torch.Generator | None) -> bytes | None:
    """A random generator's state as bytes (``torch.Generator.get_state``), or None."""
    return None if generator is None else bytes(generator.get_state().tolist())


def generator_from(state: bytes | None) -> torch.Generator | None:
    """A CPU generator set to ``state`` (from :func:`generator_state`), or None."""
    if state is None:
        return None
    generator = torch.Generator(device="cpu")
    generator.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
    return generator


def preempted_state(request: Request, clock: Callable[[], float]) -> ResumeState:
    """Where ``request`` (a decode row, maybe resumed before) stops, in unix seconds.

    ``clock`` is the scheduler's clock (the one of ``request``'s times).
    """
    resume = request.resume
    prompt_len = resume.prompt_len if resume is not None else request.prompt_len
    offset = time.time() - clock()

    def unix(t: float | None) -> float | None:
        return None if t is None else t + offset

    return ResumeState(
        request_id=request.request_id, prompt_len=prompt_len,
        sampling=resume.sampling if resume is not None else request.sampling,
        generated=(*request.prompt_token_ids[prompt_len:], *request.output_token_ids),
        next_seq=request.event_seq, preemptions=request.preemptions + 1,
        cached_prompt_tokens=(resume.cached_prompt_tokens if resume is not None
                              else request.num_cached_tokens),
        arrived_at=unix(request.arrival_time) or 0.0, admitted_at=unix(request.admitted_time),
        first_token_at=unix(request.first_token_time), queue_wait_s=request.queue_wait_s,
        generator=request.sampler_state, detokenizer=request.detokenizer,
        grammar=request.grammar)


def restarted(request: Request) -> Request:
    """A batch row preempted while it prefilled, before it generated anything
    (``docs/design.md``, "The batch service class"), as the request that starts it again: the
    same id, prompt, settings, arrival (so its place), deadline, generator and grammar; the
    prompt tokens it computed are charged to nobody again (``recomputed_prefix``) and its usage
    keeps its first admission's prefix hits."""
    fresh = Request(request_id=request.request_id,
                    prompt_token_ids=list(request.prompt_token_ids), sampling=request.sampling,
                    tenant=request.tenant, fairness_key=request.fairness_key,
                    priority=request.priority, fairness_weight=request.fairness_weight,
                    arrival_seq=request.arrival_seq, arrival_time=request.arrival_time)
    fresh.queue_deadline, fresh.admitted_time = request.queue_deadline, request.admitted_time
    fresh.batch, fresh.expires_at = request.batch, request.expires_at
    fresh.adapter = request.adapter
    fresh.preemptions, fresh.event_seq = request.preemptions + 1, request.event_seq
    fresh.recomputed_prefix = max(request.recomputed_prefix, request.num_computed_tokens)
    fresh.first_cached_tokens = (request.first_cached_tokens if request.recomputed_prefix
                                 else request.num_cached_tokens)
    fresh.sampler_state, fresh.grammar = request.sampler_state, request.grammar
    return fresh


def for_another_engine(state: ResumeState) -> ResumeState:
    """``state`` without its live objects (the generator's state as bytes instead), its
    choices' too: what a preempted request takes to another engine, which replays its tokens
    into new ones."""
    choices = tuple(dataclasses.replace(
        c, sampler_state=(generator_state(c.generator) if c.generator is not None
                          else c.sampler_state),
        generator=None, detokenizer=None, grammar=None) for c in state.choices)
    return dataclasses.replace(state, sampler_state=generator_state(state.generator),
                               generator=None, detokenizer=None, grammar=None, choices=choices)


def replay_detokenizer(tokenizer: Tokenizer, state: ResumeState,
                       eos_token_ids: Collection[int]) -> IncrementalDetokenizer:
    """A detokenizer in the state the request's own was in when it stopped: fed the generated
    tokens as :func:`inference.engine.sched.outputs.append_token` fed them (EOS tokens, streamed as
    empty text, are not decoded; stop strings are looked for after ``min_tokens``)."""
    detokenizer = IncrementalDetokenizer(tokenizer, state.sampling.stop)
    for n, token in enumerate(state.generated, start=1):
        if token not in eos_token_ids:
            detokenizer.add_token(token, check_stop=n > state.sampling.min_tokens)
    return detokenizer


def restore_times(request: Request, state: ResumeState, clock: Callable[[], float]) -> None:
    """Set ``request``'s arrival, admission and first-token times (on ``clock``) from
    ``state``'s unix ones; its admission deadline (if any) counts again from now."""
    now = clock()
    offset = now - time.time()
    request.arrival_time = state.arrived_at + offset
    if state.admitted_at is not None:
        request.admitted_time = state.admitted_at + offset
    if state.first_token_at is not None:
        request.first_token_time = state.first_token_at + offset
    if state.queue_wait_s is not None:
        request.queue_deadline = now + state.queue_wait_s


def resumed_request(state: ResumeState, prompt_token_ids: Sequence[int], *, tenant: str,
                    fairness_key: str, priority: int, fairness_weight: float,
                    tokenizer: Tokenizer, eos_token_ids: Collection[int],
                    clock: Callable[[], float], arrival_seq: int | None = None) -> Request:
    """The request that continues ``state``: its prompt is ``prompt_token_ids`` (the original
    prompt) followed by the tokens generated before, its budget what is left of
    ``max_tokens``, its deadline (if any) counted again from now.

    Raises:
        ValueError: ``prompt_token_ids`` is not the prompt the state was generated from (another
            length: another tokenizer), or the state leaves nothing to generate.
    """
    done = len(state.generated)
    if len(prompt_token_ids) != state.prompt_len:
        raise ValueError(f"the prompt has {len(prompt_token_ids)} tokens; the preempted "
                         f"request's had {state.prompt_len}")
    if not 0 < done < state.sampling.max_tokens:
        raise ValueError(f"{done} tokens generated of max_tokens {state.sampling.max_tokens}: "
                         "nothing to resume")
    # Prompt logprobs went out with the request's first event: they are not computed again.
    sampling = dataclasses.replace(state.sampling, max_tokens=state.sampling.max_tokens - done,
                                   min_tokens=max(0, state.sampling.min_tokens - done),
                                   prompt_logprobs=None)
    extra: dict[str, Any] = {} if arrival_seq is None else {"arrival_seq": arrival_seq}
    request = Request(request_id=state.request_id,
                      prompt_token_ids=[*prompt_token_ids, *state.generated], sampling=sampling,
                      tenant=tenant, fairness_key=fairness_key, priority=priority,
                      fairness_weight=fairness_weight, **extra)
    restore_times(request, state, clock)
    request.event_seq = state.next_seq
    request.preemptions = state.preemptions
    request.detokenizer = (state.detokenizer if state.detokenizer is not None
                           else replay_detokenizer(tokenizer, state, eos_token_ids))
    request.sampler_state = (state.generator if state.generator is not None
                             else generator_from(state.sampler_state))
    # A constrained request's grammar: the live one within an engine, else compiled again and
    # fed ``generated`` (inference.engine.structured.compiler) before it is queued.
    request.grammar = state.grammar
    request.resume = dataclasses.replace(state, generator=None, detokenizer=None,
                                         sampler_state=None, grammar=None)
    return request
