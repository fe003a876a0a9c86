"""The load generator's failure reporting and command-line checks (no server, no engine)."""

from __future__ import annotations

import asyncio
import json

import pytest

from benchmarks.harness import loadgen
from benchmarks.harness.common import finite
from benchmarks.harness.metrics import (
    RequestResult,
    failure_counts,
    failure_reason,
    records,
    report,
    summarize,
)
from benchmarks.harness.targets import run_load
from benchmarks.serving import overload


def failed(status: str, http_status: int, error: str, sent: float = 0.0) -> RequestResult:
    return RequestResult("a", "", status, http_status, sent, [], sent + 0.1, error=error)


def test_failure_reasons_name_http_status_error_code_and_exception_text():
    http = failed("error", 500, json.dumps({"error": {"code": "internal", "message": "boom"}}))
    assert failure_reason(http) == "HTTP 500 internal: boom"
    conn = failed("error", 0, "ConnectError: All connection attempts failed")
    assert failure_reason(conn) == "ConnectError: All connection attempts failed"
    limited = failed("rejected", 429, "queue full")
    assert failure_reason(limited) == "HTTP 429 queue full"
    counts = failure_counts([conn, http, conn])
    assert counts == {"ConnectError": 2, "HTTP 500 internal": 1}


def test_failures_group_by_status_and_code_without_per_request_numbers():
    def budget(n: int) -> RequestResult:
        return failed("rejected", 429, json.dumps({"error": {
            "code": "kv_budget_exceeded", "message": f"{n} + 36 = {n + 36} tokens exceeds"}}))

    s = summarize([budget(51), budget(60), failed("rejected", 429, "queue full")])
    assert s["failures_by_reason"] == {"HTTP 429 kv_budget_exceeded": 2, "HTTP 429": 1}
    assert s["failure_examples"]["HTTP 429 kv_budget_exceeded"] == (
        "HTTP 429 kv_budget_exceeded: 51 + 36 = 87 tokens exceeds")


def test_summary_of_only_failures_is_strict_json_with_reasons():
    s = summarize([failed("error", 0, "ConnectError: refused")])
    assert s["completed"] == 0 and s["errors"] == 1
    assert s["failures_by_reason"] == {"ConnectError": 1}
    assert s["failure_examples"] == {"ConnectError": "ConnectError: refused"}
    text = json.dumps(finite(s))
    assert "NaN" not in text
    assert json.loads(text)["ttft_ms"]["p99"] is None


def test_report_warns_and_flags_when_every_request_failed(capsys):
    s = summarize([failed("error", 0, "ConnectError: refused")])
    assert report(s) == "ConnectError"
    assert "WARNING: 1 of 1 requests did not complete" in capsys.readouterr().err
    ok = RequestResult("a", "", "ok", 200, 0.0, [0.1], 0.2, 5, 1)
    assert report(summarize([ok, failed("error", 0, "x")])) is None
    assert report(summarize([ok])) is None


def test_run_load_of_an_empty_workload_returns_nothing():
    assert asyncio.run(run_load(object(), [])) == ([], 0.0)  # type: ignore[arg-type]


@pytest.mark.parametrize("argv, message", [
    (["--requests", "0"], "must be at least 1"),
    (["--rate", "-1"], "at least 0"),
    (["--concurrency", "-2"], "must not be negative"),
    (["--input-len", "10", "5"], "MIN (10) is greater than MAX (5)"),
    (["--output-len", "0", "5"], "must be at least 1"),
    (["--key", "alice"], "is not TENANT=KEY"),
    (["--slo", "ttft"], "is not NAME=MS"),
    (["--slo", "latency=5"], "is not NAME=MS"),
    (["--slo", "ttft=abc"], "is not a number"),
])
def test_bad_loadgen_flags_are_argparse_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        loadgen.parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_good_loadgen_flags_parse():
    args = loadgen.parse_args(["--key", "a=k1", "--key", "b=k2", "--slo", "ttft=500",
                               "--input-len", "8", "8", "--rate", "2.5"])
    assert dict(args.key) == {"a": "k1", "b": "k2"}
    assert dict(args.slo) == {"ttft": 500.0}
    assert args.rate == 2.5


def test_overload_loads_are_parsed_up_front():
    assert overload.load_list("0.5, 1,2") == [0.5, 1.0, 2.0]
    for bad in ("0.5,x", "1,0", "-1", ""):
        with pytest.raises(Exception, match="comma-separated list of positive numbers"):
            overload.load_list(bad)


@pytest.mark.parametrize("argv", [["--loads", "1,zero"], ["--duration", "0"],
                                  ["--probe-requests", "0"]])
def test_bad_overload_flags_exit_before_any_run(argv, capsys, monkeypatch):
    monkeypatch.setattr(overload, "run", None)  # reaching a run would fail differently
    with pytest.raises(SystemExit) as exc:
        overload.main(argv)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_records_hold_every_request_and_recompute_the_summary():
    done = RequestResult("a", "short", "ok", 200, 1.0, [1.2, 1.25, 1.4], 1.4, 12, 3, 4,
                         arrival_s=0.9, max_tokens=3)
    refused = failed("rejected", 429, json.dumps({"error": {"code": "queue_full",
                                                            "message": "try later"}}), 2.0)
    recs = records([done, refused])
    assert json.loads(json.dumps(recs)) == recs
    first, second = recs
    assert first["tenant"] == "a" and first["tag"] == "short" and first["status"] == "ok"
    assert first["arrival_s"] == 0.9 and first["sent_s"] == 1.0 and first["max_tokens"] == 3
    assert (first["prompt_tokens"], first["output_tokens"], first["cached_prompt_tokens"]) == (
        12, 3, 4)
    assert first["ttft_s"] == 0.2 and first["e2el_s"] == 0.4 and first["tpot_s"] == 0.1
    assert first["itls_s"] == [0.05, 0.15] and first["failure_reason"] == ""
    assert second["status"] == "rejected" and second["http_status"] == 429
    assert second["failure_reason"] == "HTTP 429 queue_full: try later"
    derived = {"ttft_s", "tpot_s", "e2el_s", "itls_s", "failure_reason"}
    again = [RequestResult(**{k: v for k, v in r.items() if k not in derived}) for r in recs]
    assert finite(summarize(again)) == finite(summarize([done, refused]))


def test_fairness_json_holds_every_request_and_the_summaries(tmp_path):
    from benchmarks.serving import fairness

    assert fairness.main(["--duration", "1", "--rate", "4", "--step-delay", "0.002",
                          "--scenarios", "two", "--policies", "vtc", "--sample-every", "0.1",
                          "--out-dir", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "fairness.json").read_text())
    (run,) = data["runs"]
    assert {"service", "max_difference", "bound", "per_tenant", "samples", "ttft"} <= set(run)
    assert len(run["results"]) == sum(t["requests"] for t in run["per_tenant"].values()) > 0
    assert {r["tenant"] for r in run["results"]} <= {"A", "B"}
    assert all({"arrival_s", "ttft_s", "itls_s", "e2el_s", "status", "prompt_tokens",
                "output_tokens", "failure_reason"} <= set(r) for r in run["results"])
    assert (tmp_path / "fairness-two.png").stat().st_size > 0


def test_every_request_failing_warns_and_exits_1(tmp_path, capsys):
    from benchmarks.serving import fairness

    assert fairness.main(["--duration", "0.5", "--rate", "4", "--step-delay", "0.002",
                          "--scenarios", "two", "--policies", "fcfs", "--sample-every", "0.1",
                          "--kv-budget", "10", "--out-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "WARNING: two/fcfs:" in err and "HTTP 429 kv_budget_exceeded" in err


@pytest.mark.parametrize("argv, message", [
    (["--duration", "0"], "greater than 0"),
    (["--rate", "-1"], "greater than 0"),
    (["--batch", "0"], "at least 1"),
    (["--step-delay", "-1"], "at least 0"),
    (["--policies", "fcfs,lifo"], "choose from fcfs, vtc"),
    (["--policies", ","], "empty list"),
    (["--scenarios", "four"], "choose from two, three"),
    (["--sample-every", "0"], "greater than 0"),
    (["--duration", "1", "--sample-every", "2"], "longer than --duration"),
    (["--kv-budget", "-5"], "--kv-budget"),
    (["--kv-budget", "99999"], "--kv-budget"),
    (["--targets", "engine,cloud"], "choose from engine, rest"),
    (["--workers", "0"], "at least 1"),
    (["--backend", "gguf"], "invalid choice"),
])
def test_bad_fairness_flags_are_argparse_errors(argv, message, capsys):
    from benchmarks.serving import fairness

    with pytest.raises(SystemExit) as exc:
        fairness.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_name_lists_merge_duplicates_in_order():
    from benchmarks.harness.cli import name_list

    assert name_list(("a", "b", "c"))("b,a,b, c") == ["b", "a", "c"]


@pytest.mark.parametrize("argv, message", [
    (["--backlogs", "40,0"], "positive integers"),
    (["--backlogs", "many"], "not a list of integers"),
    (["--a-tokens", "96,32"], "MIN <= MAX"),
    (["--a-tokens", "32"], "MIN,MAX"),
    (["--workers", ""], "positive integers"),
    (["--repeats", "0"], "at least 1"),
])
def test_bad_backlog_flags_are_argparse_errors(argv, message, capsys):
    from benchmarks.serving import backlog

    with pytest.raises(SystemExit) as exc:
        backlog.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
