"""The CPU-contention experiment's competitor and flags (no model, no run)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from benchmarks.serving import cpu_contention


def test_the_competitor_keeps_a_core_busy_for_its_share_of_each_period():
    # 10 ms busy every 20 ms: about half a core while it runs, and it runs until killed.
    proc = subprocess.Popen([sys.executable, "-c", cpu_contention.COMPETITOR, "0.01", "0.01"])
    try:
        time.sleep(0.3)  # the interpreter's start-up
        before = cpu_contention.competitor_cpu_s(proc)
        time.sleep(1.0)
        used = cpu_contention.competitor_cpu_s(proc) - before
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()
    assert 0.1 < used < 0.9


@pytest.mark.parametrize("argv, message", [
    (["--busy-ms", "20", "--period-ms", "20"], "--busy-ms must be below --period-ms"),
    (["--busy-ms", "0"], "--busy-ms"),
    (["--pairs", "0"], "--pairs"),
])
def test_bad_flags_are_argparse_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cpu_contention.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
