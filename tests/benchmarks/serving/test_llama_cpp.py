"""llama.cpp's ``llama-server`` as a benchmark peer: how it is started (threads, slots, context),
what the engine benchmark's client measures through its OpenAI endpoint, the refusals when its
answers disagree with the request, and the skips where it is not built. A stand-in server with
the same flags and endpoint (``tests/support/stand_in_llama_server.py``) runs in place of the
real one; the last test runs the real one where ``scripts/llama_cpp.sh`` has built it."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import httpx
import pytest

from benchmarks.harness import llama_server
from benchmarks.serving import llama_cpp
from benchmarks.serving.engine import cli as engine_cli
from benchmarks.serving.engine import llama as engine_llama
from benchmarks.serving.engine.report import bandwidth_rows, check_targets, ratios
from benchmarks.serving.engine.systems import System, parse_system
from benchmarks.serving.engine.workloads import Spec, Workload

STAND_IN = Path(__file__).resolve().parents[2] / "support" / "stand_in_llama_server.py"


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    """The stand-in as ``llama_server.BINARY``; returns a reader of what it logged."""
    binary = tmp_path / "llama-server"
    binary.write_text(f"#!/bin/sh\nexec {sys.executable} {STAND_IN} \"$@\"\n")
    binary.chmod(0o755)
    log = tmp_path / "stand-in.json"
    monkeypatch.setattr(llama_server, "BINARY", binary)
    monkeypatch.setenv("STAND_IN_LOG", str(log))
    monkeypatch.setenv("STAND_IN_MODE", "ok")
    return lambda: json.loads(log.read_text())


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_the_server_starts_with_a_thread_per_core_a_slot_per_request_and_stops(stand_in):
    with llama_server.LlamaServer("q4_1", parallel=3, ctx_per_slot=300) as server:
        assert httpx.get(f"{server.url}/health").status_code == 200
        pid = server.pid
    argv = stand_in()["argv"]
    cores = str(os.cpu_count())
    assert flag(argv, "-t") == cores and flag(argv, "-tb") == cores
    assert flag(argv, "-np") == "3"
    assert int(flag(argv, "-c")) >= 900 and int(flag(argv, "-c")) % 256 == 0
    assert flag(argv, "-m") == str(llama_server.gguf_path("q4_1"))
    assert flag(argv, "-a") == "SmolLM2-135M-Instruct"
    with pytest.raises(ProcessLookupError):  # stopped and reaped
        os.kill(pid, 0)


def test_a_server_that_exits_at_start_is_an_error_with_its_log(stand_in, monkeypatch):
    monkeypatch.setenv("STAND_IN_MODE", "exit")
    with pytest.raises(RuntimeError, match="(?s)exited with 3.*failing at start as asked"), \
            llama_server.LlamaServer("q4_1", parallel=1, ctx_per_slot=64):
        pass


def test_a_server_killed_by_a_signal_at_start_runs_again_without_repacking(stand_in,
                                                                          monkeypatch, capsys):
    monkeypatch.setenv("STAND_IN_MODE", "segv")
    with llama_server.LlamaServer("q4_1", parallel=2, ctx_per_slot=64) as server:
        assert httpx.get(f"{server.url}/health").status_code == 200
        assert server.repack is False
    assert "--no-repack" in stand_in()["argv"]
    assert "starting it again with --no-repack" in capsys.readouterr().err


def test_a_server_that_crashes_without_repacking_too_is_an_error(stand_in, monkeypatch):
    monkeypatch.setenv("STAND_IN_MODE", "segv_always")
    with pytest.raises(RuntimeError, match="(?s)exited with -11.*crashing at start"), \
            llama_server.LlamaServer("q4_1", parallel=1, ctx_per_slot=64):
        pass


def workload(concurrency: int) -> Workload:
    specs = [Spec(list(range(10 + i, 30 + i)), 5 + i) for i in range(6)]
    return Workload("t", "test", specs, concurrency)


def test_the_engine_benchmark_times_every_token_with_the_requests_in_flight(stand_in):
    wl = workload(concurrency=3)
    try:
        traces = engine_llama.run_llama_server("q4_1", wl, wl)
        again = engine_llama.run_llama_server("q4_1", wl, wl)  # the same server, kept
    finally:
        engine_llama.close()
    assert [len(t.token_times) for t in traces] == [s.max_tokens for s in wl.requests]
    for trace in traces + again:
        assert trace.token_times == sorted(trace.token_times)
        assert trace.token_times[0] > trace.submitted
    logged = stand_in()
    assert logged["requests"] == 12
    assert logged["most"] == 3  # the closed loop kept 3 in flight, never more
    assert flag(logged["argv"], "-np") == "3"


def test_a_chunk_that_carries_two_tokens_gives_both_its_time(stand_in, monkeypatch):
    monkeypatch.setenv("STAND_IN_MODE", "merge")
    wl = Workload("t", "test", [Spec(list(range(20)), 6)], 1)
    try:
        (trace,) = engine_llama.run_llama_server("q4_1", wl, wl)
    finally:
        engine_llama.close()
    assert len(trace.token_times) == 6
    assert trace.token_times[0] == trace.token_times[1] < trace.token_times[2]


@pytest.mark.parametrize("mode, message", [
    ("short", "made 5 tokens, 5 streamed, for max_tokens 6"),
    ("add_bos", "read 21 prompt tokens, sent 20"),
])
def test_answers_that_disagree_with_the_request_fail_the_run(stand_in, monkeypatch, mode,
                                                            message):
    monkeypatch.setenv("STAND_IN_MODE", mode)
    wl = Workload("t", "test", [Spec(list(range(20)), 6)], 1)
    try:
        with pytest.raises(RuntimeError, match=message):
            engine_llama.run_llama_server("q4_1", wl, wl)
    finally:
        engine_llama.close()


def test_missing_binary_or_gguf_names_the_build_script(tmp_path, monkeypatch):
    monkeypatch.setattr(llama_server, "BINARY", tmp_path / "absent")
    assert "scripts/llama_cpp.sh" in llama_server.missing("q4_1")
    with pytest.raises(FileNotFoundError, match="scripts/llama_cpp.sh"):
        llama_server.LlamaServer("q4_1", parallel=1, ctx_per_slot=64).__enter__()
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    monkeypatch.setattr(llama_server, "BF16_GGUF", tmp_path / "absent.gguf")
    monkeypatch.setattr(llama_server, "BINARY", binary)
    assert "bf16 GGUF is missing" in llama_server.missing("bf16")
    assert llama_server.missing("q4_1") is None
    with pytest.raises(ValueError, match="choose from bf16, q4_1"):
        llama_server.gguf_path("q8_0")


def test_unbuilt_peers_are_skipped_by_default_and_refused_when_asked_for(tmp_path, monkeypatch,
                                                                        capsys):
    monkeypatch.setattr(llama_server, "BINARY", tmp_path / "absent")
    assert llama_cpp.main([]) == 0
    out = capsys.readouterr().out
    assert "llama_bf16: skipped: llama-server is not built" in out
    assert "nothing run" in out
    assert llama_cpp.main(["--systems", "platform,llama_q4_1"]) == 1
    assert "llama_q4_1: llama-server is not built" in capsys.readouterr().err
    picked = engine_cli.pick_systems(None)
    assert [s.kind for s in picked].count("llama_server") == 0
    assert "llama_server:q4_1: skipped" in capsys.readouterr().out
    assert engine_cli.pick_systems([parse_system("llama_server:q4_1")]) is None


@pytest.mark.parametrize("text, dtype", [("llama_server", "bfloat16"),
                                         ("llama_server:bf16", "bfloat16"),
                                         ("llama_server:q4_1", "q4_1")])
def test_llama_server_system_names(text, dtype):
    assert parse_system(text) == System("llama_server", dtype)


@pytest.mark.parametrize("text", ["llama_server:fp32", "generate:q4_1", "engine:q8_0"])
def test_only_gguf_weights_llama_server_and_the_quantized_engine_know_are_taken(text):
    with pytest.raises(ValueError, match="unknown"):
        parse_system(text)


def test_the_engine_takes_q4_1_as_its_quantized_weights():
    assert parse_system("engine:q4_1") == System("engine", "q4_1")
    assert parse_system("engine:q4_1").label == "engine:q4_1"


def row(tok_s: float, dtype: str, itl_s: float = 0.01) -> dict:
    return {"dtype": dtype, "median": {"output_tok_s": tok_s, "itl_p50_s": itl_s}, "runs": [{}]}


def test_ratios_and_the_single_stream_target_against_llama_cpp():
    rows = {"engine": row(60.0, "bfloat16"), "llama_server:bfloat16": row(75.0, "bfloat16"),
            "llama_server:q4_1": row(80.0, "q4_1")}
    got = ratios(rows)["engine"]
    assert got["x_lcpp"] == pytest.approx(0.8) and got["x_lcpp_q4"] == pytest.approx(0.75)
    target = [c for c in check_targets({"c": rows}) if c["peer"] == "llama_server:bfloat16"]
    assert target[0]["verdict"] == "MISS"  # 0.8 < 0.95
    on_fp32_cpu = check_targets({"c": rows}, bf16_cpu=False)
    assert [c["verdict"] for c in on_fp32_cpu if c["peer"] == "llama_server:bfloat16"] == [
        "report"]
    # An engine row in fp32 is not held to the same-dtype target.
    fp32 = {"engine": row(60.0, "float32"), "llama_server:bfloat16": row(75.0, "bfloat16")}
    assert not [c for c in check_targets({"c": fp32}) if c["peer"].startswith("llama")]


def test_the_quantized_engine_is_held_to_the_q4_1_server_on_any_cpu():
    rows = {"engine:q4_1": row(39.0, "q4_1"), "llama_server:q4_1": row(78.0, "q4_1"),
            "generate:float32": row(20.0, "float32")}
    checks = check_targets({"c": rows}, bf16_cpu=False)
    assert [(c["engine"], c["peer"], c["verdict"]) for c in checks] == [
        ("engine:q4_1", "llama_server:q4_1", "MISS")]  # 0.5 < 1.2; no transformers target


def test_single_stream_bandwidth_is_weight_bytes_over_the_itl():
    rows = {"engine": row(60.0, "bfloat16", itl_s=0.0125), "generate:float32": {"error": "x"}}
    table = bandwidth_rows(rows, {"engine": 270_000_000}, read_gbs=27.0)
    assert table == [{"system": "engine", "weight_mb": 270.0, "itl_p50_ms": 12.5,
                      "gbs": pytest.approx(21.6), "share": pytest.approx(0.8)}]


@pytest.mark.skipif(llama_server.missing("q4_1") is not None,
                    reason="llama-server is not built here (scripts/llama_cpp.sh)")
def test_the_real_server_answers_the_engine_benchmarks_client():
    wl = Workload("t", "test", [Spec(list(range(100, 140)), 8), Spec(list(range(200, 216)), 4)],
                  2)
    try:
        traces = engine_llama.run_llama_server("q4_1", wl, wl)
    finally:
        engine_llama.close()
    assert [len(t.token_times) for t in traces] == [8, 4]


def summary(tok_s: float, itl_ms: float, tpot_ms: float) -> dict:
    """A run's summary as :func:`benchmarks.harness.metrics.summarize` gives it (what the
    comparison reads)."""
    ms = {"median": 0.0, "p99": 0.0}
    return {"output_throughput": tok_s, "request_throughput": tok_s / 128,
            "ttft_ms": dict(ms), "itl_ms": {"median": itl_ms, "p99": itl_ms},
            "tpot_ms": {"median": tpot_ms, "p99": tpot_ms}, "total_input_tokens": 1024,
            "total_output_tokens": 1024, "requests": 8, "completed": 8}


def test_the_single_stream_is_judged_per_chunk_and_shown_per_token_and_the_peer_flags_shown():
    # The platform's chunks carry two tokens (its worker holds a tick): 21 ms between chunks,
    # 10.5 ms a token; the server sends one token a chunk.
    results = {"platform_q4_1": {"single": summary(95.0, 21.0, 10.5)},
               "llama_q4_1": {"single": {**summary(78.0, 10.3, 10.3),
                                         "peer_flags": "--no-repack"}}}
    lines = llama_cpp.verdicts(results, {"avx512_bf16": True})
    assert lines[0].startswith("single: platform_q4_1 >= 1.20x llama_q4_1: 1.22x  PASS")
    assert "ITL p50 21.0 ms <= llama_q4_1's 10.3 ms  MISS (per delivered chunk)" in lines[1]
    assert "per token (TPOT p50): 10.5 ms against 10.3 ms" in lines[2]
    rows = {r["system"]: r for r in llama_cpp.table_rows(results)}
    assert rows["llama_q4_1"]["flags"] == "--no-repack" and rows["platform_q4_1"]["flags"] == ""
    assert rows["platform_q4_1"]["TPOT p50 ms"] == 10.5


def test_rounds_are_judged_by_each_systems_median_round():
    def summary(tok_s: float) -> dict:
        return {"output_throughput": tok_s}

    rounds = [{"single": summary(80.0), "mixed": summary(250.0)},
              {"single": summary(70.0), "mixed": summary(290.0)},
              {"single": summary(90.0), "mixed": summary(270.0)}]
    median = llama_cpp.median_rounds(rounds)
    assert median["single"]["output_throughput"] == 80.0
    assert median["mixed"]["output_throughput"] == 270.0
    # two rounds: the lower one, so that a lucky round never decides a target
    assert llama_cpp.median_rounds(rounds[:2])["single"]["output_throughput"] == 70.0
