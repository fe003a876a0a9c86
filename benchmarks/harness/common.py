"""What the experiments share: the results folder, run metadata, engines, tokenizers, plots."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after choosing the Agg backend

from benchmarks.harness.metrics import report, summarize  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
RESULTS_DIR = REPO / "benchmarks" / "results"


def machine() -> dict[str, Any]:
    """Where and when a run happened: CPUs, load averages (1, 5, 15 min), time, commit."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                                capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        commit = ""
    return {"cpus": os.cpu_count(), "loadavg": list(os.getloadavg()),
            "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "commit": commit}


def cpu_info() -> dict[str, Any]:
    """``model`` (``/proc/cpuinfo``'s model name), ``cores`` (os.cpu_count), ``avx512_bf16``
    and ``amx_bf16`` (bools) and ``label``, the line printed beside every figure."""
    model, flags = "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "unknown CPU":
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    info = {"model": model, "cores": os.cpu_count(), "avx512_bf16": "avx512_bf16" in flags,
            "amx_bf16": "amx_bf16" in flags}
    info["label"] = (f"{model}, {info['cores']} cores, avx512_bf16 "
                     f"{'yes' if info['avx512_bf16'] else 'no'}")
    return info


def results_dir(out_dir: str | os.PathLike[str] | None = None) -> Path:
    """The folder results go to: ``out_dir`` (created), or ``benchmarks/results/``."""
    folder = Path(out_dir) if out_dir else RESULTS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def warn_if_all_failed(results: Sequence[Any], label: str) -> bool:
    """Whether every request of a run (``results``: :class:`metrics.RequestResult`) failed;
    if so, print a WARNING naming the most frequent failure (as ``loadgen`` does)."""
    if not results or any(r.status == "ok" for r in results):
        return False
    report(summarize(results), label)
    return True


def exit_status(failed_runs: Sequence[str]) -> int:
    """1 (with an ERROR line naming them) when some runs had no request complete, else 0."""
    if failed_runs:
        print(f"ERROR: no request completed in {', '.join(failed_runs)}", file=sys.stderr)
        return 1
    return 0


def write_json(name: str, payload: dict[str, Any],
               out_dir: str | os.PathLike[str] | None = None) -> Path:
    """Write ``<out_dir>/<name>.json`` (by default under ``benchmarks/results/``) with the
    machine's state added."""
    path = results_dir(out_dir) / f"{name}.json"
    payload = {**payload, "machine_after": machine()}
    path.write_text(json.dumps(finite(payload), indent=1, default=float))
    return path


def finite(value: Any) -> Any:
    """``value`` with NaN and infinities as None (strict JSON)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


_finite = finite  # the former private name


def save_figure(fig: plt.Figure, name: str,
                out_dir: str | os.PathLike[str] | None = None) -> Path:
    """Save ``<out_dir>/<name>.png`` (by default under ``benchmarks/results/``; small: 100 dpi)
    and close the figure."""
    path = results_dir(out_dir) / f"{name}.png"
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path


# --------------------------------------------------------------------------- plots


def fmt_ms(value_ms: float | None) -> str:
    """A duration given in ms, readable: ``167 ms``, ``1.5 s``, ``11.7 s``; ``n/a`` for None."""
    if value_ms is None or not math.isfinite(value_ms):
        return "n/a"
    if abs(value_ms) < 1:
        return f"{value_ms:.2g} ms"
    if abs(value_ms) < 1000:
        return f"{value_ms:.0f} ms"
    return f"{value_ms / 1000:.3g} s"


def ms_log_axis(axis: Any) -> None:
    """A log-scaled axis of milliseconds labelled as durations: ``100 ms``, ``1 s``, ``10 s`` at
    powers of ten; when the axis spans few decades, also at 2 and 5 times them (under 2.5
    decades) or 2, 3, 5 and 7 times them (under 1.2), so that it always has a few labels and
    never so many that they collide."""
    from matplotlib.ticker import FuncFormatter, LogLocator

    def minor(value: float, _pos: int) -> str:
        lo, hi = sorted(axis.get_view_interval())
        if lo <= 0 or value <= 0:
            return ""
        decades = math.log10(hi / lo)
        shown = (2, 3, 5, 7) if decades < 1.2 else (2, 5) if decades < 2.5 else ()
        mantissa = round(value / 10 ** math.floor(math.log10(value) + 1e-9), 6)
        return fmt_ms(value) if mantissa in shown else ""

    axis.set_major_locator(LogLocator(base=10, numticks=12))
    axis.set_major_formatter(FuncFormatter(lambda v, _pos: fmt_ms(v)))
    axis.set_minor_formatter(FuncFormatter(minor))


def legend_outside(ax: Any, gap: float = 0.02, **kwargs: Any) -> Any:
    """The axes' legend to the right of it, where it covers no data; ``gap`` (a fraction of the
    axes' width) leaves room for labels on the right-hand spine."""
    kwargs.setdefault("fontsize", 9)
    return ax.legend(loc="upper left", bbox_to_anchor=(1.0 + gap, 1.0), borderaxespad=0.0,
                     **kwargs)


def annotate_bars(ax: Any, bars: Any, labels: list[str], *, fontsize: float = 8,
                  rotation: float = 0, tops: list[float] | None = None) -> None:
    """Write each bar's label (its value) just above it, or above ``tops`` (e.g. the highest
    point drawn over the bar), so that a short bar reads too; bars without a finite height get
    none."""
    tops = tops or [bar.get_height() for bar in bars]
    for bar, label, top in zip(bars, labels, tops, strict=True):
        if not math.isfinite(bar.get_height()):
            continue
        ax.annotate(label, (bar.get_x() + bar.get_width() / 2, top),
                    xytext=(0, 2), textcoords="offset points", ha="center", va="bottom",
                    fontsize=fontsize, rotation=rotation, clip_on=False)


def headroom(ax: Any, factor: float = 1.15) -> None:
    """Room above the tallest bar for its label: the upper y limit times ``factor`` on a linear
    axis, times ``4 x factor`` on a log axis."""
    lo, hi = ax.get_ylim()
    ax.set_ylim(lo, hi * factor * (4 if ax.get_yscale() == "log" else 1))


def reference_tokenizer():
    """The reference backend's byte-level tokenizer (one token per byte)."""
    from inference.engine.backends.reference import ByteTokenizer

    return ByteTokenizer()


def model_tokenizer():
    """The default model's tokenizer (without loading the model)."""
    from inference.protocol.settings import PlatformSettings
    from inference.tokenization import Tokenizer

    return Tokenizer.from_folder(PlatformSettings().model_folder)


def make_engine(*, real_model: bool, step_delay_s: float = 0.0, **settings: Any):
    """An :class:`~inference.engine.llm_engine.LLMEngine` on the real default model or on the
    reference backend with ``step_delay_s`` seconds per forward pass; ``settings`` are EngineConfig
    fields.
    """
    from inference.engine.config import EngineConfig
    from inference.engine.llm_engine import LLMEngine

    if real_model:
        return LLMEngine(EngineConfig(backend="transformers", **settings))
    return LLMEngine(EngineConfig(backend="reference", reference_step_delay_s=step_delay_s,
                                  **settings))


def print_table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    """Print rows as a plain aligned table (numbers to 3 significant figures, whole from 100)."""

    def fmt(v: Any) -> str:
        if not isinstance(v, float):
            return str(v)
        return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"

    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max([len(c), *(len(row[i]) for row in cells)]) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)))


def cpu_seconds(processes: dict[str, int]) -> dict[str, float]:
    """User + system CPU seconds so far of each named process id (0 for one that is gone)."""
    import psutil

    out = {}
    for name, pid in processes.items():
        try:
            times = psutil.Process(pid).cpu_times()
        except psutil.Error:
            out[name] = 0.0
        else:
            out[name] = times.user + times.system
    return out


def redis_server_pid() -> int | None:
    """The local ``redis-server``'s process id, if it runs on this machine and is visible."""
    import psutil

    for proc in psutil.process_iter(["name"]):
        if proc.info["name"] == "redis-server":
            return proc.pid
    return None


def cpu_counters() -> tuple[int, int]:
    """``(steal, total)`` jiffies of all CPUs so far (``/proc/stat``; (0, 0) where it cannot be
    read): the share of a span's CPU time the hypervisor gave to other guests is the steal
    difference over the total difference."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(v) for v in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    return (fields[7] if len(fields) > 7 else 0), sum(fields[:8])


def steal_share(before: tuple[int, int], after: tuple[int, int]) -> float | None:
    """The share (0-1) of CPU time stolen between two :func:`cpu_counters` readings."""
    total = after[1] - before[1]
    return round((after[0] - before[0]) / total, 3) if total > 0 else None


def pass_counts(stats: dict[str, Any]) -> tuple[int, int, float]:
    """``(ticks, tokens generated, seconds in ticks)`` so far in engine stats (a worker's, their
    sum, or an in-process engine's)."""
    return (int(stats.get("tick_count") or 0), int(stats.get("tokens_generated") or 0),
            float(stats.get("tick_seconds_total") or 0.0))


def pass_figures(before: tuple[int, int, float], after: tuple[int, int, float],
                 seconds: float) -> dict[str, Any]:
    """The engine's ticks over a run, the tokens each generated on average (the decode rows
    a pass carried, about), the mean time of one (ms, the engine's own clock) and the share of
    the run's ``seconds`` the engine spent in ticks (the rest it waited for work)."""
    ticks, tokens = after[0] - before[0], after[1] - before[1]
    busy = after[2] - before[2]
    return {"ticks": ticks, "tokens_per_tick": round(tokens / ticks, 2) if ticks else None,
            "ms_per_tick": round(1000 * busy / ticks, 1) if ticks else None,
            "busy_share": round(busy / seconds, 3) if seconds > 0 else None}
