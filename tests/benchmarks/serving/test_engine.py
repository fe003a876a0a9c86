"""bench_engine's system names, its throughput ratios and its targets (no model, no run)."""

from __future__ import annotations

import argparse
import json

import pytest

from benchmarks.serving import engine as bench_engine
from benchmarks.serving.engine import System, check_targets, parse_system, ratios, system_list


def row(tok_s: float, dtype: str) -> dict:
    return {"dtype": dtype, "median": {"output_tok_s": tok_s}, "runs": [{}]}


@pytest.mark.parametrize("text, kind, dtype, label", [
    ("engine", "engine", "auto", "engine"),
    ("engine:auto", "engine", "auto", "engine"),
    ("engine:fp32", "engine", "float32", "engine:float32"),
    ("engine:bfloat16", "engine", "bfloat16", "engine:bfloat16"),
    ("generate", "generate", "float32", "generate:float32"),
    ("generate:bf16", "generate", "bfloat16", "generate:bfloat16"),
    (" generate_batch : BF16 ", "generate_batch", "bfloat16", "generate_batch:bfloat16"),
])
def test_system_names(text, kind, dtype, label):
    system = parse_system(text)
    assert system == System(kind, dtype)
    assert system.label == label


@pytest.mark.parametrize("text, message", [
    ("vllm", "unknown 'vllm'"),
    ("generate:auto", "unknown dtype 'auto'"),
    ("engine:float16x", "unknown dtype 'float16x'"),
    ("generate:int8", "choose from float32, bfloat16"),
])
def test_bad_system_names(text, message):
    with pytest.raises(ValueError, match=message):
        parse_system(text)


def test_system_lists_merge_aliases_in_order():
    systems = system_list("engine, generate:bf16,engine:auto,generate:bfloat16,generate")
    assert [s.label for s in systems] == ["engine", "generate:bfloat16", "generate:float32"]
    with pytest.raises(argparse.ArgumentTypeError, match="empty"):
        system_list(" , ")
    assert [s.label for s in system_list(",".join(bench_engine.DEFAULT_SYSTEMS))] == list(
        bench_engine.DEFAULT_SYSTEMS)


@pytest.mark.parametrize("argv, message", [
    (["--systems", "engine,generate:int8"], "argument --systems: unknown dtype 'int8'"),
    (["--systems", ""], "empty list"),
    (["--peer-repeats", "0"], "at least 1"),
])
def test_bad_flags_are_argparse_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        bench_engine.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_ratios_compare_each_row_with_the_peers_in_its_own_dtype_and_with_fp32_generate():
    rows = {"engine": row(300.0, "bfloat16"), "engine:float32": row(200.0, "float32"),
            "generate:float32": row(50.0, "float32"), "generate:bfloat16": row(100.0, "bfloat16"),
            "generate_batch:bfloat16": row(120.0, "bfloat16")}
    got = ratios(rows)
    assert got["engine"] == {"x_gen": 3.0, "x_gb": 2.5, "x_gen_fp32": 6.0}
    # No fp32 generate_batch in the run: that ratio is missing, not 0 or inf.
    assert got["engine:float32"] == {"x_gen": 4.0, "x_gb": None, "x_gen_fp32": 4.0}
    assert got["generate:float32"]["x_gen"] == 1.0
    assert got["generate:bfloat16"] == {"x_gen": 1.0, "x_gb": pytest.approx(100 / 120),
                                        "x_gen_fp32": 2.0}


def test_ratios_skip_failed_rows_and_unknown_dtypes():
    rows = {"engine": row(100.0, "float16"), "generate:float32": {"error": "exit 1: boom"}}
    assert ratios(rows) == {"engine": {"x_gen": None, "x_gb": None, "x_gen_fp32": None},
                            "generate:float32": {"x_gen": None, "x_gb": None,
                                                 "x_gen_fp32": None}}


def test_targets_against_fp32_bf16_and_same_dtype_peers():
    results = {
        "a": {"engine": row(120.0, "bfloat16"), "generate:bfloat16": row(100.0, "bfloat16"),
              "generate:float32": row(10.0, "float32")},
        "b": {"engine": row(100.0, "bfloat16"), "generate:float32": row(20.0, "float32"),
              "generate:bfloat16": row(50.0, "bfloat16"),
              "generate_batch:bfloat16": row(25.0, "bfloat16")},
        "c": {"engine": row(11.0, "bfloat16"), "generate:bfloat16": row(10.0, "bfloat16")},
    }
    checks = {(c["workload"], c["peer"]): c for c in check_targets(results)}
    assert list(checks) == [("b", "generate:float32"), ("b", "generate:bfloat16"),
                            ("b", "generate_batch:bfloat16"), ("a", "generate:bfloat16"),
                            ("c", "generate:bfloat16")]
    assert checks["b", "generate:float32"]["measured"] == 5.0
    assert checks["b", "generate:float32"]["verdict"] == "PASS"
    assert checks["b", "generate:bfloat16"]["verdict"] == "MISS"  # 2.0 < 2.5
    assert checks["b", "generate_batch:bfloat16"]["verdict"] == "PASS"  # 4.0 >= 3
    # (a) compares with bf16 generate (the engine's dtype), not with the much slower fp32 one.
    assert checks["a", "generate:bfloat16"]["measured"] == pytest.approx(1.2)
    assert checks["a", "generate:bfloat16"]["verdict"] == "PASS"
    assert checks["c", "generate:bfloat16"]["verdict"] == "MISS"  # 1.1 < 1.2


def test_targets_without_a_peer_are_not_applicable_and_each_engine_row_gets_its_own():
    results = {"a": {"engine": row(120.0, "float32"), "engine:bfloat16": row(150.0, "bfloat16"),
                     "generate:float32": row(100.0, "float32")}}
    checks = check_targets(results)
    assert {c["engine"] for c in checks} == {"engine", "engine:bfloat16"}
    a = {c["engine"]: c for c in checks if c["workload"] == "a"}
    assert a["engine"]["verdict"] == "PASS"
    assert a["engine:bfloat16"]["verdict"] == "n/a"  # no bf16 generate in the run
    assert {c["workload"] for c in checks} == {"a"}  # only the workloads that ran
    text = bench_engine.format_targets(checks)
    assert "a  engine >= 1.20x generate:float32: 1.20x  PASS" in text
    assert "not measured  n/a" in text


def test_peers_run_b_once_and_their_own_repeats_elsewhere():
    engine, peer = parse_system("engine"), parse_system("generate:bf16")
    assert [bench_engine.planned_runs(engine, wl, 3, 2) for wl in "abc"] == [3, 3, 3]
    assert [bench_engine.planned_runs(peer, wl, 3, 2) for wl in "abc"] == [2, 1, 2]


def test_a_run_prints_the_engines_dtype_ratios_and_targets(tmp_path, monkeypatch, capsys):
    speeds = {"engine": (110.0, "bfloat16"), "generate:float32": (50.0, "float32"),
              "generate:bfloat16": (100.0, "bfloat16")}
    seen = []

    def fake_run(system, workload, quick, repeats):
        seen.append((system.label, workload))
        tok_s, dtype = speeds[system.label]
        run = {"output_tokens": 64, "wall_s": 1.0, "output_tok_s": tok_s, "ttft_p50_s": 0.1,
               "ttft_p99_s": 0.2, "itl_p50_s": 0.05, "itl_p99_s": 0.06, "foreign_cores": 0.0}
        return {"runs": [run], "peak_rss_bytes": 2**30, "description": "batch 1",
                "dtype": dtype}

    monkeypatch.setattr(bench_engine, "run_one", fake_run)
    out = tmp_path / "bench.json"
    assert bench_engine.main(["--workloads", "c", "--systems",
                              "engine,generate:float32,generate:bf16", "--out", str(out)]) == 0
    assert seen.count(("engine", "c")) == 3 and seen.count(("generate:float32", "c")) == 2
    text = capsys.readouterr().out
    assert "engine: dtype auto resolved to bfloat16" in text
    assert "c  engine >= 1.20x generate:bfloat16: 1.10x  MISS" in text
    saved = json.loads(out.read_text())
    assert saved["engine_dtypes"] == {"engine": "bfloat16"}
    assert saved["ratios"]["c"]["engine"]["x_gen_fp32"] == pytest.approx(2.2)
    assert [t["verdict"] for t in saved["targets"] if t["workload"] == "c"] == ["MISS"]
