"""What happened during a run, on the run's clock: the kills, the processes that exited on their
own, daphne's down windows and Redis's restarts."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Timeline:
    """Kills, unexpected exits and daphne's down windows (seconds since the run's start)."""

    t0: float = field(default_factory=time.monotonic)
    kills: list[dict[str, Any]] = field(default_factory=list)
    exits: list[dict[str, Any]] = field(default_factory=list)
    daphne_down: list[list[float]] = field(default_factory=list)
    redis_kills: list[float] = field(default_factory=list)
    redis_kills_unix: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def now(self) -> float:
        """Seconds since the run's start."""
        return time.monotonic() - self.t0

    def daphne_down_during(self, start: float, end: float) -> bool:
        """Whether daphne was down at any time from ``start`` to ``end``."""
        return any(down <= end and up >= start for down, up in self.daphne_down)

    def kills_during(self, start: float, end: float) -> list[str]:
        """The kills from 1 s before ``start`` to ``end``, as ``12.3s worker0 SIGKILL``."""
        return [f"{k['t']:.1f}s {k['name']} {k['signal']}" for k in self.kills
                if start - 1 <= k["t"] <= end]
