"""Engine configuration: one object, read from environment variables, validated at construction.

Every field maps to an environment variable of the same name in upper case (``MAX_QUEUE_SIZE``,
``MAX_BATCH_SIZE``, ``PREFILL_CHUNK_SIZE``, ``PREFILL_MODE``, ``ACTIVE_KV_BUDGET``,
``KV_BLOCK_SIZE``, ``KV_NUM_BLOCKS``, ``SCHEDULING_POLICY``, ``VTC_INPUT_WEIGHT``,
``VTC_OUTPUT_WEIGHT``, ...). Names follow ``shared/design/scheduler.md``.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class PrefillMode(StrEnum):
    """How a prompt is pushed through the model (scheduler.md section 5)."""

    MONOLITHIC = "monolithic"
    CHUNKED = "chunked"
    # Reserved names: accepted by the parser so the error can say they are not implemented.
    MIXED_BATCH = "mixed_batch"
    DISAGGREGATED = "disaggregated"


IMPLEMENTED_PREFILL_MODES = (PrefillMode.MONOLITHIC, PrefillMode.CHUNKED)


class SchedulingPolicyName(StrEnum):
    """The admission-order policies of scheduler.md section 3."""

    FCFS = "fcfs"
    VTC = "vtc"


class EngineConfig(BaseSettings):
    """Scheduler, KV cache and model settings of one inference engine.

    Units: sizes in tokens unless named ``*_bytes``; times in seconds.

    Raises:
        pydantic.ValidationError: at construction, for an unknown or unimplemented
            ``PREFILL_MODE``, a non-positive size, or an active-KV budget that does not fit in the
            KV block pool (counting each row's rounding up to whole blocks).
    """

    model_config = SettingsConfigDict(case_sensitive=False, extra="ignore", frozen=True)

    # Gate 1: requests accepted and not yet admitted.
    max_queue_size: int = Field(256, ge=1, description="Bound of the pending queue (gate 1).")
    # Rows holding KV: decode rows plus rows still being prefilled.
    max_batch_size: int = Field(32, ge=1, description="Rows in the batch, prefilling included.")
    # 0 means monolithic prefill when PREFILL_MODE is empty.
    prefill_chunk_size: int = Field(256, ge=0, description="Prompt tokens per prefill chunk.")
    prefill_mode: PrefillMode | None = Field(
        None, description="monolithic or chunked; empty derives it from PREFILL_CHUNK_SIZE."
    )
    kv_block_size: int = Field(16, ge=1, description="Tokens per KV block.")
    kv_num_blocks: int = Field(
        2048, ge=0, description="KV blocks in the pool; 0 derives it from KV_CACHE_BYTES."
    )
    kv_cache_bytes: int = Field(
        0, ge=0, description="Memory for the KV pool in bytes; used when KV_NUM_BLOCKS is 0."
    )
    # Gate 2. 0 derives the largest budget that the pool can always hold.
    active_kv_budget: int = Field(
        0, ge=0, description="Max sum of prompt_len + max_tokens over admitted rows (tokens)."
    )
    enable_prefix_caching: bool = True
    scheduling_policy: SchedulingPolicyName = SchedulingPolicyName.FCFS
    vtc_input_weight: float = Field(1.0, gt=0, description="VTC cost of one computed prompt token.")
    vtc_output_weight: float = Field(2.0, gt=0, description="VTC cost of one generated token.")
    # A request still pending after this long ends with a `queue_timeout` error. 0 disables it.
    max_queue_wait_s: float = Field(0.0, ge=0)
    # 0 means the backend's own context length.
    max_model_len: int = Field(0, ge=0)

    # The model. BACKEND=reference is a deterministic model-free backend for tests.
    backend: str = Field("transformers", description="transformers or reference")
    model_path: str = Field("", description="Local Hugging Face causal-LM folder; empty: default.")
    device: str = Field("auto", description="auto (CUDA, then MPS, then CPU), cpu, cuda, mps.")
    dtype: str = Field("auto", description="auto (fp32 on CPU), float32, float16, bfloat16.")
    # BACKEND=reference only: seconds each forward pass takes, to emulate a real model's pace.
    reference_step_delay_s: float = Field(0.0, ge=0)

    @field_validator("prefill_mode", mode="before")
    @classmethod
    def _empty_mode_is_derived(cls, value: object) -> object:
        return None if value in ("", None) else value

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        mode = self.effective_prefill_mode
        if mode not in IMPLEMENTED_PREFILL_MODES:
            raise ValueError(
                f"PREFILL_MODE={mode.value!r} is reserved but not implemented; "
                f"use one of {[m.value for m in IMPLEMENTED_PREFILL_MODES]}"
            )
        if mode is PrefillMode.CHUNKED and self.prefill_chunk_size < 1:
            raise ValueError("PREFILL_MODE=chunked needs PREFILL_CHUNK_SIZE >= 1")
        if self.kv_num_blocks == 0 and self.kv_cache_bytes == 0:
            raise ValueError("set KV_NUM_BLOCKS or KV_CACHE_BYTES (both are 0)")
        if self.kv_num_blocks and self.active_kv_budget:
            self.check_budget_fits(self.kv_num_blocks)
        return self

    @property
    def effective_prefill_mode(self) -> PrefillMode:
        """The prefill mode in force: ``PREFILL_MODE``, or derived from ``PREFILL_CHUNK_SIZE``."""
        if self.prefill_mode is not None:
            return self.prefill_mode
        return PrefillMode.CHUNKED if self.prefill_chunk_size > 0 else PrefillMode.MONOLITHIC

    def max_blocks_for_budget(self, budget_tokens: int) -> int:
        """Blocks that rows summing to ``budget_tokens`` can hold at most (tokens -> blocks).

        Each of at most ``max_batch_size`` rows rounds up to whole blocks, wasting at most
        ``kv_block_size - 1`` token slots.
        """
        bs = self.kv_block_size
        return (budget_tokens + self.max_batch_size * (bs - 1)) // bs

    def resolved_budget(self, num_blocks: int) -> int:
        """The active-KV budget in tokens for a pool of ``num_blocks`` blocks.

        Raises:
            ValueError: if the configured budget does not fit in the pool, or the pool is too
                small to hold even one block per row.
        """
        if self.active_kv_budget:
            self.check_budget_fits(num_blocks)
            return self.active_kv_budget
        budget = num_blocks * self.kv_block_size - self.max_batch_size * (self.kv_block_size - 1)
        if budget < 1:
            raise ValueError(
                f"KV pool of {num_blocks} blocks x {self.kv_block_size} tokens is too small for "
                f"MAX_BATCH_SIZE={self.max_batch_size}"
            )
        return budget

    def check_budget_fits(self, num_blocks: int) -> None:
        """Raise ``ValueError`` unless ``active_kv_budget`` always fits in ``num_blocks`` blocks."""
        need = self.max_blocks_for_budget(self.active_kv_budget)
        if need > num_blocks:
            raise ValueError(
                f"ACTIVE_KV_BUDGET={self.active_kv_budget} tokens can need {need} KV blocks "
                f"({self.max_batch_size} rows rounding up to {self.kv_block_size}-token blocks), "
                f"but the pool has {num_blocks}; lower the budget or raise KV_NUM_BLOCKS"
            )
