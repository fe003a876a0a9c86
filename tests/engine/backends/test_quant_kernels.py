"""The quantized kernels (``native/quant.c``): products over Q4_1 and Q8_0 weights read as the
GGUF file stores them equal the products over ``gguf``'s own dequantization of the same bytes, on
the default model's shipped tensors and on made-up blocks (negative and subnormal scales), in the
AVX2 path this CPU builds and in the plain C path built without it, for every remainder of their
4-row tile; bad shapes are refused with the field named. The int8-activation products (llama.cpp's
arithmetic: each block of 32 inputs as int8 codes and a scale) stay within the rounding of those
codes of the exact product, in both paths."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from inference.engine.backends import native
from inference.engine.backends.native import quant
from inference.engine.model_store import default_gguf_path

CC = shutil.which("cc") or shutil.which("gcc")
SOURCE = Path(native.__file__).with_name("quant.c")


@pytest.fixture(scope="module")
def lib():
    if CC is None:
        pytest.skip("no C compiler on this machine")
    loaded = native.load()
    assert loaded is not None, "a C compiler is present but the kernels did not build"
    return loaded


@pytest.fixture(scope="module")
def plain_lib(tmp_path_factory):
    """quant.c alone, built for the x86-64 baseline (no AVX2): its plain C loops."""
    if CC is None:
        pytest.skip("no C compiler on this machine")
    target = tmp_path_factory.mktemp("quant") / "quant_plain.so"
    flags = ["-O2", "-fopenmp", "-fPIC", "-shared", "-std=c11"]
    if subprocess.run([CC, "-march=x86-64", "-E", "-x", "c", "/dev/null"],
                      capture_output=True).returncode == 0:
        flags.append("-march=x86-64")
    subprocess.run([CC, *flags, str(SOURCE), "-o", str(target), "-lm"], check=True)
    loaded = ctypes.CDLL(str(target))
    native.declare_quant(loaded)
    return loaded


@pytest.fixture(scope="module")
def shipped():
    """Three Q4_1 projections of the default model's wheel file and 700 rows of its Q8_0 tied
    embedding: name -> (kind, uint8 blocks, dense fp32 from gguf's dequantization,
    in_features)."""
    reader = GGUFReader(str(default_gguf_path()))
    out = {}
    for t in reader.tensors:
        if t.name in ("blk.0.attn_k.weight", "blk.3.ffn_down.weight", "blk.7.ffn_up.weight",
                      "token_embd.weight"):
            blocks = np.ascontiguousarray(t.data[:700])
            dense = dequantize(blocks, t.tensor_type)
            out[t.name] = (t.tensor_type.name.lower(), torch.from_numpy(blocks.copy()),
                           torch.from_numpy(dense.copy()), dense.shape[1])
    assert [kind for kind, *_ in out.values()].count("q4_1") == 3
    assert out["token_embd.weight"][0] == "q8_0"
    return out


def made_up_blocks(kind: str, out_features: int, in_features: int, seed: int) -> torch.Tensor:
    """Random codes with scales (and Q4_1's minimums) of every sign and size, subnormals
    included."""
    rng = np.random.default_rng(seed)
    nb, size = in_features // 32, quant.BLOCK_BYTES[kind]
    halves = 2 if kind == "q4_1" else 1
    blocks = rng.integers(0, 256, size=(out_features, nb, size), dtype=np.uint8)
    scales = rng.normal(0, 0.05, size=(out_features, nb, halves)).astype(np.float16)
    scales[0, 0] = np.float16(3e-6)  # subnormal in fp16
    scales[-1, -1] = -2.5
    blocks[:, :, :2 * halves] = scales.view(np.uint8).reshape(out_features, nb, 2 * halves)
    return torch.from_numpy(blocks.reshape(out_features, nb * size))


def dense_of(kind: str, blocks: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(dequantize(blocks.numpy(), GGMLQuantizationType[kind.upper()]).copy())


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 16])
def test_products_over_the_shipped_weights_equal_ggufs_dequantized_products(lib, shipped, rows):
    torch.manual_seed(rows)
    for name, (kind, blocks, dense, in_features) in shipped.items():
        x = torch.randn(rows, in_features)
        bias = torch.randn(dense.shape[0])
        got = quant.quant_matmul(lib, kind, x, blocks, bias)
        want = x.double() @ dense.double().T + bias.double()
        assert got.shape == (rows, dense.shape[0])
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4, msg=name)


def test_dequantized_weights_are_ggufs_bit_for_bit(lib, shipped):
    for kind, blocks, dense, in_features in shipped.values():
        assert torch.equal(quant.dequantize(lib, kind, blocks, in_features), dense)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("rows", [1, 2, 7])
def test_the_plain_path_and_the_simd_path_agree_on_made_up_blocks(lib, plain_lib, kind, rows):
    assert not quant.simd(plain_lib)
    blocks = made_up_blocks(kind, 40, 96, seed=rows)
    dense = dense_of(kind, blocks)
    assert torch.equal(quant.dequantize(plain_lib, kind, blocks, 96), dense)
    assert torch.equal(quant.dequantize(lib, kind, blocks, 96), dense)
    x = torch.randn(rows, 96, dtype=torch.float64).float()
    want = x.double() @ dense.double().T
    for which in (lib, plain_lib):
        got = quant.quant_matmul(which, kind, x, blocks)
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


def int8_bound(x: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    """``[rows, out]``: how far a product over x's int8 codes may be from the exact one. Each
    x value is off by at most half its block's step ``max |x| / 127``, so output ``n`` by at
    most ``sum_j |w_nj| step_j / 2``; plus fp32 summation noise."""
    step = x.double().abs().view(x.shape[0], -1, 32).amax(-1) / 127  # [rows, blocks]
    per_input = step.repeat_interleave(32, dim=1) / 2  # [rows, in]
    exact_scale = x.double().abs() @ dense.double().abs().T
    return per_input @ dense.double().abs().T * 1.001 + exact_scale * 1e-5 + 1e-6


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
def test_int8_activation_products_stay_within_the_codes_rounding(lib, plain_lib, kind, rows):
    blocks = made_up_blocks(kind, 40, 96 if rows % 2 else 128, seed=rows)  # odd and even blocks
    in_features = 96 if rows % 2 else 128
    dense = dense_of(kind, blocks)
    x = torch.randn(rows, in_features) * torch.logspace(-2, 2, in_features)  # blocks of any size
    exact = x.double() @ dense.double().T
    bound = int8_bound(x, dense)
    for which in (lib, plain_lib):
        got = quant.quant_matmul(which, kind, x, blocks, int8_activations=True)
        assert got.shape == (rows, 40)
        assert ((got.double() - exact).abs() <= bound).all()
    # The codes' rounding is real: the fp32 path is far closer to the exact product.
    fp32 = quant.quant_matmul(lib, kind, x, blocks)
    assert (fp32.double() - exact).abs().max() < (got.double() - exact).abs().max() / 10
    # A zero block (scale 0) gives exact zeros, not NaN.
    zeros = quant.quant_matmul(lib, kind, torch.zeros(rows, in_features), blocks,
                               int8_activations=True)
    assert torch.equal(zeros, torch.zeros(rows, 40))
    # A NaN input reaches the output, as in the fp32 path, not a code of 0.
    x[0, 5] = float("nan")
    for which in (lib, plain_lib):
        got = quant.quant_matmul(which, kind, x, blocks, int8_activations=True)
        assert got[0].isnan().all() and not got[1:].isnan().any()


def test_int8_activation_products_over_the_shipped_weights(lib, shipped):
    torch.manual_seed(0)
    for name, (kind, blocks, dense, in_features) in shipped.items():
        x = torch.randn(3, in_features)
        got = quant.quant_matmul(lib, kind, x, blocks, int8_activations=True)
        exact = x.double() @ dense.double().T
        assert ((got.double() - exact).abs() <= int8_bound(x, dense)).all(), name


def test_the_simd_path_is_what_an_avx2_cpu_builds(lib):
    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
    if not {"avx2", "f16c", "fma"} <= set(flags):
        pytest.skip("this CPU has no AVX2 + F16C + FMA")
    assert quant.simd(lib)


@pytest.mark.parametrize("case, message", [
    ("in", "q4_1: in_features 40 is not a positive multiple of 32"),
    ("bytes", r"q4_1: the weight must be a contiguous \[out, 40\] uint8"),
    ("dtype", "uint8 CPU tensor"),
    ("rows", r"x must be \[rows, in\] with rows >= 1"),
    ("bias", r"bias must be \[8\]"),
    ("kind", "unknown quantization 'q5_0'; choose from q4_1, q8_0"),
])
def test_shapes_the_kernel_cannot_take_are_refused(lib, case, message):
    blocks = made_up_blocks("q4_1", 8, 64, seed=0)
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match=message):
        if case == "in":
            quant.quant_matmul(lib, "q4_1", torch.randn(2, 40), blocks)
        elif case == "bytes":
            quant.quant_matmul(lib, "q4_1", x, blocks[:, :30].contiguous())
        elif case == "dtype":
            quant.quant_matmul(lib, "q4_1", x, blocks.to(torch.int16))
        elif case == "rows":
            quant.quant_matmul(lib, "q4_1", x[:0], blocks)
        elif case == "bias":
            quant.quant_matmul(lib, "q4_1", x, blocks, torch.zeros(7))
        else:
            quant.quant_matmul(lib, "q5_0", x, blocks)


# The x16 layout (16 output features interleaved, AVX-512 VNNI): the same integer products as the
# one-feature-at-a-time kernel, in another order of the fp32 sums over the blocks.

def x16_lib(lib):
    if not quant.x16_available(lib):
        pytest.skip("the kernels were built without AVX-512 VNNI")
    return lib


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9])
def test_x16_products_are_the_one_feature_at_a_time_products(lib, kind, rows):
    lib = x16_lib(lib)
    for in_features in (96, 128):
        blocks = made_up_blocks(kind, 48, in_features, seed=rows)
        dense = dense_of(kind, blocks)
        x = torch.randn(rows, in_features) * torch.logspace(-2, 2, in_features)
        bias = torch.randn(48)
        packed = quant.pack_x16(lib, kind, blocks, in_features)
        assert packed.shape == (3, in_features // 32 * quant.X16_RECORD[kind])
        if kind == "q4_1":  # the same bytes in another order
            assert torch.equal(packed.flatten().sort().values, blocks.flatten().sort().values)
        one = quant.quant_matmul(lib, kind, x, blocks, bias, int8_activations=True)
        got = quant.quant_matmul(lib, kind, x, packed, bias, int8_activations=True, x16=True)
        scale = x.double().abs() @ dense.double().abs().T + bias.double().abs()
        assert ((got.double() - one.double()).abs() <= scale * 2e-6 + 1e-6).all()
        exact = x.double() @ dense.double().T + bias.double()
        assert ((got.double() - exact).abs() <= int8_bound(x, dense)).all()
    # Zeros stay exact; a NaN input reaches its row's outputs only.
    zeros = quant.quant_matmul(lib, kind, torch.zeros(rows, 128), packed, int8_activations=True,
                               x16=True)
    assert torch.equal(zeros, torch.zeros(rows, 48))
    x[0, 5] = float("nan")
    got = quant.quant_matmul(lib, kind, x, packed, int8_activations=True, x16=True)
    assert got[0].isnan().all() and not got[1:].isnan().any()


def test_x16_products_over_the_shipped_weights(lib, shipped):
    lib = x16_lib(lib)
    torch.manual_seed(0)
    for name, (kind, blocks, dense, in_features) in shipped.items():
        blocks, dense = blocks[:688].contiguous(), dense[:688]  # a multiple of 16 features
        x = torch.randn(3, in_features)
        got = quant.quant_matmul(lib, kind, x, quant.pack_x16(lib, kind, blocks, in_features),
                                 int8_activations=True, x16=True)
        one = quant.quant_matmul(lib, kind, x, blocks, int8_activations=True)
        scale = x.double().abs() @ dense.double().abs().T
        assert ((got.double() - one.double()).abs() <= scale * 2e-6 + 1e-6).all(), name


def test_a_quantized_projection_takes_the_x16_product_where_it_can(lib, plain_lib):
    blocks = made_up_blocks("q4_1", 48, 64, seed=1)
    dense = dense_of("q4_1", blocks)

    def linear(which, out=48, int8=True):
        return quant.QuantLinear(which, "q4_1", blocks[:out].contiguous(), 64, None,
                                 dense[:out].contiguous(), lambda *a: None, 8,
                                 int8_activations=int8)

    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
    if {"avx512f", "avx512bw", "avx512_vnni"} <= set(flags):
        assert quant.x16_available(lib)
    assert (linear(lib).x16 is not None) == quant.x16_available(lib)
    assert linear(lib, int8=False).x16 is None  # the fp32-activation products: the blocks
    assert linear(lib, out=40).x16 is None  # not a multiple of 16 features
    assert not quant.x16_available(plain_lib) and linear(plain_lib).x16 is None
    x = torch.randn(2, 64)
    assert torch.allclose(linear(lib)(x), quant.quant_matmul(lib, "q4_1", x, blocks,
                                                             int8_activations=True),
                          rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="not a multiple of 16"):
        quant.pack_x16(lib, "q4_1", blocks[:40].contiguous(), 64)
    with pytest.raises(ValueError, match="int8 activations only"):
        quant.quant_matmul(lib, "q4_1", x, blocks, x16=True)
    with pytest.raises(RuntimeError, match="without AVX-512 VNNI"):
        quant.quant_matmul(plain_lib, "q4_1", x, quant.pack_x16(plain_lib, "q4_1", blocks, 64),
                           int8_activations=True, x16=True)
    with pytest.raises(ValueError, match=r"q4_1 x16: the weight must be a contiguous \[out / 16"):
        quant.quant_matmul(lib, "q4_1", x, blocks, int8_activations=True, x16=True)
