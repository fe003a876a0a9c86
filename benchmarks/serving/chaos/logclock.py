"""When each log line was written, to within a fraction of a second: a thread samples the size of
every process's log (the web process's lines carry no time of their own) on the run's clock, and
after the run a line is dated by the samples around its end."""

from __future__ import annotations

import bisect
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class LogLine:
    """One log line (``log``: its file's name, ``worker0.log``), written after ``after`` and by
    ``by`` (seconds since the run's start; -inf, inf: before the first sample, after the last)."""

    log: str
    after: float
    by: float
    text: str

    def brief(self) -> str:
        return f"{self.log} {self.after:.1f}-{self.by:.1f}s: {self.text[:300]}"


class LogClock(threading.Thread):
    """Samples the size of every ``*.log`` in ``log_dir`` every ``period_s`` seconds of
    ``clock`` until :meth:`stop` (restarted processes append to their file, so sizes only
    grow)."""

    def __init__(self, log_dir: Path, clock: Callable[[], float], period_s: float = 0.25):
        super().__init__(name="log-clock", daemon=True)
        self.log_dir = Path(log_dir)
        self.clock = clock
        self.period_s = period_s
        self.samples: dict[str, tuple[list[float], list[int]]] = {}  # log -> (times, sizes)
        self._halt = threading.Event()

    def sample(self) -> None:
        t = self.clock()
        for path in self.log_dir.glob("*.log"):
            try:
                size = path.stat().st_size
            except OSError:
                continue
            times, sizes = self.samples.setdefault(path.name, ([], []))
            times.append(t)
            sizes.append(size)

    def run(self) -> None:
        while not self._halt.is_set():
            self.sample()
            self._halt.wait(self.period_s)

    def stop(self) -> None:
        self._halt.set()

    def date(self, log: str, end: int) -> tuple[float, float]:
        """When the line ending at byte ``end`` of ``log`` was written: (after, by)."""
        times, sizes = self.samples.get(log, ([], []))
        i = bisect.bisect_left(sizes, end)  # the first sample holding the whole line
        after = times[i - 1] if i > 0 else float("-inf")
        by = times[i] if i < len(times) else float("inf")
        return after, by

    def lines(self, pattern: re.Pattern[str], log_dir: Path | None = None) -> list[LogLine]:
        """Every line of the logs (in ``log_dir``, else the sampled folder: a copy of the same
        files) that matches ``pattern``, dated."""
        found = []
        for path in sorted(Path(log_dir or self.log_dir).glob("*.log")):
            end = 0
            with open(path, "rb") as handle:
                for raw in handle:
                    end += len(raw)
                    text = raw.decode(errors="replace").rstrip("\n")
                    if pattern.search(text):
                        found.append(LogLine(path.name, *self.date(path.name, end), text))
        return found
