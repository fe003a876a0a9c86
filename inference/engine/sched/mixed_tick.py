"""``PREFILL_MODE=mixed_batch``: one forward pass per tick, carrying decode rows and prompt chunks.

The tick (``docs/design.md``, "Mixed batch"): expire, admit (gates 2 and 3), then ONE pass: every
active row's decode token and this tick's prompt tokens, sized by
:func:`inference.engine.sched.tick_budget.plan_prefill` to keep the pass near ``TARGET_ITL_MS``
while streams run; then evict the rows that stopped. After the pass each decode row appends its next
token; a row whose final prompt chunk was in the pass is promoted (``_promote_to_decode``) and
streams its first token in this same tick (and its final event too, if that token ends it); it
decodes from the next tick on. Eviction after the pass frees blocks that admission reuses from the
next tick. A constrained row whose grammar forced tokens after its sampled one (jump-forward)
feeds them all in the pass as a chunk of its own, and samples from its last position.

:class:`MixedPass` is the scheduler's collaborator for this pass: it reads the queues of the
:class:`~inference.engine.sched.state.SchedulerState` it is given and runs, accounts and promotes
the rows through the :class:`~inference.engine.sched.lifecycle.RowLifecycle`; it owns the pass cost
model and the last pass's figures.
"""

from __future__ import annotations

import logging
import math
import time
import weakref
from typing import Any

from inference.engine.backends.base import ModelBackend, PrefillChunk
from inference.engine.config import PrefillMode
from inference.engine.logprobs import keep_prompt_logprobs
from inference.engine.request import Request
from inference.engine.sched.lifecycle import RowLifecycle
from inference.engine.sched.state import SchedulerState
from inference.engine.sched.tick_budget import (
    MIN_PREFILL_TOKENS,
    PassCostModel,
    PassShape,
    batch_ceiling,
    batch_decode_rows,
    calibrate,
    chunk_attention,
    plan_batch_prefill,
    plan_prefill,
)

log = logging.getLogger(__name__)

# Blocks of the (still empty) pool the start-up calibration writes into, at most.
CALIBRATION_BLOCKS = 128
# One cost model per backend and block size in a process: engines re-created over the same
# loaded backend (tests, benchmarks) do not calibrate again.
_cost_models: weakref.WeakKeyDictionary[Any, dict[int, PassCostModel | None]] = (
    weakref.WeakKeyDictionary())


def pass_cost_model(backend: ModelBackend, num_blocks: int,
                    block_size: int) -> PassCostModel | None:
    """The backend's calibrated pass cost model (None if it cannot be measured).

    A backend may name another object whose speed it has as ``cost_model_key`` (a wrapper
    naming the backend it forwards to); the model is cached per key and block size. Runs
    before the first request: the pool's first blocks are free and their content is scratch.
    """
    fixed = backend.fixed_pass_seconds
    if fixed is not None:
        return PassCostModel([fixed, 0.0, 0.0, 0.0, 0.0])
    key = getattr(backend, "cost_model_key", backend)
    cached = _cost_models.setdefault(key, {})
    if block_size not in cached:
        blocks = list(range(min(num_blocks, CALIBRATION_BLOCKS)))
        model = None
        if len(blocks) >= 8:
            try:
                # Timed on the key itself where it is a backend (a wrapper's bookkeeping stays
                # out of it); the pool is shared, so the blocks are the same.
                model = calibrate(key if isinstance(key, ModelBackend) else backend, blocks,
                                  block_size)
            except Exception:  # noqa: BLE001 - no model: every row takes the chunk cap
                log.warning("pass cost calibration failed; ticks take PREFILL_CHUNK_SIZE",
                            exc_info=True)
        cached[block_size] = model
    return cached[block_size]


def _spans(rows: list[Request]) -> list[tuple[int, int]]:
    """``(next prompt position, prompt tokens left)`` of each prefilling row."""
    return [(r.num_computed_tokens, r.prompt_len - r.num_computed_tokens) for r in rows]


# Consecutive passes computing interactive prompts that keep every batch row out; the next one
# lets batch rows in within the batch ceiling, so a stream of long prompts never starves them.
PROMPT_PASSES_WITHOUT_BATCH = 8


class MixedPass:
    """The mixed-batch phase of the scheduler's tick (module docstring).

    Args:
        state: the scheduler's shared state; the backend is calibrated here (once per
            backend and block size in a process) when the mode is ``mixed_batch`` and
            ``TARGET_ITL_MS`` is above 0.
        rows: the row lifecycle of the same state.

    ``cost_model`` (None: every row takes the chunk cap) and ``target_itl_s`` (seconds, 0 for
    no target) size the pass's prompt tokens; ``last_pass`` holds the last pass's decode rows,
    prompt tokens, and measured and predicted seconds.
    """

    def __init__(self, state: SchedulerState, rows: RowLifecycle):
        self.state = state
        self.rows = rows
        self.target_itl_s = state.config.target_itl_ms / 1000.0
        self.cost_model: PassCostModel | None = None
        if self.target_itl_s > 0 and state.prefill_mode is PrefillMode.MIXED_BATCH:
            self.cost_model = pass_cost_model(state.backend, state.kv.num_blocks,
                                              state.config.kv_block_size)
        self.last_pass: dict[str, float] = {}
        self.interactive_seen_at = -math.inf  # the clock's last tick with interactive work
        self.yielding = False
        self.prompt_pass = False  # this pass computes an interactive prompt: no batch row
        self._prompt_passes = 0  # consecutive passes that kept batch rows out for prompts
        self._gave_way = False  # the last pass gave way to an arrival: this one does not

    def _yield_to_interactive(self) -> bool:
        """Whether a pass of batch rows alone is held short (``BATCH_YIELD_S``): the engine
        held an interactive request, in any phase, within the last ``BATCH_YIELD_S`` s."""
        state = self.state
        now = state.clock()
        if any(not r.batch for r in (*state.active, *state.prefilling, *state.pending.values())):
            self.interactive_seen_at = now
        return now - self.interactive_seen_at < state.config.batch_yield_s

    def _interactive_arrived(self) -> bool:
        """Whether an interactive request waits for the engine's next tick (read while a pass
        runs, from the compute thread)."""
        return any(kind == "submit" and not item.batch for kind, item in self.state.arrivals())

    def _mixed_pass(self) -> None:
        state, rows = self.state, self.rows
        self.yielding = self._yield_to_interactive()
        self.prompt_pass = (self.cost_model is not None
                            and any(not r.batch for r in state.prefilling)
                            and self._prompt_passes < PROMPT_PASSES_WITHOUT_BATCH)
        self._prompt_passes = self._prompt_passes + 1 if self.prompt_pass else 0
        # A row whose grammar forced tokens after its last sampled one (jump-forward) feeds them
        # all in this pass, as a prompt-like chunk of its own; the others feed one token.
        forced_rows = [r for r in state.active if r.num_tokens - r.num_computed_tokens > 1
                       and not (self.prompt_pass and r.batch)]
        decode_rows = self._decode_rows(
            [r for r in state.active if r.num_tokens - r.num_computed_tokens <= 1])
        decode_shape = PassShape(len(decode_rows) + len(forced_rows),
                                 sum(r.num_tokens for r in (*decode_rows, *forced_rows)), 0, 0)
        prefilling = [r for r in state.prefilling if not r.batch]
        take = plan_prefill(_spans(prefilling), decode_shape, self.cost_model,
                            self.target_itl_s, state.chunk_size)
        batch = [r for r in state.prefilling if r.batch]
        if batch:
            take += self._batch_take(batch, prefilling, take, decode_shape)
            prefilling += batch
        prefill_rows, chunks = [], []
        for request, n in zip(prefilling, take, strict=True):
            if n == 0:
                continue
            start = request.num_computed_tokens
            state.kv.ensure_slots(request, start + n)
            prefill_rows.append(request)
            chunks.append(PrefillChunk(request.request_id,
                                       request.prompt_token_ids[start:start + n], start,
                                       tuple(request.block_table),
                                       all_logits=request.needs_prompt_logprobs))
        sampled_rows = prefill_rows + forced_rows
        for request in forced_rows:
            start = request.num_computed_tokens
            state.kv.ensure_slots(request, request.num_tokens)
            chunks.append(PrefillChunk(request.request_id, request.all_token_ids[start:], start,
                                       tuple(request.block_table)))
        batch = rows.decode_rows(decode_rows)
        if not chunks and not batch:
            return
        shape = PassShape(decode_shape.decode_rows, decode_shape.decode_context, sum(take),
                          sum(chunk_attention(c.start_pos, len(c.token_ids)) for c in chunks))
        started = time.perf_counter()
        # A pass of batch rows alone gives way between its layers to an interactive request
        # that arrives meanwhile: it waits a layer, not the pass (the pass is redone later).
        # The pass after one that gave way runs whole, so batch work moves however often
        # arrivals come.
        alone = all(r.batch for r in sampled_rows + decode_rows) and not self._gave_way
        state.backend.yield_check = self._interactive_arrived if alone else None
        gave_way = state.batch_passes_yielded
        try:
            logits = rows.forward("mixed", sampled_rows + decode_rows,
                                  lambda: keep_prompt_logprobs(
                                      state.backend.prefill_and_decode(chunks, batch), chunks,
                                      sampled_rows, len(chunks) + len(batch)))
        finally:
            state.backend.yield_check = None
        self._gave_way = state.batch_passes_yielded != gave_way
        if self._gave_way:  # it counts for nothing, its figures included
            return
        elapsed = time.perf_counter() - started
        predicted = self.cost_model.predict(shape) if self.cost_model is not None else 0.0
        # A pass that computed prompt logprobs (every position's logits) is not a usual pass.
        if (self.cost_model is not None and logits is not None
                and not any(c.all_logits for c in chunks)):
            self.cost_model.observe(shape, elapsed)
        self.last_pass = {"decode_rows": len(batch), "prefill_tokens": shape.prefill_tokens,
                          "seconds": round(elapsed, 4), "predicted_s": round(predicted, 4)}
        if logits is None:
            return
        n_prefill = len(prefill_rows)
        rows.apply_prefill(prefill_rows, chunks[:n_prefill], logits[:n_prefill])
        rows.apply_decode(forced_rows + decode_rows, logits[n_prefill:])

    def _decode_rows(self, rows: list[Request]) -> list[Request]:
        """The decode rows of this pass (``docs/design.md``, "The batch service class"): every
        interactive one, and the batch ones (oldest admitted first) while the predicted pass
        stays within :func:`batch_ceiling` of the interactive rows' own, none while an
        interactive prompt is computed; the other batch rows wait, their KV blocks kept. Every
        row when no interactive row decodes (or no cost model)."""
        state, model = self.state, self.cost_model
        batch = [r for r in rows if r.batch]
        interactive = [r for r in state.active if not r.batch]
        if model is None or not batch or not (interactive or self.yielding):
            return rows
        if self.prompt_pass:
            # A pass that computes an interactive prompt carries no batch row: its first token
            # waits for nothing else (the cost model prices a decode row beside a prompt at a
            # few ms; measured, it adds 12 % to a 41-token prompt's pass). After
            # PROMPT_PASSES_WITHOUT_BATCH such passes in a row, one lets them in.
            state.batch_decode_waits += len(batch)
            return [r for r in rows if not r.batch]
        alone = PassShape(len(interactive), sum(r.num_tokens for r in interactive))
        ceiling = self._ceiling(alone)
        batch.sort(key=lambda r: r.admit_seq)
        n = batch_decode_rows(alone, [r.num_tokens for r in batch], model, ceiling)
        if not interactive:  # yielding: short passes, but one batch row at least
            n = max(n, 1)
        state.batch_decode_waits += len(batch) - n
        running = {id(r) for r in batch[:n]}
        return [r for r in rows if not r.batch or id(r) in running]

    def _batch_take(self, batch: list[Request], prefilling: list[Request], take: list[int],
                    decode: PassShape) -> list[int]:
        """Prompt tokens of the batch prefilling rows (``docs/design.md``, "The batch service
        class"): as any row's when no interactive row is in the pass (or no cost model); none
        when an interactive prompt is (``take``); else the most that keep the predicted pass
        within the interactive rows' own (their decode rows) within :func:`batch_ceiling`."""
        state, model = self.state, self.cost_model
        interactive = [r for r in state.active if not r.batch]
        if model is None or not (interactive or prefilling or self.yielding):
            return plan_prefill(_spans(batch), decode, model, self.target_itl_s,
                                state.chunk_size)
        if self.prompt_pass and any(take):  # batch prompts wait too (_decode_rows)
            return [0] * len(batch)
        attention = sum(chunk_attention(r.num_computed_tokens, n)
                        for r, n in zip(prefilling, take, strict=True) if n)
        alone = PassShape(len(interactive), sum(r.num_tokens for r in interactive), sum(take),
                          attention)
        base = PassShape(decode.decode_rows, decode.decode_context, sum(take), attention)
        # Yielding with no interactive work in the pass, batch prompts still move beside the
        # batch decode rows (which would otherwise take the whole ceiling).
        return plan_batch_prefill(_spans(batch), base, model, self._ceiling(alone),
                                  state.chunk_size,
                                  floor=MIN_PREFILL_TOKENS if alone == PassShape() else 0)

    def _ceiling(self, interactive: PassShape) -> float:
        """:func:`batch_ceiling` of the interactive rows' pass ``interactive``; of a one-row
        decode pass when there is none (yielding, :meth:`_yield_to_interactive`)."""
        config = self.state.config
        if interactive == PassShape():
            interactive = PassShape(1, 0)
        return batch_ceiling(self.cost_model, interactive, config.batch_itl_slack_fraction,
                             config.batch_itl_slack_ms / 1000.0)

    def tick_budget_stats(self) -> dict[str, Any]:
        """The mixed-batch tick's target, cost model and last pass, for stats."""
        return {
            "target_itl_ms": self.state.config.target_itl_ms,
            "prefill_token_cap": self.state.chunk_size,
            "cost_model": self.cost_model.to_dict() if self.cost_model is not None else None,
            "last_pass": dict(self.last_pass),
        }
