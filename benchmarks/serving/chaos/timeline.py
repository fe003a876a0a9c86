"""What happened during a run, on the run's clock: the faults (kills, pauses, drains), the
processes that exited on their own, daphne's down windows, its deaths and Redis's restarts."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Timeline:
    """Faults, unexpected exits and daphne's down windows (seconds since the run's start).

    ``kills`` holds every fault (``kind`` one of :data:`~.settings.KINDS`; a pause's
    ``signal`` is ``SIGSTOP`` and its ``resumed_at`` the time of its ``SIGCONT``);
    ``web_deaths`` the times daphne died without a drain (SIGKILL, or an exit on its own): its
    requests are billed up to their delivered checkpoint.
    """

    t0: float = field(default_factory=time.monotonic)
    t0_unix: float = field(default_factory=time.time)
    kills: list[dict[str, Any]] = field(default_factory=list)
    exits: list[dict[str, Any]] = field(default_factory=list)
    daphne_down: list[list[float]] = field(default_factory=list)
    web_deaths: list[float] = field(default_factory=list)
    redis_kills: list[float] = field(default_factory=list)
    redis_kills_unix: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def now(self) -> float:
        """Seconds since the run's start."""
        return time.monotonic() - self.t0

    def of_unix(self, t: float) -> float:
        """A unix time on the run's clock."""
        return t - self.t0_unix

    def daphne_down_during(self, start: float, end: float) -> bool:
        """Whether daphne was down at any time from ``start`` to ``end``."""
        return any(down <= end and up >= start for down, up in self.daphne_down)

    def web_died_during(self, start: float, end: float) -> bool:
        """Whether daphne died (no drain) from ``start`` to ``end``."""
        return any(start <= t <= end for t in self.web_deaths)

    def kills_during(self, start: float, end: float) -> list[str]:
        """The faults from 1 s before ``start`` to ``end``, as ``12.3s worker0 SIGKILL``."""
        return [f"{k['t']:.1f}s {k['name']} {k['signal']}" for k in self.kills
                if start - 1 <= k["t"] <= end]

    def faults(self, kinds: frozenset[str] | set[str], start: float, end: float,
               name: str | None = None) -> list[dict[str, Any]]:
        """The faults of ``kinds`` (of the process ``name``, if given) from ``start`` to
        ``end``; a pause counts for as long as it lasted, and a process that exited on its own
        as a kill of its kind."""
        found = [k for k in self.kills if k["kind"] in kinds
                 and k["t"] <= end and k.get("resumed_at", k["t"]) >= start
                 and (name is None or k["name"] == name)]
        for item in self.exits:
            kind = "worker" if item["name"].startswith("worker") else item["name"]
            if kind in kinds and start <= item["t"] <= end and name in (None, item["name"]):
                found.append({**item, "kind": kind})
        return found

    def pauses(self) -> list[dict[str, Any]]:
        """The pauses, in order."""
        return [k for k in self.kills if k["signal"] == "SIGSTOP"]
