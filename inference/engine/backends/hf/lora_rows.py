"""Which LoRA adapter each row of the transformers backend runs under
(:mod:`inference.engine.lora`): a base class of
:class:`~inference.engine.backends.hf.backend.TransformersBackend`.

The scheduler binds an admitted row to its adapter's loaded weights
(:meth:`_LoraRows.set_row_adapter`); each pass groups its rows by adapter into
:class:`~inference.engine.lora.LoraSegment` lists (:meth:`_LoraRows._lora_segments`), which the
forward pass adds after each projection (:func:`inference.engine.lora.add_deltas`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from inference.engine.lora import (
    AdapterFiles,
    AdapterWeights,
    LoraSegment,
    ModelShape,
    build_adapter,
    segments,
)


class _LoraRows:
    """LoRA adapters per row (module docstring); the backend sets the model's sizes."""

    serves_adapters = True
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    _model: Any

    def build_adapter(self, files: AdapterFiles, max_rank: int) -> AdapterWeights:
        """An adapter's files laid out for this model, in its compute dtype (fp32 under
        ``QUANTIZATION=q4_1``), on the compute thread.

        Raises:
            inference.engine.lora.AdapterError: it does not fit the model.
        """
        cfg = self._model.config
        shape = ModelShape.of(self.num_layers, int(cfg.hidden_size), int(cfg.intermediate_size),
                              self.num_heads, self.num_kv_heads, self.head_dim)
        return build_adapter(files, shape, self.dtype, max_rank)

    def set_row_adapter(self, row_id: str, weights: AdapterWeights) -> None:
        """Run row ``row_id`` under ``weights`` until :meth:`remove_row`."""
        self._row_adapters()[row_id] = weights

    def remove_row(self, row_id: str) -> None:
        """A row leaves the batch: it runs under no adapter any more."""
        self._row_adapters().pop(row_id, None)

    def _row_adapters(self) -> dict[str, AdapterWeights]:
        rows = self.__dict__.get("_adapters_by_row")
        if rows is None:
            rows = self.__dict__["_adapters_by_row"] = {}
        return rows

    def _lora_segments(self, row_ids: Sequence[str], row_tokens: Sequence[int]
                       ) -> tuple[list[LoraSegment], list[AdapterWeights | None]]:
        """The adapter segments of a pass over rows ``row_ids`` (in pass order) of
        ``row_tokens`` new tokens each, and each token's adapter (None: the bare model);
        ``([], [])`` when no row runs under an adapter."""
        by_row = self.__dict__.get("_adapters_by_row")
        if not by_row:
            return [], []
        adapters = [by_row.get(r) for r in row_ids]
        found = segments(adapters, row_tokens)
        if not found:
            return [], []
        tokens = [w for w, n in zip(adapters, row_tokens, strict=True) for _ in range(n)]
        return found, tokens
