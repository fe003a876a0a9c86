"""Engine configuration: validation at construction, and the worker's environment variables."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from inference.engine.backends.reference import ReferenceBackend
from inference.engine.config import EngineConfig, PrefillMode
from inference.engine.llm_engine import LLMEngine
from inference.worker.settings import WorkerSettings


def test_the_worker_reads_the_engine_settings_from_environment_variables(monkeypatch):
    monkeypatch.setenv("MAX_BATCH_SIZE", "3")
    monkeypatch.setenv("PREFILL_CHUNK_SIZE", "32")
    monkeypatch.setenv("KV_BLOCK_SIZE", "8")
    monkeypatch.setenv("KV_NUM_BLOCKS", "100")
    monkeypatch.setenv("SCHEDULING_POLICY", "fcfs")
    monkeypatch.setenv("VTC_OUTPUT_WEIGHT", "3")
    config = WorkerSettings().engine_config()
    assert (config.max_batch_size, config.prefill_chunk_size) == (3, 32)
    assert (config.kv_block_size, config.kv_num_blocks) == (8, 100)
    assert config.scheduling_policy == "fcfs" and config.vtc_output_weight == 3


def test_the_engine_library_reads_no_environment_variable(monkeypatch):
    monkeypatch.setenv("MAX_BATCH_SIZE", "3")
    monkeypatch.setenv("SCHEDULING_POLICY", "vtc")
    config = EngineConfig()
    assert config.max_batch_size == 32 and config.scheduling_policy == "fcfs"


def test_the_worker_runs_the_fair_policy_unless_told_otherwise(monkeypatch):
    monkeypatch.delenv("SCHEDULING_POLICY", raising=False)
    assert WorkerSettings().engine_config().scheduling_policy == "vtc"


def test_max_queue_size_is_gate_one_only_and_the_worker_bound_is_worker_prefetch(monkeypatch):
    monkeypatch.setenv("MAX_QUEUE_SIZE", "4")
    monkeypatch.setenv("MAX_BATCH_SIZE", "6")
    monkeypatch.delenv("WORKER_PREFETCH", raising=False)
    monkeypatch.delenv("WORKER_BATCH_PREFETCH", raising=False)
    settings = WorkerSettings()
    assert settings.max_queue_size == 4  # gate 1, read by the web tier too; not the engine's
    # The engine holds a batch's worth and the prefetch taken beyond free rows for each service
    # class: 1 interactive request by default, a batch's worth of batch lines.
    assert settings.worker_prefetch == 1
    assert settings.batch_prefetch() == 6
    assert settings.engine_config().max_pending == (6 + 1) + (6 + 6)
    monkeypatch.setenv("WORKER_PREFETCH", "3")
    monkeypatch.setenv("WORKER_BATCH_PREFETCH", "2")
    assert WorkerSettings().engine_config().max_pending == (6 + 3) + (6 + 2)


def test_a_misspelt_engine_setting_is_refused():
    with pytest.raises(ValidationError, match="max_batch"):
        EngineConfig(max_batch=4)


@pytest.mark.parametrize(("chunk", "mode", "expected"), [
    (256, "", PrefillMode.MIXED_BATCH), (0, "", PrefillMode.MONOLITHIC),
    (256, "monolithic", PrefillMode.MONOLITHIC), (16, "chunked", PrefillMode.CHUNKED),
    (16, "mixed_batch", PrefillMode.MIXED_BATCH)])
def test_an_empty_prefill_mode_is_derived_from_the_chunk_size(monkeypatch, chunk, mode, expected):
    assert EngineConfig(prefill_chunk_size=chunk, prefill_mode=mode).effective_prefill_mode \
        is expected
    monkeypatch.setenv("PREFILL_MODE", mode)
    monkeypatch.setenv("PREFILL_CHUNK_SIZE", str(chunk))
    assert WorkerSettings().engine_config().effective_prefill_mode is expected


def test_a_reserved_prefill_mode_fails_at_construction():
    with pytest.raises(ValidationError, match="reserved but not implemented"):
        EngineConfig(prefill_mode="disaggregated")


@pytest.mark.parametrize("mode", ["chunked", "mixed_batch"])
def test_a_chunking_mode_without_a_chunk_size_is_refused(mode):
    with pytest.raises(ValidationError, match=f"PREFILL_MODE={mode} needs PREFILL_CHUNK_SIZE"):
        EngineConfig(prefill_mode=mode, prefill_chunk_size=0)


def test_the_itl_target_is_read_from_the_environment_and_must_not_be_negative(monkeypatch):
    monkeypatch.setenv("TARGET_ITL_MS", "80")
    assert WorkerSettings().engine_config().target_itl_ms == 80
    with pytest.raises(ValidationError, match="target_itl_ms"):
        EngineConfig(target_itl_ms=-1)


def test_an_unknown_prefill_mode_fails_at_construction(monkeypatch):
    with pytest.raises(ValidationError, match="prefill_mode"):
        EngineConfig(prefill_mode="speculative")
    monkeypatch.setenv("PREFILL_MODE", "speculative")
    with pytest.raises(ValidationError, match="prefill_mode"):
        WorkerSettings()


def test_a_budget_that_does_not_fit_in_the_pool_fails_with_the_numbers():
    # 10 blocks x 4 tokens; rows of 37 tokens in all take at most 10 blocks (e.g. 1 + 36:
    # 1 + 9 blocks, 5 + 32: 2 + 8), but 38 tokens can take 11 (5 + 33: 2 + 9).
    EngineConfig(kv_num_blocks=10, kv_block_size=4, max_batch_size=2, active_kv_budget=37)
    with pytest.raises(ValidationError, match="ACTIVE_KV_BUDGET=38 tokens can need 11 KV blocks"):
        EngineConfig(kv_num_blocks=10, kv_block_size=4, max_batch_size=2, active_kv_budget=38)


def test_a_pool_sized_in_bytes_is_checked_when_the_engine_is_built():
    config = EngineConfig(backend="reference", kv_num_blocks=0, kv_cache_bytes=8 * 4 * 10,
                          kv_block_size=4, max_batch_size=2, active_kv_budget=38)
    with pytest.raises(ValueError, match="the pool has 10"):
        LLMEngine(config, ReferenceBackend())
    config = EngineConfig(backend="reference", kv_num_blocks=0, kv_cache_bytes=8 * 4 * 10,
                          kv_block_size=4, max_batch_size=2)
    assert LLMEngine(config, ReferenceBackend()).stats()["kv_blocks_total"] == 10


@pytest.mark.parametrize("field", ["max_batch_size", "kv_block_size", "max_pending"])
def test_sizes_must_be_positive(field):
    with pytest.raises(ValidationError, match=field):
        EngineConfig(**{field: 0})
