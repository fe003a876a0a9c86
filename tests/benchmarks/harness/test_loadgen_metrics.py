"""The load generator's metrics on hand-made results (vLLM's serving-benchmark definitions)."""

from __future__ import annotations

import math
import random

import pytest

from benchmarks.harness.metrics import RequestResult, describe_ms, summarize, summarize_by
from benchmarks.harness.workload import PromptMaker, merge, poisson_arrivals, shared_prefix_requests
from benchmarks.serving.fairness import max_min_difference
from inference.engine.backends.reference import ByteTokenizer


def ok(sent: float, chunks: list[float], output_tokens: int, *, tenant: str = "a",
       prompt_tokens: int = 10, ended: float | None = None) -> RequestResult:
    return RequestResult(tenant, "", "ok", 200, sent, chunks,
                         ended if ended is not None else chunks[-1], prompt_tokens,
                         output_tokens)


def test_ttft_tpot_itl_and_e2el_of_one_request_follow_vllm():
    r = ok(1.0, [1.5, 1.6, 1.8, 2.1], 4, ended=2.1)
    assert r.ttft_s == pytest.approx(0.5)
    assert r.e2el_s == pytest.approx(1.1)
    # TPOT = (e2el - ttft) / (output_tokens - 1)
    assert r.tpot_s == pytest.approx(0.6 / 3)
    assert r.itls_s == pytest.approx([0.1, 0.2, 0.3])


def test_a_one_token_request_has_a_ttft_but_no_tpot():
    r = ok(0.0, [0.2], 1)
    assert r.ttft_s == pytest.approx(0.2)
    assert r.tpot_s is None
    assert r.itls_s == []


def test_percentiles_interpolate_linearly_in_milliseconds():
    stats = describe_ms([0.001 * v for v in range(1, 101)])  # 1..100 ms
    assert stats["mean"] == pytest.approx(50.5)
    assert stats["median"] == pytest.approx(50.5)
    assert stats["p90"] == pytest.approx(90.1)
    assert stats["p99"] == pytest.approx(99.01)
    assert math.isnan(describe_ms([])["p99"])


def test_summary_counts_throughput_over_the_duration_and_leaves_out_failures():
    results = [
        ok(0.0, [0.1, 0.2, 0.3], 3, prompt_tokens=20, ended=0.3),
        ok(0.5, [0.9, 1.0], 2, prompt_tokens=30, ended=2.0),
        RequestResult("a", "", "rejected", 429, 1.0, [], 1.01),
        RequestResult("a", "", "error", 500, 1.0, [], 1.5),
    ]
    s = summarize(results)
    assert s["duration_s"] == pytest.approx(2.0)  # first send to last end
    assert (s["requests"], s["completed"], s["rejected_429"], s["errors"]) == (4, 2, 1, 1)
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_throughput"] == pytest.approx(2.5)
    assert s["total_token_throughput"] == pytest.approx(27.5)
    assert s["ttft_ms"]["mean"] == pytest.approx((100 + 400) / 2)
    assert s["itl_ms"]["median"] == pytest.approx(100)
    assert s["rejection_latency_ms"]["mean"] == pytest.approx(10)


def test_goodput_counts_requests_meeting_every_slo():
    fast = ok(0.0, [0.1, 0.15, 0.2], 3, ended=0.2)      # ttft 100 ms, tpot 50 ms
    slow_start = ok(0.0, [0.9, 0.95], 2, ended=0.95)   # ttft 900 ms
    slow_tokens = ok(0.0, [0.1, 0.5, 0.9], 3, ended=0.9)  # tpot 400 ms
    s = summarize([fast, slow_start, slow_tokens], duration_s=2.0,
                  slos_ms={"ttft": 500, "tpot": 100})
    assert s["good_requests"] == 1
    assert s["goodput"] == pytest.approx(0.5)
    assert "goodput" not in summarize([fast])


def test_per_tenant_summaries_share_the_run_duration():
    results = [ok(0.0, [1.0], 1, tenant="a"), ok(0.0, [1.0, 4.0], 2, tenant="b")]
    by = summarize_by(results, lambda r: r.tenant)
    assert by["a"]["duration_s"] == by["b"]["duration_s"] == pytest.approx(4.0)
    assert by["a"]["output_throughput"] + by["b"]["output_throughput"] == pytest.approx(0.75)


def test_poisson_arrivals_have_the_rate_and_respect_on_off_windows():
    times = poisson_arrivals(10.0, 200.0, random.Random(0))
    assert len(times) == pytest.approx(2000, rel=0.1)
    assert times == sorted(times) and times[0] >= 0 and times[-1] < 200
    windowed = poisson_arrivals(10.0, 30.0, random.Random(0), windows=[(0, 10), (20, 30)])
    assert windowed and not any(10 <= t < 20 for t in windowed)


def test_shared_prefix_prompts_start_with_one_of_the_prefixes():
    maker = PromptMaker(ByteTokenizer(), seed=0)
    specs = shared_prefix_requests(maker, [0.0] * 6, 2, 100, 20, 8, random.Random(0))
    prefixes = {s.prompt[:100] for s in specs}
    assert len(prefixes) == 2
    assert len({s.prompt for s in specs}) == 6
    assert [s.tag for s in specs] == ["prefix0", "prefix1"] * 3
    assert merge(specs[3:], specs[:3])[0].arrival_s == 0.0


def test_max_min_difference_restarts_when_the_backlogged_set_changes():
    def sample(a: float, b: float, c: float | None) -> dict:
        keys = {"A": {"weighted_service": a, "backlogged": True},
                "B": {"weighted_service": b, "backlogged": True}}
        keys["C"] = {"weighted_service": c or 0.0, "backlogged": c is not None}
        return {"keys": keys}

    samples = [sample(0, 0, None), sample(10, 4, None), sample(20, 14, 0), sample(30, 20, 12)]
    # A-B: 6 after the second sample; then C joins and the differences restart from there.
    assert max_min_difference(samples) == pytest.approx([0, 6, 0, 6])
