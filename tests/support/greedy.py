"""Greedy runs on the real model through the engine, with the tie rule for comparisons.

Floating-point summation order differs between batch shapes, so two greedy runs of one prompt may
part at a step where the reference run's two best logits are (nearly) tied. A divergence is
accepted only there (and reported); any other difference is a bug.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from inference.engine.backends.base import DecodeRow, ModelBackend, PrefillChunk
from inference.engine.config import EngineConfig
from inference.engine.llm_engine import LLMEngine
from inference.engine.request import FinalEvent, SamplingParams, TokenEvent

TIE_TOLERANCE = 1e-3


class RecordingBackend(ModelBackend):
    """Forwards to a real backend and records, per row, the top-2 logit gap of every step.

    ``gaps[row_id][i]`` is the gap behind the row's ``i``-th generated token: the final prefill
    chunk's logits give token 0, each decode step the next one.
    """

    @property
    def yield_check(self):  # the scheduler sets it here; the inner backend asks its own
        return self.inner.yield_check

    @yield_check.setter
    def yield_check(self, check) -> None:
        self.inner.yield_check = check

    def __init__(self, inner: ModelBackend):
        self.inner = inner
        self.tokenizer = inner.tokenizer
        self.vocab_size = inner.vocab_size
        self.max_model_len = inner.max_model_len
        self.fixed_pass_seconds = inner.fixed_pass_seconds
        self.cost_model_key = inner  # its pass cost is the inner backend's: calibrated once
        self.gaps: dict[str, list[float]] = defaultdict(list)
        self._last_prefill_gap: dict[str, float] = {}
        self.prefill_calls: list[list[tuple[str, int, int]]] = []
        # (position, blocks in the table) of each row of each decode call
        self.decode_calls: list[list[tuple[int, int]]] = []
        # (chunks as in prefill_calls, decode rows) of each mixed pass
        self.mixed_calls: list[tuple[list[tuple[str, int, int]], int]] = []

    def kv_bytes_per_token(self) -> int:
        return self.inner.kv_bytes_per_token()

    def allocate_kv_pool(self, num_blocks: int, block_size: int) -> None:
        self.inner.allocate_kv_pool(num_blocks, block_size)

    def copy_block(self, source: int, target: int) -> None:
        self.inner.copy_block(source, target)

    def add_row(self, row_id: str) -> None:
        self.inner.add_row(row_id)

    def remove_row(self, row_id: str) -> None:
        self.inner.remove_row(row_id)

    @property
    def serves_adapters(self) -> bool:
        return self.inner.serves_adapters

    def build_adapter(self, files, max_rank: int):
        return self.inner.build_adapter(files, max_rank)

    def set_row_adapter(self, row_id: str, weights) -> None:
        self.inner.set_row_adapter(row_id, weights)

    def prefill(self, chunks: Sequence[PrefillChunk]) -> torch.Tensor:
        logits = self.inner.prefill(chunks)
        self.prefill_calls.append([(c.row_id, c.start_pos, len(c.token_ids)) for c in chunks])
        for chunk, gap in zip(chunks, _gaps(logits), strict=True):
            # Only the final chunk's gap matters; a later chunk overwrites an earlier one.
            self._last_prefill_gap[chunk.row_id] = gap
        return logits

    def _first_gap(self, row_id: str) -> float:
        """The gap of the final prefill chunk of ``row_id``: for a choice ``<id>#<i>`` forked
        from request ``<id>``, that request's (every choice's first token comes from it)."""
        return self._last_prefill_gap[row_id.partition("#")[0]]

    def decode(self, rows: Sequence[DecodeRow]) -> torch.Tensor:
        logits = self.inner.decode(rows)
        self.decode_calls.append([(r.position, len(r.block_table)) for r in rows])
        for row, gap in zip(rows, _gaps(logits), strict=True):
            if not self.gaps[row.row_id]:
                self.gaps[row.row_id].append(self._first_gap(row.row_id))
            self.gaps[row.row_id].append(gap)
        return logits


    def prefill_and_decode(self, chunks: Sequence[PrefillChunk],
                           rows: Sequence[DecodeRow]) -> torch.Tensor:
        logits = self.inner.prefill_and_decode(chunks, rows)
        self.mixed_calls.append(([(c.row_id, c.start_pos, len(c.token_ids)) for c in chunks],
                                 len(rows)))
        if chunks:
            self.prefill_calls.append([(c.row_id, c.start_pos, len(c.token_ids)) for c in chunks])
        gaps = _gaps(logits)
        for chunk, gap in zip(chunks, gaps[:len(chunks)], strict=True):
            self._last_prefill_gap[chunk.row_id] = gap
        for row, gap in zip(rows, gaps[len(chunks):], strict=True):
            if not self.gaps[row.row_id]:
                self.gaps[row.row_id].append(self._first_gap(row.row_id))
            self.gaps[row.row_id].append(gap)
        if rows:
            self.decode_calls.append([(r.position, len(r.block_table)) for r in rows])
        return logits


def _gaps(logits: torch.Tensor) -> list[float]:
    top = torch.topk(logits.float(), 2, dim=-1).values
    return (top[:, 0] - top[:, 1]).tolist()


@dataclass
class Run:
    tokens: list[int]
    gaps: list[float]
    text: str
    final: FinalEvent


def make_engine(backend: ModelBackend, **settings) -> tuple[LLMEngine, RecordingBackend]:
    """An engine over ``backend`` (its KV pool is re-allocated) with test-sized defaults."""
    config = dict(kv_num_blocks=512, kv_block_size=16, max_batch_size=16,
                  prefill_chunk_size=256, max_pending=1000)
    config.update(settings)
    recorder = RecordingBackend(backend)
    engine = LLMEngine(EngineConfig(**config), recorder)
    if engine.scheduler.state.adapters is not None:
        # Adapters read at once: a test ticking by hand never outruns a loader thread.
        engine.scheduler.state.adapters.read_inline = True
    return engine, recorder


def run_requests(engine: LLMEngine, recorder: RecordingBackend,
                 prompts: dict[str, list[int]], sampling: SamplingParams,
                 ticks_between: int = 0, max_ticks: int = 20_000,
                 adapters: dict | None = None) -> dict[str, Run]:
    """Submit ``prompts`` in order (``ticks_between`` ticks apart) and tick until idle;
    ``adapters`` maps a request id to the LoRA adapter it runs under (AdapterSpec)."""
    tokens: dict[str, list[int]] = defaultdict(list)
    texts: dict[str, list[str]] = defaultdict(list)
    finals: dict[str, FinalEvent] = {}

    def tick() -> None:
        for event in engine.step():
            texts[event.request_id].append(event.text)
            if isinstance(event, TokenEvent):
                tokens[event.request_id].append(event.token_id)
            else:
                finals[event.request_id] = event

    for rid, prompt in prompts.items():
        engine.submit(prompt_token_ids=prompt, sampling=sampling, request_id=rid,
                      adapter=(adapters or {}).get(rid))
        for _ in range(ticks_between):
            tick()
    for _ in range(max_ticks):
        if not engine.has_work():
            break
        tick()
    assert not engine.has_work(), "engine did not finish"
    return {rid: Run(tokens[rid], list(recorder.gaps[rid]), "".join(texts[rid]), finals[rid])
            for rid in prompts}


def run_alone(backend: ModelBackend, prompt: list[int], sampling: SamplingParams,
              **settings) -> Run:
    """The reference: ``prompt`` alone in a fresh engine (monolithic prefill unless told)."""
    settings.setdefault("prefill_mode", "monolithic")
    engine, recorder = make_engine(backend, **settings)
    return run_requests(engine, recorder, {"alone": prompt}, sampling)["alone"]


def assert_same_greedy(reference: Run, got: Sequence[int], label: str, *,
                       tolerance: float = TIE_TOLERANCE) -> None:
    """Token-for-token equality, except a divergence at a near-tie of the reference's logits
    (top-2 gap below ``tolerance``).

    Raises:
        AssertionError: for a divergence where the reference's top-2 gap is >= the tolerance.
    """
    ref = reference.tokens
    for i, (a, b) in enumerate(zip(ref, got, strict=False)):
        if a != b:
            gap = reference.gaps[i]
            assert gap < tolerance, (
                f"{label}: token {i} differs ({b} instead of {a}) where the reference's two best "
                f"logits are {gap:.2e} apart (not a tie)")
            warnings.warn(f"{label}: accepted divergence at token {i}, top-2 gap {gap:.2e}",
                          stacklevel=2)
            return
    assert len(ref) == len(got), f"{label}: {len(got)} tokens instead of {len(ref)}"
