"""A ``redis-server`` of a run's or a test's own, which the chaos run and the fault tests kill and
restart on the same port and data folder while the platform runs on it."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import redis

from benchmarks.harness.stack import free_port


class PrivateRedis:
    """A ``redis-server`` of the caller's own, on a free port and a data folder that survive its
    restarts (so killing it harms no one else). ``persistence``: ``aof`` (every write fsynced
    before it is answered) or ``none``."""

    def __init__(self, data_dir: Path, log_path: Path, persistence: str):
        self.port = free_port()
        self.dir = data_dir
        self.log_path = log_path
        self.persistence = persistence
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """The server's URL (database 0)."""
        return f"redis://127.0.0.1:{self.port}/0"

    def args(self) -> list[str]:
        """The ``redis-server`` command line."""
        durable = (["--appendonly", "yes", "--appendfsync", "always"]
                   if self.persistence == "aof" else ["--appendonly", "no"])
        return ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir",
                str(self.dir), "--save", "", *durable, "--daemonize", "no",
                "--maxclients", "10000"]

    def start(self, timeout_s: float = 15) -> None:
        """Start the server (its output appended to ``log_path``) and wait until it answers.

        Raises:
            RuntimeError: when it exits first.
            TimeoutError: when it does not answer within ``timeout_s`` seconds.
        """
        log = open(self.log_path, "ab")  # noqa: SIM115 - lives with the process
        self.proc = subprocess.Popen(self.args(), stdout=log, stderr=subprocess.STDOUT)
        client = redis.Redis(port=self.port, socket_timeout=1)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited; see {self.log_path}")
            try:
                if client.ping():
                    return
            except redis.RedisError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"redis-server did not answer within {timeout_s} s")

    def kill(self, sig: int, wait_s: float = 15) -> int | None:
        """Send ``sig`` and wait for the exit (SIGKILL after ``wait_s`` seconds); returns its exit
        status."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(5)

    def alive(self) -> bool:
        """Whether the server was started and still runs."""
        return self.proc is not None and self.proc.poll() is None
