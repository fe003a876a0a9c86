"""The Q4_1 kernel (``native/q4_1.c``): products over 4-bit weights read as the GGUF file stores
them equal the products over ``gguf``'s own dequantization of the same bytes, on the default
model's shipped projections and on made-up blocks (negative and subnormal scales), in the AVX2
path this CPU builds and in the plain C path built without it, for every remainder of its
4-row tile; bad shapes are refused with the field named."""

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
SOURCE = Path(native.__file__).with_name("q4_1.c")


@pytest.fixture(scope="module")
def lib():
    if CC is None:
        pytest.skip("no C compiler on this machine")
    loaded = native.load()
    assert loaded is not None, "a C compiler is present but the kernels did not build"
    return loaded


@pytest.fixture(scope="module")
def plain_lib(tmp_path_factory):
    """q4_1.c alone, built for the x86-64 baseline (no AVX2): its plain C loop."""
    if CC is None:
        pytest.skip("no C compiler on this machine")
    target = tmp_path_factory.mktemp("q4") / "q4_1_plain.so"
    flags = ["-O2", "-fopenmp", "-fPIC", "-shared", "-std=c11"]
    if subprocess.run([CC, "-march=x86-64", "-E", "-x", "c", "/dev/null"],
                      capture_output=True).returncode == 0:
        flags.append("-march=x86-64")
    subprocess.run([CC, *flags, str(SOURCE), "-o", str(target), "-lm"], check=True)
    loaded = ctypes.CDLL(str(target))
    native.declare_q4_1(loaded)
    return loaded


@pytest.fixture(scope="module")
def shipped():
    """Three Q4_1 projections of the default model's wheel file: name -> (uint8 blocks, dense
    fp32 from gguf's dequantization, in_features)."""
    reader = GGUFReader(str(default_gguf_path()))
    out = {}
    for t in reader.tensors:
        if t.name in ("blk.0.attn_k.weight", "blk.3.ffn_down.weight", "blk.7.ffn_up.weight"):
            assert t.tensor_type == GGMLQuantizationType.Q4_1
            blocks = np.ascontiguousarray(t.data)
            dense = dequantize(blocks, GGMLQuantizationType.Q4_1)
            out[t.name] = (torch.from_numpy(blocks.copy()), torch.from_numpy(dense.copy()),
                           dense.shape[1])
    assert len(out) == 3
    return out


def made_up_blocks(out_features: int, in_features: int, seed: int) -> torch.Tensor:
    """Random codes with scales and minimums of every sign and size, subnormals included."""
    rng = np.random.default_rng(seed)
    nb = in_features // 32
    blocks = rng.integers(0, 256, size=(out_features, nb, 20), dtype=np.uint8)
    scales = rng.normal(0, 0.05, size=(out_features, nb, 2)).astype(np.float16)
    scales[0, 0] = np.float16(3e-6)  # subnormal in fp16
    scales[-1, -1] = (-0.0, -2.5)
    blocks[:, :, :4] = scales.view(np.uint8).reshape(out_features, nb, 4)
    return torch.from_numpy(blocks.reshape(out_features, nb * 20))


def dense_of(blocks: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(dequantize(blocks.numpy(), GGMLQuantizationType.Q4_1).copy())


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 16])
def test_products_over_the_shipped_weights_equal_ggufs_dequantized_products(lib, shipped, rows):
    torch.manual_seed(rows)
    for name, (blocks, dense, in_features) in shipped.items():
        x = torch.randn(rows, in_features)
        bias = torch.randn(dense.shape[0])
        got = quant.q4_1_matmul(lib, x, blocks, bias)
        want = x.double() @ dense.double().T + bias.double()
        assert got.shape == (rows, dense.shape[0])
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4, msg=name)


def test_dequantized_weights_are_ggufs_bit_for_bit(lib, shipped):
    for blocks, dense, in_features in shipped.values():
        assert torch.equal(quant.q4_1_dequantize(lib, blocks, in_features), dense)


@pytest.mark.parametrize("rows", [1, 2, 7])
def test_the_plain_path_and_the_simd_path_agree_on_made_up_blocks(lib, plain_lib, rows):
    assert not quant.simd(plain_lib)
    blocks = made_up_blocks(40, 96, seed=rows)
    dense = dense_of(blocks)
    assert torch.equal(quant.q4_1_dequantize(plain_lib, blocks, 96), dense)
    assert torch.equal(quant.q4_1_dequantize(lib, blocks, 96), dense)
    x = torch.randn(rows, 96, dtype=torch.float64).float()
    want = x.double() @ dense.double().T
    for which in (lib, plain_lib):
        got = quant.q4_1_matmul(which, x, blocks)
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


def test_the_simd_path_is_what_an_avx2_cpu_builds(lib):
    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
    if not {"avx2", "f16c", "fma"} <= set(flags):
        pytest.skip("this CPU has no AVX2 + F16C + FMA")
    assert quant.simd(lib)


@pytest.mark.parametrize("case, message", [
    ("in", "in_features 40 is not a positive multiple of 32"),
    ("bytes", r"must be a contiguous \[out, 40\] uint8"),
    ("dtype", "uint8 CPU tensor"),
    ("rows", r"x must be \[rows, in\] with rows >= 1"),
    ("bias", r"bias must be \[8\]"),
])
def test_shapes_the_kernel_cannot_take_are_refused(lib, case, message):
    blocks = made_up_blocks(8, 64, seed=0)
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match=message):
        if case == "in":
            quant.q4_1_matmul(lib, torch.randn(2, 40), blocks)
        elif case == "bytes":
            quant.q4_1_matmul(lib, x, blocks[:, :30].contiguous())
        elif case == "dtype":
            quant.q4_1_matmul(lib, x, blocks.to(torch.int16))
        elif case == "rows":
            quant.q4_1_matmul(lib, x[:0], blocks)
        else:
            quant.q4_1_matmul(lib, x, blocks, torch.zeros(7))
