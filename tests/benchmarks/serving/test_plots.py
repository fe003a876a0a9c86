"""The experiments' plots on made-up results shaped like the published ones: every legend lies
outside the axes (it covers no data), no two tick labels or value labels overlap, every panel
has a title and its y axis a label, and a small bar next to large ones gets its value written."""

from __future__ import annotations

import itertools
import math
import random
from typing import Any

import matplotlib
import pytest

matplotlib.use("Agg")

from matplotlib.text import Text  # noqa: E402

from benchmarks.harness import common  # noqa: E402
from benchmarks.serving import (
    fairness,  # noqa: E402
    overhead,  # noqa: E402
    overload,  # noqa: E402
    prefill,  # noqa: E402
    prefix_cache,  # noqa: E402
    priority,  # noqa: E402
)


def pct(median: float, p99: float, mean: float | None = None) -> dict[str, float]:
    return {"mean": mean if mean is not None else median, "median": median, "std": 1.0,
            "p90": (median + p99) / 2, "p99": p99}


def fairness_runs() -> list[dict[str, Any]]:
    rng = random.Random(0)
    runs = []
    for policy in ("fcfs", "vtc"):
        samples, diffs = [], []
        for i in range(200):
            t = i * 0.2
            a, b = 400 * t, (830 if policy == "fcfs" else 410) * t
            samples.append({"t": t, "keys": {
                "A": {"weighted_service": a, "backlogged": True, "pending": 3},
                "B": {"weighted_service": b, "backlogged": True, "pending": 9}}})
            diffs.append(abs(b - a) if policy == "fcfs" else 400 + rng.uniform(-150, 150))
        ttft = [{"tenant": rng.choice("AB"), "sent_s": t / 10, "ttft_s": t / 20,
                 "waiting": t > 300} for t in range(400)]
        runs.append({"scenario": "two", "policy": policy, "bound": 2048.0,
                     "active_kv_budget": 512, "longest_prompt": 80,
                     "service": {"A": samples[-1]["keys"]["A"]["weighted_service"],
                                 "B": samples[-1]["keys"]["B"]["weighted_service"]},
                     "samples": samples, "differences": diffs, "ttft": ttft})
    return runs


def priority_runs() -> list[dict[str, Any]]:
    table = {"same-tier": (5173, 11485, 4631, 11738), "tiers": (4736, 11345, 4713, 12011),
             "tiers-deep-prefetch": (167, 401, 5519, 12129)}
    return [{"name": name,
             "per_tenant": {"vip": {"ttft_ms": pct(v50, v99)},
                            "bulk": {"ttft_ms": pct(b50, b99)}},
             "vip_ttft": [{"sent_s": t, "ttft_s": v50 / 1000 * (0.5 + t / 30)}
                          for t in range(30)]}
            for name, (v50, v99, b50, b99) in table.items()]


def prefill_runs() -> list[dict[str, Any]]:
    return [{"mode": mode, "long_arrivals_s": [4.0, 16.0, 28.0],
             "stream_gaps": [{"t": t / 10, "itl_s": 0.07 * (1 + (t % 50 == 0) * 100 / k)}
                             for t in range(550)],
             "short_ttft": [{"sent_s": t + 0.5, "ttft_s": 0.2 * k * (1 + t % 7)}
                            for t in range(40)]}
            for k, mode in enumerate(prefill.MODES, start=1)]


def prefix_cache_runs() -> list[dict[str, Any]]:
    runs = []
    for on, (computed, rps, otps, ttps, ttfts_ms) in (
            (False, (17437, 0.83, 26.7, 482, [6500 + 16 * i for i in range(32)])),
            (True, (4637, 1.69, 54.2, 977, [150] * 3 + [690] * 20 + [6190] * 9))):
        runs.append({"prefix_caching": on, "prefix_hit_rate": 0.73 if on else 0.0,
                     "prompt_tokens_computed": computed,
                     "summary": {"request_throughput": rps, "output_throughput": otps,
                                 "total_token_throughput": ttps},
                     "ttft": [{"ttft_s": ms / 1000} for ms in ttfts_ms]})
    return runs


def overload_data() -> dict[str, Any]:
    points = []
    for load, done, rej, ttft50, ttft99, e2el99, r50, r99 in (
            (0.25, 1.29, 0, 60, 85, 1452, None, None), (0.5, 3.37, 0, 69, 159, 1576, None, None),
            (1, 6.33, 0.3, 1407, 3666, 4717, 10, 14), (1.5, 6.34, 2.3, 1976, 4047, 5479, 10, 43),
            (2, 6.47, 6.4, 2000, 4193, 5702, 11, 37)):
        points.append({"load": load, "offered_rate": 6.16 * load, "request_throughput": done,
                       "rejected_rate": rej, "rejected_429": int(rej * 30), "goodput": done * .7,
                       "ttft_ms": pct(ttft50, ttft99), "e2el_ms": pct(e2el99 * .6, e2el99),
                       "rejection_latency_ms": {"median": r50, "p99": r99}})
    return {"capacity_req_s": 6.16, "points": points}


def overhead_runs() -> tuple[list[dict[str, Any]], dict[str, float]]:
    def system(tps: float, ttft: float, ttft99: float, tpot: float, itl: float,
               itl99: float) -> dict[str, Any]:
        return {"output_throughput": tps, "ttft_ms": pct(ttft * .95, ttft99, ttft),
                "tpot_ms": pct(tpot, tpot * 1.2), "itl_ms": pct(itl, itl99)}

    runs = [{"engine": system(78.9, 1503, 1979, 79.1, 75.5, 94.0),
             "rest": system(78.3, 1567, 2028, 78.8, 76.5, 92.6)},
            {"engine": system(74.3, 1533, 1881, 85.0, 80.0, 114.5),
             "rest": system(78.5, 1543, 1926, 79.0, 76.2, 96.0)}]
    return runs, {"throughput_ratio": 1.02}


PLOTS = {
    "fairness": (fairness, lambda: fairness.plot(fairness_runs(), "two")),
    "priority": (priority, lambda: priority.plot(priority_runs())),
    "prefill": (prefill, lambda: prefill.plot(prefill_runs())),
    "prefix_cache": (prefix_cache, lambda: prefix_cache.plot(prefix_cache_runs())),
    "overload": (overload, lambda: overload.plot(overload_data())),
    "overload-no-429": (overload, lambda: overload.plot(
        {**overload_data(), "points": overload_data()["points"][:2]})),
    "overhead": (overhead, lambda: overhead.plot(*overhead_runs())),
}


def render(module: Any, draw: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The figure a plot function saves, drawn (not written to disk)."""
    figures = []
    monkeypatch.setattr(module, "save_figure",
                        lambda fig, name, out_dir=None: figures.append(fig))
    draw()
    (fig,) = figures
    fig.canvas.draw()
    return fig


def overlapping(boxes: list[Any]) -> list[tuple[int, int]]:
    return [(i, j) for (i, a), (j, b) in itertools.combinations(enumerate(boxes), 2)
            if a.overlaps(b) and a.intersection(a, b).width > 1
            and a.intersection(a, b).height > 1]


@pytest.mark.parametrize("name", list(PLOTS))
def test_plot_layout_is_readable(name: str, monkeypatch: pytest.MonkeyPatch):
    import matplotlib.pyplot as plt

    module, draw = PLOTS[name]
    fig = render(module, draw, monkeypatch)
    renderer = fig.canvas.get_renderer()
    try:
        axes = [ax for ax in fig.axes if ax.get_visible()]
        areas = [ax.get_window_extent(renderer) for ax in axes]
        legends = [ax.get_legend() for ax in axes if ax.get_legend()] + list(fig.legends)
        assert legends, "no legend"
        texts = [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()]
        for legend in legends:
            box = legend.get_window_extent(renderer)
            for ax, area in zip(axes, areas, strict=True):
                assert not overlapping([box, area]), (
                    f"a legend covers the axes '{ax.get_title()}'")
            own = set(legend.findobj(Text))
            for text in texts:
                if text not in own:
                    assert not overlapping([box, text.get_window_extent(renderer)]), (
                        f"a legend covers the text {text.get_text()!r}")
        for ax in axes:
            assert ax.get_title(), "a panel without a title"
            assert ax.get_ylabel() or ax.get_title(), "a y axis without a label"
            for axis in (ax.xaxis, ax.yaxis):
                labels = [t for t in axis.get_ticklabels(which="both")
                          if t.get_visible() and t.get_text()]
                boxes = [t.get_window_extent(renderer) for t in labels]
                assert not overlapping(boxes), (
                    f"tick labels overlap in '{ax.get_title()}': {[t.get_text() for t in labels]}")
            texts = [t for t in ax.texts if t.get_visible() and t.get_text()]
            assert not overlapping([t.get_window_extent(renderer) for t in texts]), (
                f"value labels overlap in '{ax.get_title()}'")
        bottom = [ax for ax in axes if ax.get_subplotspec().is_last_row()]
        assert all(ax.get_xlabel() or ax.get_xticklabels() for ax in bottom)
    finally:
        plt.close(fig)


def test_priority_bars_carry_their_values_and_the_smallest_one_shows(monkeypatch):
    import matplotlib.pyplot as plt

    fig = render(priority, lambda: priority.plot(priority_runs()), monkeypatch)
    try:
        ax = fig.axes[1]
        texts = [t.get_text() for t in ax.texts]
        assert "167 ms" in texts and "12.1 s" in texts
        low, _ = ax.get_ylim()
        assert low <= 167 / 10  # the 167 ms bar spans at least a decade of the log axis
    finally:
        plt.close(fig)


def test_overload_429_latency_has_its_own_millisecond_axes(monkeypatch):
    import matplotlib.pyplot as plt

    fig = render(overload, lambda: overload.plot(overload_data()), monkeypatch)
    try:
        (ax,) = [a for a in fig.axes if "429" in a.get_title()]
        assert ax.get_ylabel() == "milliseconds"
        _, top = ax.get_ylim()
        assert 43 <= top < 100  # scaled to the 429s' own latencies, not to seconds
    finally:
        plt.close(fig)


def test_overhead_plot_and_table_show_the_same_statistics():
    assert [overhead.column(m, s) for m, s in overhead.LATENCY] == [
        "ttft_mean_ms", "ttft_p99_ms", "tpot_mean_ms", "itl_p50_ms", "itl_p99_ms"]


@pytest.mark.parametrize("ms, text", [(0.5, "0.5 ms"), (167.4, "167 ms"), (1503, "1.5 s"),
                                      (12129, "12.1 s"), (None, "n/a"), (math.nan, "n/a")])
def test_durations_are_labelled_in_readable_units(ms, text):
    assert common.fmt_ms(ms) == text
