"""A row's way through the scheduler's queues, shared by every phase of the tick.

:class:`RowLifecycle` works on the scheduler's
:class:`~inference.engine.sched.state.SchedulerState`: a request's arrival in ``_pending``
(hard-rejected there if it can never fit), a prefill pass over prompt chunks and its accounting,
``_promote_to_decode`` (the single seam from prefill to decode: its logits give the row's first
token), a decode step's inputs and tokens, the handling of a forward pass that fails, each
sampled token through the stop rules, and the one exit of every row (:meth:`RowLifecycle.finish`).
Admission (:class:`~inference.engine.sched.admission.Admission`), the mixed-batch pass
(:class:`~inference.engine.sched.mixed_tick.MixedPass`) and the
:class:`~inference.engine.sched.scheduler.Scheduler`'s own phases all call it.

Failures stay where they happen: a forward pass that raises ends each of its rows once; a row
whose logits, draw, text or stop strings fail ends alone (:func:`inference.engine.sampling.sample`,
:class:`~inference.engine.sched.outputs.RowFault`), and every other row goes on exactly as it
would have without it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from inference.engine.backends.base import DecodeRow, PassYielded, PrefillChunk
from inference.engine.config import PrefillMode
from inference.engine.detokenizer import IncrementalDetokenizer
from inference.engine.logprobs import keep_prompt_logprobs, new_logprob_state
from inference.engine.request import ErrorInfo, FinishReason, Request, RequestPhase
from inference.engine.sampling import sample
from inference.engine.sched.choice_resume import fork_resumed
from inference.engine.sched.choices import fork, unforked_choices
from inference.engine.sched.gates import never_fits
from inference.engine.sched.outputs import RowFault, append_token, final_event, pass_failed
from inference.engine.sched.state import SchedulerState
from inference.engine.structured.row_grammar import prefetch_masks

log = logging.getLogger(__name__)


class RowLifecycle:
    """Arrival, prefill, promotion, decode tokens and the exit of the rows of ``state``.

    Args:
        state: the scheduler's shared state; every method reads and changes it.
    """

    def __init__(self, state: SchedulerState):
        self.state = state

    # -- arrival -------------------------------------------------------------------------------

    def enqueue(self, request: Request) -> None:
        """Put a validated request (new, or resumed after a preemption) into ``_pending``.

        A request that can never fit (gate 2 or 3 hard limit: bigger than the active-KV budget
        or the whole pool) is hard-rejected right here, on arrival, whatever its place in the
        queue: those limits never change, so waiting cannot help it.
        """
        state = self.state
        request.phase = RequestPhase.PENDING
        if request.detokenizer is None:  # a resumed request's goes on where it stopped
            request.detokenizer = IncrementalDetokenizer(state.tokenizer, request.sampling.stop)
        request.logprobs = new_logprob_state(request, state.tokenizer)
        state.pending[request.request_id] = request
        state.policy.on_request_arrived(request)
        if request.grammar_error is not None:  # its grammar was refused when compiled
            self.finish(request, FinishReason.ERROR, request.grammar_error)
            return
        if request.abort_requested:  # aborted while its grammar compiled
            self.finish(request, FinishReason.ABORT)
            return
        refusal = never_fits(request, state.kv, state.active_kv_budget)
        if refusal is not None:
            self.hard_reject(request, *refusal)

    def hard_reject(self, request: Request, gate: int, error: ErrorInfo) -> None:
        """End ``request`` with ``error``, counted as a hard-reject of ``gate`` (2 or 3)."""
        self.state.hard_rejected[gate] += 1
        self.state.kv_admit_blocked += 1
        self.finish(request, FinishReason.ERROR, error)

    # -- prefill and promotion -----------------------------------------------------------------

    def run_prefill(self, rows: list[Request], whole_prompt: bool) -> None:
        """One prefill pass over ``rows``: each feeds its next ``chunk_size`` prompt tokens, or
        its whole remaining prompt with ``whole_prompt``; rows whose prompt is done are
        promoted with their first token."""
        state = self.state
        chunks = []
        for request in rows:
            start = request.num_computed_tokens
            end = request.prompt_len if whole_prompt else min(
                request.prompt_len, start + state.chunk_size)
            state.kv.ensure_slots(request, end)
            chunks.append(PrefillChunk(request.request_id, request.prompt_token_ids[start:end],
                                       start, tuple(request.block_table),
                                       all_logits=request.needs_prompt_logprobs))
        logits = self.forward("prefill", rows, lambda: keep_prompt_logprobs(
            state.backend.prefill(chunks), chunks, rows, len(chunks)))
        if logits is not None:
            self.apply_prefill(rows, chunks, logits)

    def apply_prefill(self, rows: list[Request], chunks: list[PrefillChunk],
                      logits: torch.Tensor) -> None:
        """Account the chunks a pass computed (``logits``: ``[len(rows), vocab]``, one row per
        chunk); a row whose prompt is done gets its first token."""
        state = self.state
        for i, (request, chunk) in enumerate(zip(rows, chunks, strict=True)):
            computed = len(chunk.token_ids)
            request.num_computed_tokens += computed
            state.prompt_tokens_computed += computed
            state.kv.commit_full_blocks(request)
            # The final chunk also generates the first token. A resumed row's prompt is a
            # recomputation after a preemption: charged to nobody
            # (inference.engine.sched.preemption).
            charged = computed
            if request.resume is not None:
                state.preempted_tokens_recomputed += computed
                state.batch_tokens_recomputed += computed if request.batch else 0
                charged = 0
            elif request.recomputed_prefix > chunk.start_pos:  # a batch row started again
                again = min(computed, request.recomputed_prefix - chunk.start_pos)
                state.preempted_tokens_recomputed += again
                state.batch_tokens_recomputed += again
                charged = computed - again
            state.policy.on_tokens_processed(request, charged, int(request.prefill_done))
            if request.prefill_done:
                self._promote_to_decode(request, logits[i:i + 1])

    def _promote_to_decode(self, request: Request, logits: Any) -> None:
        """Hand a fully prefilled row to the decode batch; its logits give its first token.

        The single seam from prefill to decode (the monolithic path, the final chunk and the
        mixed pass all come here): with disaggregated prefill, the KV would arrive from another
        worker here.
        """
        state = self.state
        state.prefilling.remove(request)
        if request.resume is not None and request.resume.choices:
            self._resume_choices(request)
            return
        request.phase = RequestPhase.ACTIVE
        state.active.append(request)
        if request.sampling.n == 1:
            self.append_token(request, sample(logits, [request], state.eos_token_ids)[0])
            return
        # n choices: one row each, every first token drawn from these same logits
        # (inference.engine.sched.choices); VTC charges each choice's first token.
        rows, failed = fork(state, request)
        for row, error in failed:
            self.finish(row, FinishReason.ERROR, error)
        rows = [r for r in rows if r.phase is RequestPhase.ACTIVE]
        tokens = sample(logits.repeat(len(rows), 1), rows, state.eos_token_ids)
        for row, token in zip(rows, tokens, strict=True):
            if row is not request:
                state.policy.on_tokens_processed(row, 0, 1)
            self.append_token(row, token)

    def _resume_choices(self, request: Request) -> None:
        """A preempted request of ``n`` choices whose prompt is computed again: each unfinished
        choice gets its row back, to recompute its own tokens as a prefill
        (:func:`~inference.engine.sched.choice_resume.fork_resumed`); the prompt's logits are
        not used (each choice samples after its own tokens)."""
        rows, failed = fork_resumed(self.state, request)
        for row, error in failed:
            self.finish(row, FinishReason.ERROR, error)
        if self.state.prefill_mode is PrefillMode.MONOLITHIC:
            live = [r for r in rows if r.phase is RequestPhase.PREFILLING]
            if live:
                self.run_prefill(live, whole_prompt=True)

    # -- decode --------------------------------------------------------------------------------

    def decode_rows(self, rows: list[Request]) -> list[DecodeRow]:
        """Each row's next decode input (its last token), with a KV slot ensured for it."""
        batch = []
        for request in rows:
            position = request.num_tokens - 1
            self.state.kv.ensure_slots(request, position + 1)
            batch.append(DecodeRow(request.request_id, request.output_token_ids[-1], position,
                                   tuple(request.block_table)))
        return batch

    def apply_decode(self, rows: list[Request], logits: torch.Tensor) -> None:
        """Sample each decode row's next token from its logits (``[len(rows), vocab]``) and
        append it.

        A row's pass fed every token it had not computed: its last token, or with jump-forward
        its last sampled token and the tokens its grammar forced after it. Each is charged to
        its fairness key as a generated token (VTC's output weight), as the client is billed
        for it as a completion token.
        """
        if not rows:
            return
        state = self.state
        tokens = sample(logits, rows, state.eos_token_ids)
        for request, token in zip(rows, tokens, strict=True):
            if isinstance(token, ErrorInfo):  # this row's logits or draw; the others go on
                self.finish(request, FinishReason.ERROR, token)
                continue
            fed = request.num_tokens - request.num_computed_tokens
            request.num_computed_tokens += fed
            state.kv.commit_full_blocks(request)
            state.policy.on_tokens_processed(request, 0, fed)
            self.append_token(request, token)

    # -- every pass and every token ------------------------------------------------------------

    def forward(self, phase: str, rows: list[Request],
                run: Callable[[], torch.Tensor]) -> torch.Tensor | None:
        """One forward pass over ``rows``: its ``[len(rows), vocab]`` logits, or None if it raised
        or gave another shape (then each of ``rows`` has ended once, with :func:`pass_failed`),
        or gave way to an interactive arrival (:class:`PassYielded`: nothing changed).
        """
        if self.state.config.structured_mask_overlap:  # masks computed while the pass runs
            prefetch_masks([r.grammar for r in rows])
        try:
            logits = run()
            if logits.dim() != 2 or logits.shape[0] != len(rows):
                raise ValueError(f"{phase} returned logits of shape {tuple(logits.shape)} "
                                 f"for {len(rows)} rows")
        except PassYielded:  # its rows wait for a later pass, as they were
            self.state.batch_passes_yielded += 1
            return None
        except Exception:
            log.exception("%s pass failed for %d rows", phase, len(rows))
            error = pass_failed(phase, len(rows))
            for request in rows:
                self.finish(request, FinishReason.ERROR, error)
            return None
        return logits

    def append_token(self, request: Request, token: int | ErrorInfo) -> None:
        """Record a sampled token, stream its text, mark the row finished if it stopped; a token
        that is an error, whose text fails (:class:`RowFault`) or that the row's grammar does not
        take ends this row alone.

        A constrained row then takes the tokens its grammar forces (jump-forward,
        :meth:`jumps_forward`): each is appended, streamed and billed as a generated token,
        without a sampling step; the next pass computes them with the sampled one. A row whose
        grammar then allows nothing but its end stops (``stop``) without sampling an EOS, also
        when that token was the last ``max_tokens`` allowed.
        """
        if not self._record(request, token):
            return
        grammar = request.grammar
        ended = (None, FinishReason.LENGTH)  # a last token that completes the grammar: stop
        if grammar is None or request.finish_reason not in ended:
            return
        if request.finish_reason is None and self.jumps_forward(request):
            for forced in grammar.forced_tokens(
                    request.max_tokens - len(request.output_token_ids)):
                grammar.stats.forced += 1
                if not self._record(request, forced):
                    return
                if request.finish_reason is not None:
                    break
        if (grammar.complete() and not request.sampling.ignore_eos
                and request.finish_reason in ended):
            # Nothing may follow but its end: the answer stops here, without a step for EOS.
            request.finish_reason = FinishReason.STOP

    def jumps_forward(self, request: Request) -> bool:
        """Whether ``request``'s forced tokens are appended without a step each: with
        ``STRUCTURED_JUMP_FORWARD`` in ``mixed_batch`` mode (where a pass takes several tokens of
        a running row), for a decode row that asked for no logprobs (every token of such a row
        is sampled, so each has the model's entry)."""
        state = self.state
        return (state.config.structured_jump_forward
                and state.prefill_mode is PrefillMode.MIXED_BATCH
                and request.phase is RequestPhase.ACTIVE and request.sampling.logprobs is None)

    def _record(self, request: Request, token: int | ErrorInfo) -> bool:
        """Append one token (:meth:`append_token`); False when the row ended instead."""
        if isinstance(token, ErrorInfo):
            self.finish(request, FinishReason.ERROR, token)
            return False
        state = self.state
        if request.grammar is not None:
            error = request.grammar.consume(token)
            if error is not None:
                self.finish(request, FinishReason.ERROR, error)
                return False
        try:
            event = append_token(request, token, state.eos_token_ids)
        except RowFault as fault:
            self.finish(request, FinishReason.ERROR, fault.error)
            return False
        state.tokens_generated += 1
        if request.first_token_time is None:
            request.first_token_time = state.clock()
        if event is not None:
            state.emit(event)
        return True

    # -- the exit ------------------------------------------------------------------------------

    def finish(self, request: Request, reason: FinishReason,
               error: ErrorInfo | None = None) -> None:
        """Take ``request`` out of whatever queue holds it, free its KV, release its
        reservation and backend row, emit its final event; nothing for a finished request."""
        state = self.state
        phase = request.phase
        if phase is RequestPhase.FINISHED:
            return
        if phase is RequestPhase.PENDING:
            del state.pending[request.request_id]
            state.policy.remove(request)
            state.left_pending += 1
        else:
            if phase is RequestPhase.PREFILLING:
                state.prefilling.remove(request)
            else:
                state.active.remove(request)
            state.kv.free(request)
            if request.group is not None:
                request.group.hand_on_prompt_share(request)
            state.active_kv_reserved -= request.reserved_kv_tokens
            request.reserved_kv_tokens = 0
            state.backend.remove_row(request.request_id)
            if request.group is None:
                state.policy.on_request_finished(request)
        request.phase = RequestPhase.FINISHED
        group = request.group
        if group is not None:  # one choice of a forked request: its final event at the last
            final = group.end(request, reason, error, state.clock())
            if final is None:
                return
            del state.groups[group.request_id]
            state.policy.on_request_finished(request)
        else:
            # Never raises; it may turn a normal end into an error (held text it could not
            # release).
            final = unforked_choices(request, final_event(request, reason, error, state.clock()))
            request.finish_reason = final.finish_reason
            request.error = final.error
        state.finished[final.finish_reason.value] += 1
        state.emit(final)

    def finish_request(self, request_id: str, reason: FinishReason,
                       error: ErrorInfo | None = None) -> bool:
        """End the live request ``request_id`` as a whole: every live choice of a forked one;
        False if it is not live."""
        group = self.state.groups.get(request_id)
        rows = group.live_rows() if group is not None else [self.state.find(request_id)]
        if rows[0] is None:
            return False
        for row in rows:
            self.finish(row, reason, error)
        return True
