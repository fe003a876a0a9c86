"""The packed bf16 projection kernel (:mod:`inference.engine.backends.native.gemm`): its products
against an fp64 reference over the same bf16 numbers, what it refuses, and a bf16 model's logits and
greedy tokens with it against the same model on plain weights (oneDNN's bf16 matmul).

Both compute every bf16 x bf16 product exactly and sum in fp32; they differ in the order of the
sums only, so each bf16 output may round to the neighbouring bf16 value, and over 30 layers the
logits drift by the tolerances below (measured on the default model).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from inference.engine.backends import native
from inference.engine.backends.hf import TransformersBackend, loading
from inference.engine.backends.native import gemm
from inference.engine.model_store import resolve_model_path
from tests.engine.backends.test_bf16 import (
    assert_argmax_agrees_except_near_ties,
    teacher_forced_logits,
)

HAS_COMPILER = any(shutil.which(cc) for cc in ("cc", "gcc"))
NATIVE_BF16 = loading.cpu_has_native_bf16()[0] and loading._cpu_flags()[0] == "x86"
# Packed kernel against plain weights, both bf16, teacher-forced over 4 rows x 16 decode steps
# after chunked prefill. Measured on the default model: max |logit diff| 0.61, mean 0.098 (as far
# apart as bf16 is from fp32, 0.084 mean: a bf16 rounding that differs in one layer spreads).
PLAIN_MAX_ABS = 1.5
PLAIN_MEAN_ABS = 0.2


@pytest.fixture(scope="module")
def lib():
    if not HAS_COMPILER:
        pytest.skip("no C compiler on this machine: the backend keeps its plain weights")
    loaded = native.load()
    assert loaded is not None, "a C compiler is present but the kernels did not build"
    return loaded


@pytest.fixture(scope="module")
def packed_lib(lib):
    if not gemm.packed_matmul_available(lib):
        assert not NATIVE_BF16, "this CPU has AVX512-BF16 but the kernel was built without it"
        pytest.skip("this CPU has no AVX512-BF16: the packed kernel is not built for it")
    return lib


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x W^T + bias`` in fp64 over the bf16 numbers (``x`` summed over its parts)."""
    xd = x.double() if x.dim() == 2 else x.double().sum(1)
    out = xd @ w.double().t()
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("out_features, in_features", [(64, 2), (960, 576), (576, 1536),
                                                       (128, 34)])
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 47, 48, 49, 97])
def test_products_are_the_exact_bf16_products_summed_in_fp32(packed_lib, out_features,
                                                             in_features, rows):
    gen = torch.Generator().manual_seed(rows * 1000 + out_features + in_features)
    w = (torch.randn(out_features, in_features, generator=gen) / in_features**0.5).bfloat16()
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    bias = torch.randn(out_features, generator=gen)
    packed = gemm.pack_bf16_weight(w)
    ref = reference(x, w, bias)
    # fp32 sums: within fp32 summation noise of the exact result (every product is exact).
    got = gemm.bf16_packed_matmul(packed_lib, x, packed, bias, out_fp32=True)
    assert got.dtype == torch.float32 and got.shape == (rows, out_features)
    bound = 1e-5 * (x.double().abs() @ w.double().abs().t() + bias.double().abs())
    assert ((got.double() - ref).abs() <= bound + 1e-6).all()
    # bf16 output: the fp32 sum rounded once, so within half a bf16 step of the exact result
    # plus that noise (one step where the noise crosses a rounding boundary).
    rounded = gemm.bf16_packed_matmul(packed_lib, x, packed, bias)
    assert rounded.dtype == torch.bfloat16
    step = 2.0 ** (torch.floor(torch.log2(ref.abs().clamp_min(1e-30))) - 7)
    assert ((rounded.double() - ref).abs() <= step + bound + 1e-6).all()
    # The same through PackedLinear, and without bias.
    layer = gemm.PackedLinear(packed_lib, w)
    torch.testing.assert_close(layer(x, out_fp32=True).double(), reference(x, w, None),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 7, 8, 16, 97])
@pytest.mark.parametrize("kernel_amx", [True, False])
def test_with_amx_larger_passes_take_amx_tiles_the_same_bf16_sums(packed_lib, rows, kernel_amx):
    # On a CPU with AMX, passes of 4 or more rows run on AMX tiles: the packed kernel's own
    # AMX path, or where the kernel has none (here: switched off) oneDNN's product over the
    # weight reordered once, from AMX_MIN_ROWS rows. Either way the same exact products summed
    # in fp32 and rounded once.
    cpuinfo = Path("/proc/cpuinfo")
    flags = cpuinfo.read_text().split() if cpuinfo.exists() else []
    assert gemm.amx_available() == ({"amx_bf16", "amx_tile"} <= set(flags))
    if kernel_amx and not gemm.amx_kernel(packed_lib):
        pytest.skip("the packed kernel has no AMX path here")
    gen = torch.Generator().manual_seed(rows)
    w = (torch.randn(960, 576, generator=gen) / 24).bfloat16()
    x = torch.randn(rows, 576, generator=gen).bfloat16()
    bias = torch.randn(960, generator=gen)
    before = gemm.amx_kernel_min_rows(packed_lib, -1 if kernel_amx else 0)
    calls = []
    real = gemm.onednn_linear
    try:
        layer = gemm.PackedLinear(packed_lib, w, bias)
        fallback = gemm.amx_available() and not kernel_amx
        assert (layer.onednn is not None) == fallback
        assert layer.weight is None  # the plain weight only where oneDNN's reorder is missing
        gemm.onednn_linear = lambda *a: calls.append(a[0].shape[0]) or real(*a)
        got = layer(x)
    finally:
        gemm.onednn_linear = real
        if before >= 0:
            gemm.amx_kernel_min_rows(packed_lib, before)
    assert calls == ([rows] if fallback and rows >= gemm.AMX_MIN_ROWS else [])
    ref = reference(x, w, bias.bfloat16().float() if calls else bias)  # F.linear's: bf16
    step = 2.0 ** (torch.floor(torch.log2(ref.abs().clamp_min(1e-30))) - 7)
    bound = 1e-5 * (x.double().abs() @ w.double().abs().t() + bias.double().abs())
    # Within a bf16 step of the exact sum (the bias rounded to bf16 on the AMX path: another).
    assert got.dtype == torch.bfloat16
    assert ((got.double() - ref).abs() <= 2 * step + bound + 1e-2 * 2.0 ** -7).all()
    # fp32 out and split inputs stay on the packed kernel.
    assert layer(x, out_fp32=True).dtype == torch.float32


@pytest.mark.parametrize("rows", [1, 4, 33])
def test_a_split_fp32_input_keeps_sixteen_bits(packed_lib, rows):
    # The LM head's use: fp32 x as bf16 hi + lo parts, fp32 out: within 2^-16 of fp32 x's product.
    gen = torch.Generator().manual_seed(rows)
    w = (torch.randn(640, 576, generator=gen) / 24).bfloat16()
    x = torch.randn(rows, 576, generator=gen)
    got = gemm.bf16_packed_matmul(packed_lib, gemm.split_fp32(x), gemm.pack_bf16_weight(w),
                                  out_fp32=True)
    exact = x.double() @ w.double().t()
    scale = x.double().abs() @ w.double().abs().t()
    assert ((got.double() - exact).abs() <= scale * 2.0**-15).all()
    # A plain bf16 x would be 2^-8 off: the split is what makes the logits fp32.
    coarse = gemm.bf16_packed_matmul(packed_lib, x.bfloat16(), gemm.pack_bf16_weight(w),
                                     out_fp32=True)
    assert (coarse.double() - exact).abs().max() > (got.double() - exact).abs().max() * 16


@pytest.mark.parametrize("weight, message", [
    (torch.zeros(60, 8, dtype=torch.bfloat16), "out a multiple of 64"),
    (torch.zeros(64, 7, dtype=torch.bfloat16), "in even"),
    (torch.zeros(64, 8), "bf16 on CPU"),
    (torch.zeros(64, dtype=torch.bfloat16), "cannot pack"),
])
def test_weights_the_kernel_cannot_take_are_refused(weight, message):
    assert not gemm.can_pack(weight)
    with pytest.raises(ValueError, match=message):
        gemm.pack_bf16_weight(weight)


def test_inputs_the_kernel_cannot_read_are_refused(packed_lib):
    layer = gemm.PackedLinear(packed_lib, torch.zeros(64, 8, dtype=torch.bfloat16))
    for x in (torch.zeros(2, 8), torch.zeros(2, 10, dtype=torch.bfloat16),
              torch.zeros(2, 3, 8, dtype=torch.bfloat16), torch.zeros(8, dtype=torch.bfloat16)):
        with pytest.raises(ValueError, match="bf16 packed matmul: x must be"):
            layer(x)
    with pytest.raises(ValueError, match="bias"):
        gemm.PackedLinear(packed_lib, torch.zeros(64, 8, dtype=torch.bfloat16), torch.zeros(63))
    packed = gemm.pack_bf16_weight(torch.zeros(64, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="shapes do not match"):
        gemm.bf16_packed_matmul(packed_lib, torch.zeros(2, 10, dtype=torch.bfloat16), packed)
    # A non-contiguous x is read correctly (made contiguous first).
    x = torch.randn(8, 4).bfloat16().t()
    w = torch.randn(64, 8).bfloat16()
    torch.testing.assert_close(gemm.PackedLinear(packed_lib, w)(x, out_fp32=True).double(),
                               reference(x, w, None), atol=1e-5, rtol=1e-5)
    assert not gemm.packed_matmul_available(None)


@pytest.fixture(scope="module")
def bf16() -> TransformersBackend:
    return TransformersBackend.from_pretrained(resolve_model_path(""), device="cpu",
                                               dtype="bfloat16")


@pytest.mark.model
def test_a_bf16_model_uses_the_packed_kernel_exactly_where_the_cpu_has_it(bf16):
    assert bf16.packed_gemm is (bool(bf16._native) and gemm.packed_matmul_available(bf16._native))
    if bf16.packed_gemm:
        # Every projection of the default model fits the kernel's tiles.
        assert all(layer.packed is not None for layer in bf16._layers)
        assert bf16._lm_head_packed is not None
    else:
        assert not NATIVE_BF16 or not HAS_COMPILER
        assert all(layer.packed is None for layer in bf16._layers)
    # With AMX, prompt attention is PyTorch's over the gathered K/V (oneDNN's AMX products), not
    # the native prefill kernel; elsewhere the native kernel wherever it is built.
    from inference.engine.backends.native import prefill as prefill_kernel

    supported = prefill_kernel.supported(bf16._native, bf16.dtype, bf16.head_dim, bf16.group)
    assert bf16._prefill_kernel_runs == (supported and not gemm.amx_available())


@pytest.mark.model
@pytest.mark.slow
def test_bf16_logits_alike_with_packed_and_plain_weights(bf16, corpus_ids):
    if not bf16.packed_gemm:
        pytest.skip("the packed kernel is unavailable on this CPU")
    try:
        packed = teacher_forced_logits(bf16, corpus_ids)
        bf16.packed_gemm = False
        plain = teacher_forced_logits(bf16, corpus_ids)
    finally:
        bf16.packed_gemm = True
    diff = (packed - plain).abs()
    stats = f"max {diff.max().item():.3f}, mean {diff.mean().item():.3f}"
    assert diff.max().item() < PLAIN_MAX_ABS, stats
    assert diff.mean().item() < PLAIN_MEAN_ABS, stats
    assert_argmax_agrees_except_near_ties(plain, packed, "packed vs plain weights")
    # The head's logits are the fp32 product either way (hi + lo split against the fp32 copy).
    with torch.inference_mode():
        h = bf16._embed[torch.tensor(corpus_ids[:5])]
        with_packed = bf16._logits(h, F.linear)
        bf16.packed_gemm = False
        try:
            without = bf16._logits(h, F.linear)
        finally:
            bf16.packed_gemm = True
    torch.testing.assert_close(with_packed, without, atol=1e-4, rtol=1e-5)


def tiny_bf16_backend(hidden: int, heads: int, head_dim: int, vocab: int) -> TransformersBackend:
    """A random 2-layer Llama in bf16 over the default model's tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from inference.tokenization import Tokenizer

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                      num_attention_heads=heads, num_key_value_heads=1, head_dim=head_dim,
                      vocab_size=vocab, max_position_embeddings=256)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    return TransformersBackend(model, Tokenizer.from_folder(resolve_model_path("")))


@pytest.mark.model
def test_weights_the_kernel_cannot_take_stay_plain_and_give_the_same_logits(packed_lib):
    from inference.engine.backends.base import PrefillChunk

    # hidden 128, 2 heads of 64: every projection packs. hidden 96, 3 heads of 32: q/k/v's
    # 160 outputs are not a multiple of 64, so the layers keep plain weights; the head
    # (vocabulary 1,024) still packs.
    for hidden, heads, head_dim, layers_packed in ((128, 2, 64, True), (96, 3, 32, False)):
        b = tiny_bf16_backend(hidden, heads, head_dim, 1024)
        assert all((layer.packed is not None) is layers_packed for layer in b._layers)
        assert b._lm_head_packed is not None
        assert b.packed_gemm  # the head alone, where the layers stay plain
        b.allocate_kv_pool(8, 16)
        chunk = [PrefillChunk("r", list(range(5, 45)), 0, [0, 1, 2])]
        fast = b.prefill(chunk)
        b.packed_gemm = False
        plain = b.prefill(chunk)
        assert fast.dtype == plain.dtype == torch.float32
        torch.testing.assert_close(fast, plain, atol=0.05, rtol=0.02)


@pytest.mark.parametrize("rows", [1, 2, 15, 16, 17, 33, 100])
def test_with_amx_the_kernels_tile_path_gives_the_vector_paths_sums(packed_lib, rows):
    # On a CPU with AMX the packed kernel runs passes of 4 or more rows times parts on AMX
    # tiles (TDPBF16PS over the same packed weight): the same exact products, summed in fp32 in
    # another order, so fp32 results agree to a few ulp and bf16 ones to a bf16 step; the
    # last block of rows is zero-padded, never read past.
    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
    if not gemm.amx_kernel(packed_lib):
        assert not {"amx_bf16", "amx_tile"} <= set(flags) or not HAS_COMPILER, (
            "this CPU has AMX but the packed kernel has no AMX path")
        pytest.skip("no AMX here: the packed kernel runs its AVX512-BF16 path only")
    assert gemm.amx_kernel_min_rows(packed_lib) == 4
    gen = torch.Generator().manual_seed(100 + rows)
    for out, inp in ((960, 576), (576, 1536), (64, 32)):
        w = (torch.randn(out, inp, generator=gen) / 24).bfloat16()
        packed = gemm.pack_bf16_weight(w)
        bias = torch.randn(out, generator=gen)
        x = torch.randn(rows, inp, generator=gen)
        for parts_x in (x.bfloat16(), gemm.split_fp32(x)):
            for out_fp32 in (True, False):
                before = gemm.amx_kernel_min_rows(packed_lib, 0)  # the vector path
                try:
                    vector = gemm.bf16_packed_matmul(packed_lib, parts_x, packed, bias,
                                                     out_fp32=out_fp32)
                    gemm.amx_kernel_min_rows(packed_lib, 1)  # the tiles at any size
                    tiles = gemm.bf16_packed_matmul(packed_lib, parts_x, packed, bias,
                                                    out_fp32=out_fp32)
                finally:
                    gemm.amx_kernel_min_rows(packed_lib, before)
                assert tiles.shape == (rows, out) and tiles.dtype == vector.dtype
                ref = reference(parts_x, w, bias)
                if out_fp32:
                    bound = 1e-5 * (parts_x.double().abs().sum(1) if parts_x.dim() == 3
                                    else parts_x.double().abs()) @ w.double().abs().t()
                    assert ((tiles.double() - ref).abs() <= bound + 1e-6).all()
                    assert ((tiles.double() - vector.double()).abs() <= 2 * bound + 1e-6).all()
                else:
                    step = 2.0 ** (torch.floor(torch.log2(ref.abs().clamp_min(1e-30))) - 7)
                    assert ((tiles.double() - vector.double()).abs() <= 2 * step + 1e-6).all()
