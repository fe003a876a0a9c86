"""The small interface through which the scheduler drives a model.

The scheduler owns the KV block pool's bookkeeping (which physical block holds which tokens of
which row, see :mod:`inference.engine.kv_cache`); a backend owns the tensors behind it and computes
logits. A backend is called from the engine's single worker thread only.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch


class Tokenizer(Protocol):
    """Text <-> token ids for one model."""

    eos_token_ids: frozenset[int]

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""
        ...

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids``, special tokens skipped; a partial character shows as U+FFFD."""
        ...

    def apply_chat_template(self, messages: Sequence[dict[str, Any]],
                            tools: Sequence[Any] | None = None) -> list[int]:
        """Prompt ids for chat ``messages`` (``role``/``content``, and a tool call's or a tool
        result's fields) offering ``tools`` (OpenAI's function tools, or None), generation prompt
        added (:mod:`inference.tokenization.chat_tools`)."""
        ...


@dataclass(frozen=True)
class PrefillChunk:
    """Prompt tokens ``[start_pos, start_pos + len(token_ids))`` of one row, to run now.

    ``block_table`` covers at least ``start_pos + len(token_ids)`` token slots; the KV of positions
    before ``start_pos`` is already in those blocks (earlier chunks or prefix-cache hits).
    ``all_logits``: the pass also returns the logits of the chunk's other tokens (a request
    that asked for its prompt's logprobs), after its usual rows (:meth:`ModelBackend.prefill`).
    """

    row_id: str
    token_ids: Sequence[int]
    start_pos: int
    block_table: Sequence[int]
    all_logits: bool = False


@dataclass(frozen=True)
class DecodeRow:
    """One decode row: feed ``token_id`` at ``position``; its KV is written into ``block_table``."""

    row_id: str
    token_id: int
    position: int
    block_table: Sequence[int]


class PassYielded(Exception):  # noqa: N818 - not an error: the pass gave way
    """A pass of batch rows alone stopped between layers because an interactive request
    arrived (:attr:`ModelBackend.yield_check`): nothing of it counts, and the K/V it wrote is
    written again, the same, by the pass that computes those tokens later."""


class ModelBackend(ABC):
    """A causal LM behind the scheduler: prefill chunks, decode the batch, add and remove rows.

    Subclasses set ``tokenizer``, ``vocab_size`` and ``max_model_len`` (tokens).
    """

    tokenizer: Tokenizer
    vocab_size: int
    max_model_len: int
    # A backend whose every pass takes the same time whatever it holds (a test backend) gives
    # it here (seconds); None: the engine measures the backend's pass cost at start-up.
    fixed_pass_seconds: float | None = None
    # Set by the scheduler for the duration of a pass of batch rows alone (None otherwise): a
    # backend that can stop a pass between its layers asks it there and raises PassYielded
    # when it answers True (an interactive request waits for the next pass).
    yield_check: Callable[[], bool] | None = None

    @abstractmethod
    def kv_bytes_per_token(self) -> int:
        """Bytes of KV cache one token takes across all layers (sizes the pool from a budget)."""

    @abstractmethod
    def allocate_kv_pool(self, num_blocks: int, block_size: int) -> None:
        """Allocate the KV pool once: ``num_blocks`` blocks of ``block_size`` token slots."""

    def add_row(self, row_id: str) -> None:  # noqa: B027 - optional hook
        """A row joins the batch (before its first prefill chunk)."""

    def remove_row(self, row_id: str) -> None:  # noqa: B027 - optional hook
        """A row leaves the batch; its blocks may be reused by other rows afterwards."""

    # Whether the backend runs rows under LoRA adapters (build_adapter, set_row_adapter).
    serves_adapters: bool = False

    def build_adapter(self, files: Any, max_rank: int) -> Any:
        """Lay out an adapter's read files (:class:`inference.engine.lora.AdapterFiles`) as
        this model's :class:`inference.engine.lora.AdapterWeights`, on the compute thread.

        Raises:
            inference.engine.lora.AdapterError: it does not fit the model; this backend
                serves no adapters.
        """
        from inference.engine.lora import AdapterError

        raise AdapterError(f"{type(self).__name__} serves no LoRA adapters")

    def set_row_adapter(self, row_id: str, weights: Any) -> None:
        """Run row ``row_id`` (added) under ``weights`` (an
        :class:`inference.engine.lora.AdapterWeights`) until it is removed."""
        raise NotImplementedError(f"{type(self).__name__} serves no LoRA adapters")

    def copy_block(self, source: int, target: int) -> None:
        """Copy the KV of every token slot of block ``source`` into block ``target``
        (copy-on-write of a prompt's last, partial block when a request forks into ``n``
        choices; the slots ``target`` then takes are overwritten by its own row).

        Raises:
            NotImplementedError: a backend that cannot copy blocks serves no ``n`` > 1 request
                whose prompt ends inside a block.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot copy a KV block")

    @abstractmethod
    def prefill(self, chunks: Sequence[PrefillChunk]) -> torch.Tensor:
        """Run prompt chunks and write their KV into the pool.

        Returns:
            ``[len(chunks) + extra, vocab_size]`` float logits: each chunk's last token, then,
            for each chunk with ``all_logits`` in order, its other tokens' in position order
            (``extra`` is the sum of their ``len(token_ids) - 1``; 0 when no chunk asks).
        """

    @abstractmethod
    def decode(self, rows: Sequence[DecodeRow]) -> torch.Tensor:
        """One batched forward pass, one token per row, writing each row's KV into the pool.

        Returns:
            ``[len(rows), vocab_size]`` float logits for each row's next token.
        """

    def prefill_and_decode(self, chunks: Sequence[PrefillChunk],
                           rows: Sequence[DecodeRow]) -> torch.Tensor:
        """Prompt chunks and decode rows of one tick (``PREFILL_MODE=mixed_batch``).

        A backend that can run both in one forward pass overrides this; this default runs
        :meth:`prefill` and then :meth:`decode`.

        Returns:
            ``[len(chunks) + len(rows) + extra, vocab_size]`` float logits: each chunk's last
            token, then each decode row's next token, then the ``extra`` rows of the chunks
            with ``all_logits`` as :meth:`prefill` gives them.
        """
        if not chunks:
            return self.decode(rows) if rows else torch.empty(0, self.vocab_size)
        prefill = self.prefill(chunks)
        if not rows:
            return prefill
        n = len(chunks)
        return torch.cat([prefill[:n], self.decode(rows), prefill[n:]])
