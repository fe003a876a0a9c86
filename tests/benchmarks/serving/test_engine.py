"""The engine benchmark's system names, its throughput ratios and its targets, and the command line
of its runs and of their worker processes (no model, no run)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.serving.engine import cli as engine_cli
from benchmarks.serving.engine.report import check_targets, format_targets, ratios
from benchmarks.serving.engine.systems import DEFAULT_SYSTEMS, System, parse_system, system_list


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
    assert [s.label for s in system_list(",".join(DEFAULT_SYSTEMS))] == list(
        DEFAULT_SYSTEMS)


@pytest.mark.parametrize("argv, message", [
    (["--systems", "engine,generate:int8"], "argument --systems: unknown dtype 'int8'"),
    (["--systems", ""], "empty list"),
    (["--peer-repeats", "0"], "at least 1"),
])
def test_bad_flags_are_argparse_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        engine_cli.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--workloads", "d"], "argument --workloads: unknown 'd'; choose from a, b, c"),
    (["--systems", "engine,foo"], "argument --systems: unknown 'foo'"),
    (["--workloads", ""], "empty list"),
    (["--repeats", "0"], "at least 1"),
    (["--repeats", "-1"], "at least 1"),
])
def test_bad_workload_and_system_flags_are_argparse_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        engine_cli.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.fixture(autouse=True)
def no_bandwidth_probe(monkeypatch):
    """The 1 GiB read-bandwidth probe is the benchmark's, not these tests'."""
    monkeypatch.setattr(engine_cli.llama_server, "read_bandwidth_gbs", lambda: 20.0)


def test_a_failed_run_exits_1_after_the_table(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(engine_cli, "run_one",
                        lambda *a, **k: {"error": "exit 1: boom", "description": "c"})
    out = tmp_path / "bench.json"
    assert engine_cli.main(["--quick", "--workloads", "c,c", "--systems", "engine",
                            "--out", str(out)]) == 1
    captured = capsys.readouterr()
    assert "failed: exit 1: boom" in captured.out
    assert "failed runs: engine on c" in captured.err
    assert list(json.loads(out.read_text())["results"]) == ["c"]

def test_ratios_compare_each_row_with_the_peers_in_its_own_dtype_and_with_fp32_generate():
    rows = {"engine": row(300.0, "bfloat16"), "engine:float32": row(200.0, "float32"),
            "generate:float32": row(50.0, "float32"), "generate:bfloat16": row(100.0, "bfloat16"),
            "generate_batch:bfloat16": row(120.0, "bfloat16")}
    got = ratios(rows)
    no_llama = {"x_lcpp": None, "x_lcpp_q4": None}
    assert got["engine"] == {"x_gen": 3.0, "x_gb": 2.5, "x_gen_fp32": 6.0, **no_llama}
    # No fp32 generate_batch in the run: that ratio is missing, not 0 or inf.
    assert got["engine:float32"] == {"x_gen": 4.0, "x_gb": None, "x_gen_fp32": 4.0, **no_llama}
    assert got["generate:float32"]["x_gen"] == 1.0
    assert got["generate:bfloat16"] == {"x_gen": 1.0, "x_gb": pytest.approx(100 / 120),
                                        "x_gen_fp32": 2.0, **no_llama}


def test_ratios_skip_failed_rows_and_unknown_dtypes():
    rows = {"engine": row(100.0, "float16"), "generate:float32": {"error": "exit 1: boom"}}
    none = {"x_gen": None, "x_gb": None, "x_gen_fp32": None, "x_lcpp": None, "x_lcpp_q4": None}
    assert ratios(rows) == {"engine": none, "generate:float32": none}


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
    text = format_targets(checks)
    assert "a  engine >= 1.20x generate:float32: 1.20x  PASS" in text
    assert "not measured  n/a" in text


def test_peers_run_b_once_and_their_own_repeats_elsewhere():
    engine, peer = parse_system("engine"), parse_system("generate:bf16")
    assert [engine_cli.planned_runs(engine, wl, 3, 2) for wl in "abc"] == [3, 3, 3]
    assert [engine_cli.planned_runs(peer, wl, 3, 2) for wl in "abc"] == [2, 1, 2]


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

    monkeypatch.setattr(engine_cli, "run_one", fake_run)
    out = tmp_path / "bench.json"
    assert engine_cli.main(["--workloads", "c", "--systems",
                              "engine,generate:float32,generate:bf16", "--out", str(out)]) == 0
    assert seen.count(("engine", "c")) == 3 and seen.count(("generate:float32", "c")) == 2
    text = capsys.readouterr().out
    assert "engine: dtype auto resolved to bfloat16" in text
    assert "c  engine >= 1.20x generate:bfloat16: 1.10x  MISS" in text
    # The single stream's memory traffic: the bf16 weights (about 269 MB) over its 50 ms ITL.
    assert "read bandwidth (this run, torch sum over 1 GiB): 20.0 GB/s" in text
    line = next(x for x in text.splitlines() if x.strip().startswith("engine ") and "GB/s" in x)
    assert "ITL p50 50.0 ms = 5.4 GB/s = 27% of it" in line
    saved = json.loads(out.read_text())
    assert saved["engine_dtypes"] == {"engine": "bfloat16"}
    assert saved["ratios"]["c"]["engine"]["x_gen_fp32"] == pytest.approx(2.2)
    assert [t["verdict"] for t in saved["targets"] if t["workload"] == "c"] == ["MISS"]


def test_each_run_is_this_command_again_in_worker_mode(monkeypatch):
    """A run's process is ``python -m benchmarks.serving.engine --worker ...`` from the repository
    root, and those flags reach :func:`worker` with the run's system, workload and settings."""
    assert importlib.util.find_spec("benchmarks.serving.engine.__main__") is not None
    commands = []

    def fake_subprocess_run(cmd, cwd, **kwargs):
        commands.append((cmd, cwd))
        result = Path(cmd[cmd.index("--result") + 1])
        result.write_text(json.dumps({"runs": [], "peak_rss_bytes": 0, "description": "",
                                      "dtype": "float32"}))
        return subprocess.CompletedProcess(cmd, 0, "", "")

    calls = []
    monkeypatch.setattr(engine_cli.subprocess, "run", fake_subprocess_run)
    monkeypatch.setattr(engine_cli, "worker", lambda *args: calls.append(args))
    settings = engine_cli.ENGINE_SETTINGS
    try:
        settings.update(prefill_mode="chunked", target_itl_ms=80.0)
        one = engine_cli.run_one(parse_system("generate:bf16"), "c", True, 2)
        assert one["dtype"] == "float32" and "process_s" in one
        [(cmd, cwd)] = commands
        assert cmd[:3] == [sys.executable, "-m", "benchmarks.serving.engine"]
        assert (Path(cwd) / "benchmarks" / "serving" / "engine" / "__main__.py").is_file()

        settings.clear()
        assert engine_cli.main(cmd[3:]) == 0
        [(system, workload, quick, repeats, result)] = calls
        assert (system, workload, quick, repeats) == (System("generate", "bfloat16"), "c", True, 2)
        assert str(result) == cmd[cmd.index("--result") + 1]
        assert settings == {"prefill_mode": "chunked", "target_itl_ms": 80.0}
    finally:
        settings.clear()
