"""The faults: a thread that kills (SIGKILL or SIGTERM) and restarts the platform's processes and
Redis at random moments from a seeded schedule, and restarts any process that exits on its own."""

from __future__ import annotations

import random
import signal
import sys
import threading
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from benchmarks.harness.redis_server import PrivateRedis
from benchmarks.harness.servers import Platform
from benchmarks.serving.chaos.settings import KILL_ROUND, Options
from benchmarks.serving.chaos.timeline import Timeline


class Chaos(threading.Thread):
    """Kills and restarts processes at random moments until :meth:`stop`; restarts any process
    that exits on its own (after 1 s, as supervisord would)."""

    def __init__(self, platform: Platform, private_redis: PrivateRedis, options: Options,
                 timeline: Timeline, stop_at: float):
        super().__init__(name="chaos", daemon=True)
        self.stack = platform.stack
        self.redis = private_redis
        self.options = options
        self.timeline = timeline
        self.stop_at = stop_at
        self.rng = random.Random(f"{options.seed}-chaos")
        self._halt = threading.Event()
        self._last_check = 0.0  # when every process was last seen alive
        self._round: list[str] = []
        self._restarts = Counter()

    def stop(self) -> None:
        self._halt.set()

    # Processes that exit on their own.

    def _log_tail(self, name: str, lines: int = 4) -> list[str]:
        path = (self.redis.log_path if name == "redis"
                else Path(self.stack.log_dir) / f"{name}.log")
        try:
            return path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return []

    def supervise(self) -> None:
        """Restart every process found dead that no kill is handling."""
        dead = [n for n, p in self.stack.processes.items() if p.poll() is not None]
        if not self.redis.alive():
            dead.append("redis")
        if not dead:
            self._last_check = self.timeline.now()
            return
        for name in dead:
            rc = self.redis.proc.returncode if name == "redis" else (
                self.stack.processes[name].returncode)
            t = self.timeline.now()
            if name == "redis":
                self.timeline.redis_kills.append(t)
                self.timeline.redis_kills_unix.append(time.time())
            self.timeline.exits.append({"t": round(t, 2), "name": name, "returncode": rc,
                                        "log_tail": self._log_tail(name)})
            print(f"[chaos {t:7.1f}s] {name} exited on its own (status {rc}); restarting it",
                  flush=True)
            time.sleep(1.0)
            self._start(name, down_since=self._last_check)
        self._last_check = self.timeline.now()

    def _start(self, name: str, down_since: float) -> None:
        if name == "redis":
            self.redis.start()
            return
        self._restarts[name] += 1
        env = ({"WORKER_ID": f"{self.stack.prefix}-{name}-r{self._restarts[name]}"}
               if self.options.fresh_worker_ids and name.startswith("worker") else {})
        self.stack.restart(name, **env)
        if name == "daphne":
            self.timeline.daphne_down.append([down_since, self._wait_daphne()])

    def _wait_daphne(self, timeout_s: float = 30) -> float:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.stack.url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        return self.timeline.now()

    # Kills.

    def next_kind(self) -> str:
        if not self._round:
            self._round = list(KILL_ROUND)
            self.rng.shuffle(self._round)
        kind = self._round.pop()
        if kind == "beat" and "beat" not in self.stack.processes:
            return self.next_kind()
        return kind

    def kill_one(self, kind: str) -> None:
        rng = self.rng
        if kind == "worker":
            name = rng.choice([n for n in self.stack.processes if n.startswith("worker")])
            sig = rng.choice((signal.SIGKILL, signal.SIGTERM))
            delay = 0.0 if rng.random() < 0.25 else rng.uniform(0, 3)
        elif kind == "daphne":
            name, sig, delay = "daphne", rng.choice((signal.SIGKILL, signal.SIGTERM)), \
                rng.uniform(0, 1)
        elif kind == "celery":
            name, sig, delay = "celery", signal.SIGKILL, rng.uniform(0, 2)
        elif kind == "beat":
            name, sig, delay = "beat", rng.choice((signal.SIGKILL, signal.SIGTERM)), \
                rng.uniform(0, 2)
        else:
            name, sig, delay = "redis", rng.choice((signal.SIGKILL, signal.SIGTERM)), \
                rng.uniform(0.3, 1.0)
        t = self.timeline.now()
        record: dict[str, Any] = {"t": round(t, 2), "kind": kind, "name": name,
                                  "signal": signal.Signals(sig).name,
                                  "restart_after_s": round(delay, 2)}
        print(f"[chaos {t:7.1f}s] {signal.Signals(sig).name} {name}; restart after "
              f"{delay:.2f} s", flush=True)
        if kind == "redis":
            self.timeline.redis_kills.append(t)
            self.timeline.redis_kills_unix.append(time.time())
            record["returncode"] = self.redis.kill(sig)
        else:
            record["pid"] = self.stack.processes[name].pid
            record["returncode"] = self.stack.kill(name, sig)
        record["exited_after_s"] = round(self.timeline.now() - t, 2)
        time.sleep(delay)
        self._start(name, down_since=t)
        record["up_after_s"] = round(self.timeline.now() - t, 2)
        self.timeline.kills.append(record)

    def run(self) -> None:
        try:
            next_kill = self.timeline.now() + self.options.warmup_s
            while not self._halt.is_set() and self.timeline.now() < self.stop_at:
                self.supervise()
                if self.timeline.now() >= next_kill:
                    self.kill_one(self.next_kind())
                    next_kill = self.timeline.now() + self.rng.uniform(
                        *self.options.kill_interval_s)
                self._halt.wait(0.2)
            self.supervise()
        except Exception:  # noqa: BLE001 - reported, and the run goes on to its checks
            self.timeline.errors.append(traceback.format_exc())
            print(f"[chaos] harness error:\n{traceback.format_exc()}", file=sys.stderr)
