"""The LM head benchmark runs and prints one line per row count, its errors within fp32 noise."""

from __future__ import annotations

import re
import shutil

import pytest

from benchmarks.kernels import lm_head


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                    reason="no C compiler: the native kernel does not build")
def test_the_lm_head_benchmark_prints_each_row_count(capsys):
    assert lm_head.main(["--rows", "1,5", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    lines = {int(m.group(1)): m.group(0) for m in re.finditer(r"^\s+(\d+) .*$", out, re.M)}
    assert sorted(lines) == [1, 5]
    for line in lines.values():
        native_error, fp32_error, bf16_error = (float(e.rstrip(",")) for e in line.split()[-3:])
        # The native kernel's logits are fp32-accurate; bf16 rounding is a thousand times worse.
        assert native_error < 1e-3 and fp32_error < 1e-3 and bf16_error > native_error


def test_the_lm_head_benchmark_refuses_bad_rows():
    with pytest.raises(SystemExit):
        lm_head.main(["--rows", "0"])
