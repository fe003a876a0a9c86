"""The machine a structured-output figure was measured on: the CPU's name and whether it has
native bf16 (``avx512_bf16``, which makes the worker's ``DTYPE=auto`` pick bf16), and how many
cores other processes kept busy while a run lasted (a noisy machine shows up there)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from benchmarks.harness.common import cpu_info as cpu  # noqa: F401 - the CPU line of every figure
from benchmarks.harness.common import redis_server_pid


def _machine_busy_s() -> float:
    """CPU seconds the whole machine has spent busy (not idle, not in iowait) since boot."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return 0.0
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def _process_s(pids: list[int]) -> float:
    """User + system CPU seconds so far of the given processes (gone ones count 0)."""
    import psutil

    total = 0.0
    for pid in pids:
        try:
            times = psutil.Process(pid).cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


class CpuMeter:
    """Cores other processes kept busy during a run: call it with the run's own process ids
    before the run and again after it; :attr:`foreign_cores` is then set (cores, 0 = quiet)."""

    def __init__(self) -> None:
        self.foreign_cores: float | None = None
        self._start: tuple[float, float, float] | None = None

    def __call__(self, pids: list[int]) -> None:
        pids = [*pids, *([p] if (p := redis_server_pid()) is not None else [])]
        now = (time.perf_counter(), _machine_busy_s(), _process_s(pids))
        if self._start is None:
            self._start = now
            return
        wall = now[0] - self._start[0]
        foreign = (now[1] - self._start[1]) - (now[2] - self._start[2])
        self.foreign_cores = max(0.0, foreign / wall) if wall > 0 else None
        self._start = None


def measured(fn: Any, *args: Any, **kwargs: Any) -> tuple[Any, float | None]:
    """``fn(*args, **kwargs)`` run in this process, and the cores other processes kept busy."""
    meter = CpuMeter()
    meter([os.getpid()])
    out = fn(*args, **kwargs)
    meter([os.getpid()])
    return out, meter.foreign_cores
