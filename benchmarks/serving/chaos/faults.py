"""The faults: a thread that, at random moments from a seeded schedule, kills (SIGKILL or SIGTERM)
and restarts the platform's processes and Redis, pauses a worker or Redis (SIGSTOP, then SIGCONT)
for longer than the heartbeat TTL, and drains daphne (SIGTERM) while answers not streamed are in
flight; and that restarts any process that exits on its own.

A paused process still runs as far as :meth:`subprocess.Popen.poll` can tell, and nothing here
mistakes it for dead or alive: the schedule runs one fault at a time in this thread (nothing is
supervised while it sleeps through a pause), and every pause ends with its ``SIGCONT``, even on
an error."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import redis

from benchmarks.harness.redis_server import PrivateRedis
from benchmarks.harness.servers import Platform
from benchmarks.serving.chaos.load import Result, Steer
from benchmarks.serving.chaos.settings import KILL_ROUND, PLATFORM_ENV, Options
from benchmarks.serving.chaos.timeline import Timeline
from inference.protocol.keys import Keys

TTL_S = float(PLATFORM_ENV["WORKER_HEARTBEAT_TTL_S"])
# A heartbeat at most this old is a worker beating (seconds: three heartbeat intervals).
BEATING_S = 3 * float(PLATFORM_ENV["HEARTBEAT_INTERVAL_S"])
# How long a pause or a drain waits for its moment: every worker beating, answers not streamed
# in flight (seconds).
MOMENT_WAIT_S = 20.0
# A drain waits for this many answers not streamed in flight for at least DRAIN_RUNNING_S.
DRAIN_PLAIN_IN_FLIGHT, DRAIN_RUNNING_S = 2, 0.3
# A worker's pause waits this long at most for it to hold a request taken and not started,
# after a burst that fills every worker's rows (seconds).
TAKEN_WAIT_S = 5.0


class Chaos(threading.Thread):
    """Runs faults at random moments until :meth:`stop`; restarts any process that exits on its
    own (after 1 s, as supervisord would).

    Args:
        results: the load's requests as they are sent (a drain waits for answers not streamed
            in flight among them).
        steer: what the load is asked for (a drain asks for long answers not streamed).
    """

    def __init__(self, platform: Platform, private_redis: PrivateRedis, options: Options,
                 timeline: Timeline, stop_at: float, results: list[Result] | None = None,
                 steer: Steer | None = None):
        super().__init__(name="chaos", daemon=True)
        self.stack = platform.stack
        self.redis = private_redis
        self.options = options
        self.timeline = timeline
        self.stop_at = stop_at
        self.results = results if results is not None else []
        self.steer = steer or Steer()
        self.keys = Keys(self.stack.prefix)
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
        """Restart every process found dead that no fault is handling."""
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
            if name == "daphne":
                self.timeline.web_deaths.append(t)
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

    # The moments of pauses and drains.

    def _workers(self) -> list[str]:
        return [n for n in self.stack.processes if n.startswith("worker")]

    def _beating(self, timeout_s: float = MOMENT_WAIT_S) -> dict[str, str]:
        """Wait (at most ``timeout_s``) until every worker beats; return those that do, as
        worker id -> process name."""
        client = redis.Redis.from_url(self.redis.url, socket_timeout=2)
        deadline = time.monotonic() + timeout_s
        beating: dict[str, str] = {}
        try:
            while True:
                try:
                    scores = dict(client.zrange(self.keys.workers, 0, -1, withscores=True))
                except redis.RedisError:
                    scores = {}
                now = time.time()
                beating = {}
                for name in self._workers():
                    wid = self.stack.worker_id(name)
                    score = scores.get(wid.encode())
                    if (self.stack.processes[name].poll() is None and score is not None
                            and now - score <= BEATING_S):
                        beating[wid] = name
                if len(beating) == len(self._workers()) or time.monotonic() > deadline:
                    return beating
                time.sleep(0.2)
        finally:
            client.close()

    def _owned(self, worker_id: str) -> tuple[list[str], list[str]]:
        """The ids the queue records as taken (not yet running) and running by ``worker_id``."""
        client = redis.Redis.from_url(self.redis.url, socket_timeout=2)
        try:
            running = {r.decode() for r in client.hkeys(self.keys.fq("running", worker_id))}
            taken = {r.decode() for r in client.hkeys(self.keys.fq("taken", worker_id))}
            return sorted(taken - running), sorted(running)
        except redis.RedisError:
            return [], []
        finally:
            client.close()

    def _fill(self, worker_id: str) -> None:
        """Ask the load for a burst that fills every worker's rows and its prefetch, and wait
        (at most :data:`TAKEN_WAIT_S`) until ``worker_id`` holds a request it has taken and not
        started."""
        rows = int(PLATFORM_ENV["MAX_BATCH_SIZE"]) + 1
        self.steer.burst = len(self._workers()) * rows + 2
        deadline = time.monotonic() + TAKEN_WAIT_S
        while time.monotonic() < deadline and not self._owned(worker_id)[0]:
            time.sleep(0.05)

    def _plain_in_flight(self) -> int:
        now = self.timeline.now()
        return sum(1 for r in self.results[-200:] if not r.stream and r.start and not r.end
                   and now - r.start >= DRAIN_RUNNING_S)

    # Faults.

    def next_kind(self) -> str:
        if not self._round:
            self._round = list(KILL_ROUND)
            self.rng.shuffle(self._round)
        kind = self._round.pop()
        if kind == "beat" and "beat" not in self.stack.processes:
            return self.next_kind()
        return kind

    def kill_one(self, kind: str) -> None:
        """Run one fault of ``kind`` (:data:`~.settings.KINDS`) and record it."""
        if kind.startswith("pause-"):
            return self.pause(kind)
        if kind == "drain-daphne":
            return self.drain()
        rng = self.rng
        if kind == "worker":
            name = rng.choice(self._workers())
            sig = rng.choice((signal.SIGKILL, signal.SIGTERM))
            delay = 0.0 if rng.random() < 0.25 else rng.uniform(0, 3)
        elif kind == "daphne":  # its death; its drain is drain-daphne
            name, sig, delay = "daphne", signal.SIGKILL, rng.uniform(0, 1)
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
            if kind == "daphne":
                self.timeline.web_deaths.append(t)
            record["pid"] = self.stack.processes[name].pid
            record["returncode"] = self.stack.kill(name, sig)
        self._restart(record, name, t, delay)

    def _restart(self, record: dict[str, Any], name: str, t: float, delay: float) -> None:
        record["exited_after_s"] = round(self.timeline.now() - t, 2)
        time.sleep(delay)
        self._start(name, down_since=t)
        record["up_after_s"] = round(self.timeline.now() - t, 2)
        self.timeline.kills.append(record)

    def pause(self, kind: str) -> None:
        """SIGSTOP a worker (``pause-worker``) or Redis (``pause-redis``) for
        ``options.pause_ttls`` heartbeat TTLs, then SIGCONT it; first wait for every worker to
        beat (the record's ``live_workers``: whoever is declared dead while it was paused, but
        the paused worker, was alive). A worker is paused once it holds requests it has taken
        and not started (:meth:`_fill`); its record holds what the queue says it had taken and
        not started (``taken``) and was running (``running``) when it stopped."""
        name = self.rng.choice(self._workers()) if kind == "pause-worker" else "redis"
        pause_s = self.rng.uniform(*self.options.pause_ttls) * TTL_S
        live = self._beating()
        proc: subprocess.Popen | None = (self.redis.proc if name == "redis"
                                         else self.stack.processes[name])
        if proc is None or proc.poll() is not None:
            self._round.append(kind)  # it died meanwhile: supervise() restarts it first
            return
        if kind == "pause-worker":
            self._fill(self.stack.worker_id(name))
        t = self.timeline.now()
        record: dict[str, Any] = {"t": round(t, 2), "kind": kind, "name": name,
                                  "signal": "SIGSTOP", "pid": proc.pid,
                                  "paused_s": round(pause_s, 2), "live_workers": live}
        print(f"[chaos {t:7.1f}s] SIGSTOP {name} for {pause_s:.2f} s", flush=True)
        proc.send_signal(signal.SIGSTOP)
        try:
            if kind == "pause-worker":
                record["worker_id"] = self.stack.worker_id(name)
                record["taken"], record["running"] = self._owned(record["worker_id"])
            time.sleep(max(0.0, pause_s - (self.timeline.now() - t)))
        finally:
            proc.send_signal(signal.SIGCONT)
        record["resumed_at"] = round(self.timeline.now(), 2)
        record["up_after_s"] = round(self.timeline.now() - t, 2)
        self.timeline.kills.append(record)

    def drain(self) -> None:
        """SIGTERM daphne (it drains: ``llm_platform/serve.py``) once answers not streamed are
        in flight (the load is asked for some long ones), then restart it when it has exited."""
        delay = self.rng.uniform(0, 1)
        self.steer.long_plain = DRAIN_PLAIN_IN_FLIGHT + 1
        waited_from = self.timeline.now()
        while (self._plain_in_flight() < DRAIN_PLAIN_IN_FLIGHT
               and self.timeline.now() - waited_from < MOMENT_WAIT_S):
            time.sleep(0.05)
        t = self.timeline.now()
        record: dict[str, Any] = {"t": round(t, 2), "kind": "drain-daphne", "name": "daphne",
                                  "signal": "SIGTERM", "restart_after_s": round(delay, 2),
                                  "waited_s": round(t - waited_from, 2),
                                  "not_streamed_in_flight": self._plain_in_flight()}
        print(f"[chaos {t:7.1f}s] SIGTERM daphne (drain, {record['not_streamed_in_flight']} "
              f"answer(s) not streamed in flight); restart after {delay:.2f} s", flush=True)
        record["pid"] = self.stack.processes["daphne"].pid
        record["returncode"] = self.stack.kill("daphne", signal.SIGTERM)
        self._restart(record, "daphne", t, delay)

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
