"""The continuous-batching scheduler of ``docs/design.md``.

Three queues hold every live request exactly once: ``_pending`` (ordered by the policy),
``_prefilling`` (admitted, prompt still being fed in chunks) and ``_active`` (rows in the decode
batch). One tick runs four phases in a fixed order:

1. ``_admit_pending`` (:mod:`inference.engine.sched.admission`): gates 2 and 3 (active-KV budget, KV
   block pool), soft-hold or hard-reject; a higher tier may preempt lower-tier decode rows;
2. ``_advance_prefill_chunk``: one chunk per prefilling row; the final chunk's logits give the
   first token and ``_promote_to_decode`` splices the row into ``_active``;
3. ``_evict_finished``: rows that stopped leave, free their blocks and reservation, get their
   final event;
4. ``_decode_step``: one batched forward pass, one token per active row.

With ``PREFILL_MODE=mixed_batch`` phases 2 and 4 are one forward pass after eviction
(:mod:`inference.engine.sched.mixed_tick`), its prompt tokens sized to ``TARGET_ITL_MS``
(:mod:`inference.engine.sched.tick_budget`).

Admit comes before evict, so a row promoted in this tick streams its first token in this tick and
that token is never lost. The scheduler is single-threaded:
:class:`inference.engine.llm_engine.LLMEngine` feeds it from a thread-safe inbox and runs
:meth:`Scheduler.step` on its worker thread.

Failures stay where they happen: a forward pass that raises ends each of its rows once; a row
whose logits, draw, text or stop strings fail ends alone (:func:`inference.engine.sampling.sample`,
:class:`RowFault`), and every other row goes on exactly as it would have without it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from inference.engine.backends.base import DecodeRow, ModelBackend, PrefillChunk
from inference.engine.config import EngineConfig, PrefillMode
from inference.engine.detokenizer import IncrementalDetokenizer
from inference.engine.kv_cache import KVCacheManager
from inference.engine.logprobs import keep_prompt_logprobs, new_logprob_state
from inference.engine.request import (
    ErrorInfo,
    Event,
    FinishReason,
    Request,
    RequestPhase,
)
from inference.engine.sampling import sample
from inference.engine.sched.admission import Admission
from inference.engine.sched.gates import never_fits
from inference.engine.sched.mixed_tick import MixedTick
from inference.engine.sched.outputs import (
    RowFault,
    append_token,
    final_event,
    pass_failed,
    queue_timeout,
)
from inference.engine.sched.policy import make_policy
from inference.engine.sched.stats import SchedulerStats

log = logging.getLogger(__name__)

GATES = (1, 2, 3)


class Scheduler(SchedulerStats, MixedTick, Admission):
    """Queues, the four-phase tick, the gates and the reservation accounting.

    Args:
        config: engine settings (batch size, chunk size, policy, KV sizes, budget).
        backend: the model; its KV pool is allocated here, once.
        num_blocks: KV blocks in the pool (already resolved from a byte budget if needed).

    Raises:
        ValueError: if the active-KV budget does not fit in the pool.
    """

    def __init__(self, config: EngineConfig, backend: ModelBackend, num_blocks: int):
        self.config = config
        self.backend = backend
        self.tokenizer = backend.tokenizer
        self.eos_token_ids = frozenset(backend.tokenizer.eos_token_ids)
        self.prefill_mode = config.effective_prefill_mode
        self.chunk_size = config.prefill_chunk_size
        self.max_batch_size = config.max_batch_size
        self.active_kv_budget = config.resolved_budget(num_blocks)
        self.kv = KVCacheManager(num_blocks, config.kv_block_size, config.enable_prefix_caching)
        backend.allocate_kv_pool(num_blocks, config.kv_block_size)
        self.policy = make_policy(
            config.scheduling_policy, config.vtc_input_weight, config.vtc_output_weight)

        self._pending: dict[str, Request] = {}  # membership; the policy holds the order
        self._prefilling: list[Request] = []
        self._active: list[Request] = []
        self.active_kv_reserved = 0

        self.tick_count = 0
        self.tokens_generated = 0
        self.prompt_tokens_computed = 0
        self.kv_admit_blocked = 0
        self.soft_held = dict.fromkeys(GATES, 0)
        self.hard_rejected = dict.fromkeys(GATES, 0)
        self.finished = {reason.value: 0 for reason in FinishReason}
        self.left_pending = 0  # requests that left _pending (admitted or ended); read by the engine
        self._events: list[Event] = []
        self._clock: Callable[[], float] = time.monotonic
        self._init_mixed()
        self._init_preemption()

    # -- entry points (called on the worker thread) --------------------------------------------

    def add_request(self, request: Request) -> None:
        """Put a validated request into ``_pending``.

        A request that can never fit (gate 2 or 3 hard limit: bigger than the active-KV budget
        or the whole pool) is hard-rejected right here, on arrival, whatever its place in the
        queue: those limits never change, so waiting cannot help it.
        """
        request.phase = RequestPhase.PENDING
        if request.detokenizer is None:  # a resumed request's goes on where it stopped
            request.detokenizer = IncrementalDetokenizer(self.tokenizer, request.sampling.stop)
        request.logprobs = new_logprob_state(request, self.tokenizer)
        self._pending[request.request_id] = request
        self.policy.on_request_arrived(request)
        refusal = never_fits(request, self.kv, self.active_kv_budget)
        if refusal is not None:
            self._hard_reject(request, *refusal)

    def abort_request(self, request_id: str) -> bool:
        """End a request in any phase with ``finish_reason=abort``; False if it is not live."""
        request = self._find(request_id)
        if request is None:
            return False
        self._finish(request, FinishReason.ABORT)
        return True

    def step(self, on_prefill_events: Callable[[list[Event]], None] | None = None
             ) -> list[Event]:
        """Run one tick; return the events it produced, in order.

        Args:
            on_prefill_events: if given, called with the events of the phases before decode
                (first tokens of rows promoted this tick, requests ended by the gates or by
                their first token) before the decode step runs, so a first token reaches its
                client without waiting for the batch's decode step; those events are then
                not returned again.
        """
        self._expire_pending()
        self._admit_pending()
        mixed = self.prefill_mode is PrefillMode.MIXED_BATCH
        if not mixed:
            self._advance_prefill_chunk()
            self._evict_finished()
        if on_prefill_events is not None and self._events:
            early, self._events = self._events, []
            on_prefill_events(early)
        if mixed:
            # One pass; rows that stopped in it leave at once (their blocks are reused from the
            # next tick's admission on).
            self._mixed_pass()
            self._evict_finished()
        else:
            self._decode_step()
        self.tick_count += 1
        events, self._events = self._events, []
        return events

    def take_events(self) -> list[Event]:
        """Events produced outside a tick (aborts, shutdown)."""
        events, self._events = self._events, []
        return events

    def has_work(self) -> bool:
        return bool(self._pending or self._prefilling or self._active)

    def withdraw_pending(self) -> list[Request]:
        """Take every pending request out, without events (shutdown hands them back)."""
        withdrawn = list(self._pending.values())
        for request in withdrawn:
            del self._pending[request.request_id]
            self.policy.remove(request)
            request.phase = RequestPhase.FINISHED
            self.left_pending += 1
        return withdrawn

    def fail_all(self, error: ErrorInfo) -> None:
        """End every live request with ``error`` (shutdown, fatal backend failure)."""
        for request in [*self._pending.values(), *self._prefilling, *self._active]:
            self._finish(request, FinishReason.ERROR, error)

    # -- phase 1 (admission, gates 2 and 3, preemption): inference.engine.sched.admission
    # ------------------

    def _expire_pending(self) -> None:
        """End the pending requests whose admission deadline has passed (``queue_timeout``)."""
        now = self._clock()
        expired = [r for r in self._pending.values()
                   if r.queue_deadline is not None and now > r.queue_deadline]
        for request in expired:
            self._finish(request, FinishReason.ERROR, queue_timeout(now - request.arrival_time))

    # -- phase 2: chunked prefill --------------------------------------------------------------

    def _advance_prefill_chunk(self) -> None:
        if self._prefilling:
            self._run_prefill(list(self._prefilling), whole_prompt=False)

    def _run_prefill(self, rows: list[Request], whole_prompt: bool) -> None:
        chunks = []
        for request in rows:
            start = request.num_computed_tokens
            end = request.prompt_len if whole_prompt else min(
                request.prompt_len, start + self.chunk_size)
            self.kv.ensure_slots(request, end)
            chunks.append(PrefillChunk(request.request_id, request.prompt_token_ids[start:end],
                                       start, tuple(request.block_table),
                                       all_logits=request.needs_prompt_logprobs))
        logits = self._forward("prefill", rows, lambda: keep_prompt_logprobs(
            self.backend.prefill(chunks), chunks, rows, len(chunks)))
        if logits is not None:
            self._apply_prefill(rows, chunks, logits)

    def _apply_prefill(self, rows: list[Request], chunks: list[PrefillChunk],
                       logits: torch.Tensor) -> None:
        """Account the chunks a pass computed; a row whose prompt is done gets its first token."""
        for i, (request, chunk) in enumerate(zip(rows, chunks, strict=True)):
            computed = len(chunk.token_ids)
            request.num_computed_tokens += computed
            self.prompt_tokens_computed += computed
            self.kv.commit_full_blocks(request)
            # The final chunk also generates the first token. A resumed row's prompt is a
            # recomputation after a preemption: charged to nobody
            # (inference.engine.sched.preemption).
            charged = computed
            if request.resume is not None:
                self.preempted_tokens_recomputed += computed
                charged = 0
            self.policy.on_tokens_processed(request, charged, int(request.prefill_done))
            if request.prefill_done:
                self._promote_to_decode(request, logits[i:i + 1])

    def _promote_to_decode(self, request: Request, logits: Any) -> None:
        """Hand a fully prefilled row to the decode batch; its logits give its first token.

        The single seam from prefill to decode (the monolithic path and the final chunk both
        come here): with disaggregated prefill, the KV would arrive from another worker here.
        """
        self._prefilling.remove(request)
        request.phase = RequestPhase.ACTIVE
        self._active.append(request)
        self._append_token(request, sample(logits, [request], self.eos_token_ids)[0])

    # -- phase 3: eviction ---------------------------------------------------------------------

    def _evict_finished(self) -> None:
        for request in [r for r in self._active if r.finish_reason is not None]:
            self._finish(request, request.finish_reason)

    # -- phase 4: decode -----------------------------------------------------------------------

    def _decode_step(self) -> None:
        rows = list(self._active)
        if not rows:
            return
        batch = self._decode_rows(rows)
        logits = self._forward("decode", rows, lambda: self.backend.decode(batch))
        if logits is not None:
            self._apply_decode(rows, logits)

    def _decode_rows(self, rows: list[Request]) -> list[DecodeRow]:
        """Each row's next decode input (its last token), with a KV slot ensured for it."""
        batch = []
        for request in rows:
            position = request.num_tokens - 1
            self.kv.ensure_slots(request, position + 1)
            batch.append(DecodeRow(request.request_id, request.output_token_ids[-1], position,
                                   tuple(request.block_table)))
        return batch

    def _apply_decode(self, rows: list[Request], logits: torch.Tensor) -> None:
        """Sample each decode row's next token from its logits and append it."""
        if not rows:
            return
        tokens = sample(logits, rows, self.eos_token_ids)
        for request, token in zip(rows, tokens, strict=True):
            if isinstance(token, ErrorInfo):  # this row's logits or draw; the others go on
                self._finish(request, FinishReason.ERROR, token)
                continue
            request.num_computed_tokens += 1
            self.kv.commit_full_blocks(request)
            self.policy.on_tokens_processed(request, 0, 1)
            self._append_token(request, token)

    # -- shared helpers --------------------------------------------------------------------------

    def _forward(self, phase: str, rows: list[Request],
                 run: Callable[[], torch.Tensor]) -> torch.Tensor | None:
        """One forward pass over ``rows``: its ``[len(rows), vocab]`` logits, or None if it raised
        or gave another shape (then each of ``rows`` has ended once, with :func:`pass_failed`).
        """
        try:
            logits = run()
            if logits.dim() != 2 or logits.shape[0] != len(rows):
                raise ValueError(f"{phase} returned logits of shape {tuple(logits.shape)} "
                                 f"for {len(rows)} rows")
        except Exception:
            log.exception("%s pass failed for %d rows", phase, len(rows))
            error = pass_failed(phase, len(rows))
            for request in rows:
                self._finish(request, FinishReason.ERROR, error)
            return None
        return logits

    def _append_token(self, request: Request, token: int | ErrorInfo) -> None:
        """Record a sampled token, stream its text, mark the row finished if it stopped; a token
        that is an error, or whose text fails (:class:`RowFault`), ends this row alone."""
        if isinstance(token, ErrorInfo):
            self._finish(request, FinishReason.ERROR, token)
            return
        try:
            event = append_token(request, token, self.eos_token_ids)
        except RowFault as fault:
            self._finish(request, FinishReason.ERROR, fault.error)
            return
        self.tokens_generated += 1
        if request.first_token_time is None:
            request.first_token_time = self._clock()
        if event is not None:
            self._emit(event)

    def _finish(self, request: Request, reason: FinishReason,
                error: ErrorInfo | None = None) -> None:
        """Take ``request`` out of whatever queue holds it, free its KV, emit its final event."""
        phase = request.phase
        if phase is RequestPhase.FINISHED:
            return
        if phase is RequestPhase.PENDING:
            del self._pending[request.request_id]
            self.policy.remove(request)
            self.left_pending += 1
        else:
            if phase is RequestPhase.PREFILLING:
                self._prefilling.remove(request)
            else:
                self._active.remove(request)
            self.kv.free(request)
            self.active_kv_reserved -= request.reserved_kv_tokens
            request.reserved_kv_tokens = 0
            self.backend.remove_row(request.request_id)
            self.policy.on_request_finished(request)
        request.phase = RequestPhase.FINISHED
        # Never raises; it may turn a normal end into an error (held text it could not release).
        event = final_event(request, reason, error, self._clock())
        request.finish_reason = event.finish_reason
        request.error = event.error
        self.finished[event.finish_reason.value] += 1
        self._emit(event)

    def _emit(self, event: Event) -> None:
        self._events.append(event)

    def _find(self, request_id: str) -> Request | None:
        request = self._pending.get(request_id)
        if request is not None:
            return request
        for request in (*self._prefilling, *self._active):
            if request.request_id == request_id:
                return request
        return None
