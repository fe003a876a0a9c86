"""LoRA adapters through the engine on the real model: each adapter's greedy answer is
``peft``'s merged model's, alone and in a pass mixing adapters with bare-model rows; the prefix
cache never crosses adapters; the adapter pool loads, evicts and fails one adapter's requests
only."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch

from benchmarks.harness.adapters import make_adapter, merged_model
from inference.engine.backends.base import DecodeRow, PrefillChunk
from inference.engine.backends.hf import forward
from inference.engine.backends.hf.backend import TransformersBackend
from inference.engine.llm_engine import InvalidRequestError
from inference.engine.lora import ModelShape, build_adapter, read_adapter_files
from inference.engine.model_store import default_gguf_path, resolve_model_path
from inference.engine.request import ErrorCode, FinishReason, SamplingParams
from tests.support.greedy import assert_same_greedy, make_engine, run_requests
from tests.support.lora import greedy_reference

pytestmark = [pytest.mark.model, pytest.mark.slow]

GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)
# bf16 against fp32 under the same adapter, teacher-forced over real text: the tolerances of the
# bare model's bf16 test (tests/engine/backends/test_bf16.py), which an adapter must keep.
BF16_MAX_ABS, BF16_MEAN_ABS = 2.5, 0.3


@pytest.fixture(scope="module")
def folder() -> Path:
    return resolve_model_path("")


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, folder):
    """Three adapters on every attention and MLP projection: ranks 8, 16 and 8."""
    root = tmp_path_factory.mktemp("adapters")
    return [make_adapter(folder, root / f"a{i}", rank=rank, seed=10 + i)
            for i, rank in enumerate((8, 16, 8))]


@pytest.fixture(scope="module")
def references(folder, adapters, chat_prompt):
    """The greedy answer of the bare model and of each adapter's merged model (fp32)."""
    out = {"base": greedy_reference(merged_model(folder, None), chat_prompt, GREEDY.max_tokens)}
    for spec in adapters:
        model = merged_model(folder, Path(spec.path))
        out[spec.digest] = greedy_reference(model, chat_prompt, GREEDY.max_tokens)
    return out


@pytest.fixture(params=["native", "torch"])
def deltas(request, monkeypatch):
    """Each test twice: the adapters' deltas by the native kernel (passes of up to
    NATIVE_LORA_MAX_TOKENS tokens), and all in PyTorch."""
    if request.param == "torch":
        monkeypatch.setattr(forward, "NATIVE_LORA_MAX_TOKENS", 0)
    return request.param


def test_each_adapter_changes_the_answer_and_equals_peft_merged_alone(
        backend, adapters, references, chat_prompt, deltas):
    for spec in adapters:
        assert references[spec.digest].tokens != references["base"].tokens
        engine, recorder = make_engine(backend, prefill_mode="monolithic")
        run = run_requests(engine, recorder, {"one": chat_prompt}, GREEDY,
                           adapters={"one": spec})["one"]
        assert run.final.finish_reason is FinishReason.LENGTH
        assert_same_greedy(references[spec.digest], run.tokens, f"rank {spec.rank} alone")


@pytest.mark.parametrize("mode", ["mixed_batch", "chunked"])
def test_a_batch_mixing_three_adapters_with_base_rows_equals_each_alone(
        backend, adapters, references, chat_prompt, corpus_ids, mode, deltas):
    engine, recorder = make_engine(backend, prefill_mode=mode, prefill_chunk_size=32)
    prompts = {"base0": chat_prompt, "a0": chat_prompt, "base1": chat_prompt,
               "a1": chat_prompt, "a2": chat_prompt, "a0-again": chat_prompt,
               "long-base": corpus_ids[:300]}
    specs = {"a0": adapters[0], "a1": adapters[1], "a2": adapters[2],
             "a0-again": adapters[0]}
    runs = run_requests(engine, recorder, prompts, GREEDY, ticks_between=1, adapters=specs)
    # Rows of several adapters and of the bare model shared passes.
    assert any(len(rows) >= 4 for rows in recorder.decode_calls)
    for rid in ("base0", "base1"):
        assert_same_greedy(references["base"], runs[rid].tokens, f"{mode} {rid}")
    for rid, spec in specs.items():
        assert_same_greedy(references[spec.digest], runs[rid].tokens, f"{mode} {rid}")


def test_a_prefix_computed_under_one_adapter_is_reused_only_under_the_same(
        backend, adapters, corpus_ids):
    engine, recorder = make_engine(backend, prefill_mode="monolithic")
    prompt = corpus_ids[:160]
    order = [("a0", adapters[0]), ("base", None), ("a1", adapters[1]), ("a0-again", adapters[0]),
             ("base-again", None)]
    cached = {}
    for rid, spec in order:
        run = run_requests(engine, recorder, {rid: prompt}, SamplingParams(max_tokens=2),
                           adapters={rid: spec})[rid]
        cached[rid] = run.final.usage.cached_prompt_tokens
    assert cached["a0"] == cached["base"] == cached["a1"] == 0
    assert cached["a0-again"] >= 144 and cached["base-again"] >= 144


def test_the_pool_loads_and_evicts_within_its_bound_and_loses_no_request(
        backend, adapters, references, chat_prompt, tmp_path, folder):
    extra = [make_adapter(folder, tmp_path / f"x{i}", rank=8, seed=50 + i) for i in range(2)]
    pool_adapters = [*adapters, *extra]  # five adapters through a pool of two
    engine, recorder = make_engine(backend, max_loras=2, max_batch_size=3,
                                   prefill_mode="mixed_batch")
    pool = engine.scheduler.state.adapters
    prompts, specs = {}, {}
    for i in range(12):
        rid = f"r{i}"
        prompts[rid] = chat_prompt
        if i % 4 != 3:  # every fourth request runs on the bare model
            specs[rid] = pool_adapters[i % len(pool_adapters)]
    peak = 0
    for rid, prompt in prompts.items():
        engine.submit(prompt_token_ids=prompt, sampling=GREEDY, request_id=rid,
                      adapter=specs.get(rid))
    finals = {}
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    for _ in range(5000):
        if not engine.has_work():
            break
        for event in engine.step():
            if hasattr(event, "token_id"):
                tokens[event.request_id].append(event.token_id)
            else:
                finals[event.request_id] = event
        peak = max(peak, len(pool.stats()["loaded"]))
    assert set(finals) == set(prompts), "every request ends exactly once"
    assert all(f.finish_reason is FinishReason.LENGTH for f in finals.values())
    assert peak <= 2
    stats = engine.stats()["adapters"]
    assert stats["evictions"] >= 3 and stats["loads"] >= 5 and stats["load_failures"] == 0
    for rid, spec in specs.items():
        if spec.digest in references:
            assert_same_greedy(references[spec.digest], tokens[rid], f"pooled {rid}")


def test_an_adapter_that_fails_to_load_fails_only_its_requests(
        backend, adapters, references, chat_prompt, tmp_path, folder):
    broken = make_adapter(folder, tmp_path / "broken", rank=8, seed=99)
    (Path(broken.path) / "adapter_model.safetensors").write_bytes(b"changed since validated")
    missing = dataclasses.replace(adapters[0], path=str(tmp_path / "gone"),
                                  digest="0" * 64, name="base:gone")
    engine, recorder = make_engine(backend, prefill_mode="mixed_batch")
    prompts = {"ok": chat_prompt, "broken": chat_prompt, "missing": chat_prompt,
               "base": chat_prompt}
    runs = run_requests(engine, recorder, prompts, GREEDY, adapters={
        "ok": adapters[1], "broken": broken, "missing": missing})
    for rid in ("broken", "missing"):
        final = runs[rid].final
        assert final.finish_reason is FinishReason.ERROR and not runs[rid].tokens
        assert final.error.code is ErrorCode.ADAPTER_UNAVAILABLE
        assert final.error.details["param"] == "model"
    assert "changed since it was validated" in runs["broken"].final.error.message
    assert_same_greedy(references[adapters[1].digest], runs["ok"].tokens, "beside failures")
    assert_same_greedy(references["base"], runs["base"].tokens, "base beside failures")


def test_an_engine_without_adapters_refuses_one_and_a_folder_outside_the_root_fails(
        backend, adapters, chat_prompt, tmp_path):
    engine, _ = make_engine(backend, max_loras=0)
    with pytest.raises(InvalidRequestError) as refused:
        engine.submit(prompt_token_ids=chat_prompt, sampling=GREEDY, adapter=adapters[0])
    assert refused.value.error.details["param"] == "model"
    engine, recorder = make_engine(backend)
    engine.scheduler.state.adapters.root = tmp_path.resolve()  # the adapters lie elsewhere
    run = run_requests(engine, recorder, {"out": chat_prompt}, GREEDY,
                       adapters={"out": adapters[0]})["out"]
    assert run.final.error.code is ErrorCode.ADAPTER_UNAVAILABLE
    assert "ADAPTER_ROOT" in run.final.error.message


def _teacher_forced(b: TransformersBackend, weights, corpus_ids: list[int]) -> torch.Tensor:
    b.allocate_kv_pool(64, 16)
    for row in ("r0", "r1"):
        if weights is not None:
            b.set_row_adapter(row, weights)
    logits = [b.prefill([PrefillChunk("r0", corpus_ids[:90], 0, list(range(32))),
                         PrefillChunk("r1", corpus_ids[300:340], 0, list(range(32, 64)))])]
    for step in range(8):
        logits.append(b.decode([DecodeRow("r0", corpus_ids[90 + step], 90 + step,
                                          list(range(32))),
                                DecodeRow("r1", corpus_ids[340 + step], 40 + step,
                                          list(range(32, 64)))]))
    for row in ("r0", "r1"):
        b.remove_row(row)
    return torch.cat(logits)


@pytest.mark.skipif(os.environ.get("LLM_SKIP_BF16") == "1", reason="bf16 tests switched off")
def test_an_adapter_in_bf16_tracks_it_in_fp32(backend, adapters, corpus_ids, deltas):
    bf16 = TransformersBackend.from_pretrained(resolve_model_path(""), device="cpu",
                                               dtype="bfloat16")
    files = read_adapter_files(adapters[1].path, adapters[1].digest, 1 << 30)
    shape = ModelShape.of(30, 576, 1536, 9, 3, 64)
    ref = _teacher_forced(backend, build_adapter(files, shape, torch.float32, 64), corpus_ids)
    ours = _teacher_forced(bf16, build_adapter(files, shape, torch.bfloat16, 64), corpus_ids)
    diff = (ours - ref).abs()
    agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    stats = f"max {diff.max().item():.3f}, mean {diff.mean().item():.3f}, top-1 {agree:.0%}"
    print(f"bf16 vs fp32 under a rank-16 adapter, deltas {deltas}: {stats}")
    assert diff.max().item() < BF16_MAX_ABS and diff.mean().item() < BF16_MEAN_ABS, stats
    assert agree >= 0.9, stats


def test_an_adapter_over_q4_1_weights_applies_its_delta(backend, adapters, corpus_ids, deltas):
    """QUANTIZATION=q4_1 serves adapters too (their deltas in fp32 over the Q4_1 projections):
    under the adapter, q4_1's logits are much nearer fp32's under it than q4_1's bare ones."""
    q4 = TransformersBackend.from_pretrained(resolve_model_path(""), device="cpu",
                                             quantization="q4_1",
                                             quantized_weights=default_gguf_path())
    files = read_adapter_files(adapters[0].path, adapters[0].digest, 1 << 30)
    shape = ModelShape.of(30, 576, 1536, 9, 3, 64)
    weights = build_adapter(files, shape, torch.float32, 64)
    want = _teacher_forced(backend, weights, corpus_ids)
    got = _teacher_forced(q4, weights, corpus_ids)
    bare = _teacher_forced(q4, None, corpus_ids)
    near, far = (got - want).abs().mean().item(), (bare - want).abs().mean().item()
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    print(f"q4_1 under a rank-8 adapter vs fp32 under it, deltas {deltas}: mean |diff| {near:.3f} "
          f"(bare q4_1: {far:.3f}), top-1 {agree:.0%}")
    assert near < far / 3 and agree >= 0.8


def test_an_adapter_whose_layout_fails_unexpectedly_fails_its_requests_not_the_batch(
        backend, adapters, references, chat_prompt, monkeypatch):
    engine, recorder = make_engine(backend, prefill_mode="mixed_batch")
    build = backend.build_adapter

    def flaky(files, max_rank):
        if files.digest == adapters[2].digest:
            raise MemoryError("no room for it")
        return build(files, max_rank)

    monkeypatch.setattr(backend, "build_adapter", flaky)
    runs = run_requests(engine, recorder, {"ok": chat_prompt, "bad": chat_prompt,
                                           "base": chat_prompt}, GREEDY, ticks_between=2,
                        adapters={"ok": adapters[0], "bad": adapters[2]})
    bad = runs["bad"].final
    assert bad.error.code is ErrorCode.ADAPTER_UNAVAILABLE and "MemoryError" in bad.error.message
    assert_same_greedy(references[adapters[0].digest], runs["ok"].tokens, "beside it")
    assert_same_greedy(references["base"], runs["base"].tokens, "base beside it")


def test_two_adapters_sharing_a_weights_file_are_two_adapters(
        backend, adapters, chat_prompt, tmp_path):
    """The same weights under another config (lora_alpha quartered), registered under another
    name: its own answer, whichever loads first (the pool keys adapters by name, registry
    revision and digest, not by the weights' digest alone)."""
    import json
    import shutil

    source = Path(adapters[1].path)
    copy = tmp_path / "quarter"
    shutil.copytree(source, copy)
    config = json.loads((copy / "adapter_config.json").read_text())
    config["lora_alpha"] = config["lora_alpha"] / 4
    (copy / "adapter_config.json").write_text(json.dumps(config))
    quarter = dataclasses.replace(adapters[1], name="base:quarter", path=str(copy))
    assert quarter.key != adapters[1].key and quarter.digest == adapters[1].digest
    answers = {}
    for order in ((adapters[1], quarter), (quarter, adapters[1])):
        engine, recorder = make_engine(backend, prefill_mode="mixed_batch")
        runs = run_requests(engine, recorder, {"first": chat_prompt, "second": chat_prompt},
                            GREEDY, adapters={"first": order[0], "second": order[1]})
        answers[order[0].name] = (runs["first"].tokens, runs["second"].tokens)
    full, quartered = answers[adapters[1].name]
    assert full != quartered
    assert answers["base:quarter"] == (quartered, full)
