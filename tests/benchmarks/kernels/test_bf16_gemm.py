"""The packed-kernel benchmark prints one line per row count, or says why it cannot compare."""

from __future__ import annotations

import re

import pytest
import torch

from benchmarks.kernels import bf16_gemm
from inference.engine.backends import native
from inference.engine.backends.native import gemm


def test_the_bf16_gemm_benchmark_prints_each_row_count(capsys):
    available = gemm.packed_matmul_available(native.load())
    code = bf16_gemm.main(["--rows", "1,7", "--repeats", "1"])
    out = capsys.readouterr().out
    if not available:
        assert code == 1 and "not available here" in out
        return
    assert code == 0
    lines = {int(m.group(1)): m.group(0).split() for m in re.finditer(r"^\s+(\d+) .*$", out, re.M)}
    assert sorted(lines) == [1, 7]
    # F.linear, the kernel's vector path, the backend, the head's two paths; the reordered
    # weight where this PyTorch has oneDNN's ops, the kernel's AMX path where it has one
    lib = native.load()
    expected = 5 + (gemm.onednn_weight(torch.ones(64, 64).bfloat16()) is not None) + (
        gemm.amx_kernel(lib))
    for cells in lines.values():
        times = [float(c.removesuffix("ms")) for c in cells if c.endswith("ms")]
        assert len(times) == expected and min(times) > 0
        assert cells.count("-") == 7 - expected


@pytest.mark.parametrize("rows", ["0", "1,x", ""])
def test_the_bf16_gemm_benchmark_refuses_bad_rows(rows):
    with pytest.raises(SystemExit):
        bf16_gemm.main(["--rows", rows])


def test_the_bf16_gemm_benchmark_shows_the_paths_agree(capsys):
    if not gemm.packed_matmul_available(native.load()):
        return  # the other test checks the message
    assert bf16_gemm.main(["--rows", "3", "--repeats", "1"]) == 0
    line = next(m.group(0) for m in re.finditer(r"^\s+3 .*$", capsys.readouterr().out, re.M))
    assert float(line.split()[-1]) <= 2.0**-7  # bf16 results, rounded apart at most once
