"""The LoRA benchmark: which request runs under which adapter, its flags, and a tiny run on the
real model whose JSON holds every run's figures and every request's tokens."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks.serving import lora


def test_every_fourth_request_is_bare_and_the_rest_go_round_robin():
    assert lora.assignment(8, 0) == [None] * 8
    assert lora.assignment(8, 1) == [0, 0, 0, None, 0, 0, 0, None]
    assert lora.assignment(9, 4) == [0, 1, 2, None, 3, 0, 1, None, 2]
    sixteen = lora.assignment(64, 16)
    assert [i for i, a in enumerate(sixteen) if a is None] == list(range(3, 64, 4))
    assert all(sixteen.count(k) == 3 for k in range(16))


def test_only_the_adapters_the_runs_use_are_made():
    assert lora.adapters_needed(["base"], 64) == 0
    assert lora.adapters_needed(["base", "1", "16"], 4) == 3  # 3 adapter requests of 4
    assert lora.adapters_needed(["4", "peft"], 64) == 4
    assert lora.adapters_needed(list(lora.RUNS), 64) == 16


@pytest.mark.parametrize("text, expected", [("16-192", (16, 192)), ("8", (8, 8))])
def test_length_ranges(text, expected):
    assert lora.length_range(text) == expected


@pytest.mark.parametrize("argv, message", [
    (["--runs", "base,2"], "unknown '2'"),
    (["--output-len", "9-3"], "1 <= MIN <= MAX"),
    (["--input-len", "a-b"], "is not MIN-MAX"),
    (["--max-loras", "0"], "at least 1"),
])
def test_bad_flags_are_argparse_errors(argv, message, capsys):
    with pytest.raises(SystemExit):
        lora.main(argv)
    assert message in capsys.readouterr().err


def test_targets_pass_or_miss_on_the_ratios():
    def run(tok_s: float) -> dict:
        return {"summary": {"output_throughput": tok_s}}

    runs = {"base": run(100.0), "4": run(79.0), "peft": run(20.0)}
    assert lora.verdicts(runs) == [
        "4 adapters >= 0.80x the bare model: 0.79x  MISS",
        "4 adapters >= 3.00x peft (generate, one adapter at a time): 3.95x  PASS"]
    assert lora.verdicts({"base": run(100.0)}) == []


@pytest.mark.model
@pytest.mark.slow
def test_a_tiny_run_keeps_every_request_and_each_runs_figures(tmp_path, capsys):
    out = tmp_path / "out"
    code = lora.main(["--requests", "4", "--concurrency", "4", "--input-len", "16-48",
                      "--output-len", "3-6", "--runs", "base,1,16,peft", "--max-loras", "2",
                      "--adapter-dir", str(tmp_path / "adapters"), "--out-dir", str(out)])
    printed = capsys.readouterr().out
    assert code == 0
    data = json.loads((out / "lora.json").read_text())
    assert list(data["runs"]) == ["base", "1", "16", "peft"]
    assert data["dtype"] in ("float32", "bfloat16") and data["prefill_mode"] == "mixed_batch"
    max_tokens = None
    for name, run in data["runs"].items():
        for part in ("summary", "bare"):
            figures = run[part]
            assert figures["output_throughput"] > 0 and figures["request_throughput"] > 0
            for metric in ("ttft_ms", "itl_ms"):
                assert all(math.isfinite(figures[metric][q]) for q in ("median", "p99"))
        results = run["results"]
        assert len(results) == 4 and run["short_requests"] == []
        # No request lost: each completed with exactly the tokens it asked for.
        assert all(r["status"] == "ok" and r["output_tokens"] == r["max_tokens"] >= 3
                   and len(r["chunk_times_s"]) >= 1 for r in results)
        asked = [r["max_tokens"] for r in results]
        assert max_tokens in (None, asked)  # the same workload in every run
        max_tokens = asked
        assert results[3]["tag"] == "bare"
        assert len({r["tag"] for r in results}) == (1 if name == "base" else
                                                    2 if name == "1" else 4)
    pool = data["runs"]["16"]["adapter_stats"]
    assert pool["loads"] >= 3 and pool["evictions"] >= 1 and pool["capacity"] == 2
    assert pool["load_failures"] == 0 and data["runs"]["1"]["adapter_stats"]["loads"] == 1
    assert len(data["runs"]["peft"]["peft_load_s"]) == 3  # the 4-adapter assignment, 4 requests
    rows = {row["run"]: row for row in data["table"]}
    assert set(rows) == set(data["runs"])
    assert {"tok/s", "req/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms",
            "loads", "evictions", "load ms", "x base"} <= set(rows["16"])
    assert {row["run"] for row in data["bare_table"]} == set(data["runs"])
    assert "adapters >= 3.00x peft" not in printed  # no 4-adapter run: no ratio to peft
    assert (out / "lora.png").stat().st_size > 0
