"""Model backends behind :class:`inference.engine.backends.base.ModelBackend`."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from inference.engine.backends.base import ModelBackend
    from inference.engine.config import EngineConfig


def load_backend(config: EngineConfig) -> ModelBackend:
    """The backend named by ``BACKEND``: ``transformers`` (the real model) or ``reference``.

    Raises:
        ValueError: for an unknown backend name.
        inference.engine.model_store.ModelLoadError: for a missing or broken model.
    """
    name = config.backend.lower()
    if name == "reference":
        from inference.engine.backends.reference import ReferenceBackend

        return ReferenceBackend(max_model_len=config.max_model_len or 8192,
                                step_delay_s=config.reference_step_delay_s)
    if name in ("transformers", "hf"):
        from inference.engine.backends.hf import TransformersBackend

        return TransformersBackend.from_config(config)
    raise ValueError(f"unknown BACKEND={config.backend!r}; use 'transformers' or 'reference'")
