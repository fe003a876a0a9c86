"""The large-prompts experiment's figures and command line (no server)."""

from __future__ import annotations

import json

import pytest

from benchmarks.harness.metrics import RequestResult
from benchmarks.serving import large_prompts


def stream(times: list[float]) -> RequestResult:
    return RequestResult("streams", "stream", "ok", 200, 0.0, times, times[-1])


def test_a_large_body_has_the_bytes_asked_for():
    body = json.loads(large_prompts.chat_body(100_000))
    assert len(body["messages"][0]["content"].encode()) == 100_000


def test_phase_figures_and_the_targets():
    baseline = large_prompts.summarize_phase(
        "baseline", [0.010, 0.020, 0.030], [stream([0.0, 0.1, 0.2]), stream([1.0, 1.05])], [],
        None)
    loaded = large_prompts.summarize_phase(
        "2,400,000 B", [0.010, 0.250], [stream([0.0, 0.3, 0.35])],
        [{"status": 400, "code": "context_length_exceeded", "latency_s": 0.1}], 2_400_000)
    assert baseline["streams"]["max_gap_ms"] == pytest.approx(100)
    assert baseline["healthz_ms"]["max"] == pytest.approx(30)
    assert loaded["large"]["answers"] == {"400 context_length_exceeded": 1}
    base_check, loaded_check = large_prompts.verdicts([baseline, loaded])
    assert base_check["gap_ratio"] == 1 and base_check["healthz_ok"] and base_check["gap_ok"]
    assert loaded_check["gap_ratio"] == pytest.approx(3)
    assert not loaded_check["gap_ok"] and not loaded_check["healthz_ok"]
    rows = large_prompts.table_rows([baseline, loaded], [base_check, loaded_check])
    assert rows[1]["large_answers"] == "400 context_length_exceeded: 1"


@pytest.mark.parametrize("argv, message", [
    (["--rate", "0"], "must be a number greater than 0"),
    (["--prompt-bytes", "0"], "must be at least 1"),
    (["--streams", "x"], "is not an integer"),
])
def test_bad_flags_are_argparse_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        large_prompts.main(argv)
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_help_gives_the_defaults(capsys):
    with pytest.raises(SystemExit):
        large_prompts.main(["--help"])
    out = capsys.readouterr().out
    assert "(default: [2400000, 400000])" in out and "(default: 0.5)" in out
