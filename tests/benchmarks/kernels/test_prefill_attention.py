"""The prefill attention benchmark prints one line per case, or says why it cannot compare."""

from __future__ import annotations

import re

import pytest
import torch

from benchmarks.kernels import prefill_attention
from inference.engine.backends import native
from inference.engine.backends.native import prefill


def test_the_prefill_attention_benchmark_prints_each_case(capsys):
    available = prefill.supported(native.load(), torch.bfloat16, 64, 3)
    code = prefill_attention.main(["--cases", "0:8,100:5", "--repeats", "1"])
    out = capsys.readouterr().out
    if not available:
        assert code == 1 and "does not run here" in out
        return
    assert code == 0
    lines = [m.group(0).split() for m in re.finditer(r"^\s+\d+\s+\d+ .*$", out, re.M)]
    assert [(int(c[0]), int(c[1])) for c in lines] == [(0, 8), (100, 5)]
    for cells in lines:
        assert all(float(c.removesuffix("ms")) > 0 for c in cells[2:4])
        assert float(cells[-1]) < 0.05  # the two paths agree (bf16 outputs of order 1)


@pytest.mark.parametrize("cases", ["0:0", "-1:5", "12", "a:b", ""])
def test_the_prefill_attention_benchmark_refuses_bad_cases(cases):
    with pytest.raises(SystemExit):
        prefill_attention.main(["--cases", cases])
