"""The whole platform as separate processes, for end-to-end tests: daphne, inference workers and a
Celery worker (and, when asked, Celery beat), on the test database and a private Redis key prefix.

Each process has a name (``daphne``, ``celery``, ``beat``, ``worker0``, ``worker1``, ...):
:meth:`Stack.kill` and :meth:`Stack.restart` act on one by its name, and a restarted process keeps
its command, port and worker id (the chaos harness, ``benchmarks/serving/chaos/``)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx

from inference.protocol.keys import Keys, queue_script

GATE1_LUA = queue_script("gate1")

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
# The Celery worker's flags beyond the pool and log level: no heartbeat events, gossip or mingle.
CELERY_QUIET = ("--without-heartbeat", "--without-gossip", "--without-mingle")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def database_url(settings_dict: dict) -> str:
    """A DATABASE_URL for the test database pytest-django created."""
    engine, name = settings_dict["ENGINE"], settings_dict["NAME"]
    if "sqlite" in engine:  # Django's backend or the platform's (llm_platform.sqlite)
        return f"sqlite:///{name}"
    user, password = settings_dict.get("USER") or "", settings_dict.get("PASSWORD") or ""
    auth = f"{user}:{password}@" if password else (f"{user}@" if user else "")
    host, port = settings_dict.get("HOST") or "127.0.0.1", settings_dict.get("PORT") or 5432
    return f"postgres://{auth}{host}:{port}/{name}"


class Stack:
    """Start with :meth:`start`; ``url``, ``env`` and ``logs`` describe it; :meth:`stop` ends it."""

    def __init__(self, db_url: str, redis_url: str, log_dir: Path, *, workers: int = 2,
                 beat: bool = False, **env: str):
        self.prefix = f"e2e-{uuid.uuid4().hex[:8]}"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_dir = log_dir
        self.num_workers = workers
        self.beat = beat
        self.env = {
            **os.environ,
            "DATABASE_URL": db_url,
            "REDIS_URL": redis_url,
            "REDIS_PREFIX": self.prefix,
            "CELERY_TASK_DEFAULT_QUEUE": f"{self.prefix}-celery",
            "BACKEND": "reference",
            "DJANGO_SETTINGS_MODULE": "llm_platform.settings",
            **env,
        }
        self.workers: list[subprocess.Popen] = []
        self.others: list[subprocess.Popen] = []
        # How each named process was started (its command and extra environment), for restarts.
        self._commands: dict[str, tuple[list[str], dict[str, str]]] = {}
        self.processes: dict[str, subprocess.Popen] = {}

    def _spawn(self, name: str, args: list[str], **env: str) -> subprocess.Popen:
        """Start the process ``name`` (its output in ``{log_dir}/{name}.log``; a restart of the
        same name appends to it)."""
        mode = "ab" if name in self._commands else "wb"
        log = open(self.log_dir / f"{name}.log", mode)  # noqa: SIM115 - lives with the process
        proc = subprocess.Popen(args, cwd=REPO, env={**self.env, **env}, stdout=log,
                                stderr=subprocess.STDOUT)
        self._commands[name] = (args, env)
        self.processes[name] = proc
        return proc

    def start_worker(self, **env: str) -> subprocess.Popen:
        """Start worker ``worker{n}`` (``WORKER_ID`` ``{prefix}-w{n}``), ``env`` added to its
        environment (e.g. ``MODEL_NAME`` and ``MODEL_PATH``: a worker of another base model)."""
        n = len(self.workers)
        proc = self._spawn(f"worker{n}", [sys.executable, "-m", "inference.worker"],
                           WORKER_ID=f"{self.prefix}-w{n}", **env)
        self.workers.append(proc)
        return proc

    def start_beat(self) -> subprocess.Popen:
        """Celery beat, as the run command starts it (its schedule file in the log folder)."""
        proc = self._spawn("beat", [str(BIN / "celery"), "-A", "llm_platform", "beat", "-l",
                                    "info", "-s", str(self.log_dir / "beat-schedule")])
        self.others.append(proc)
        return proc

    def start(self, timeout_s: float = 180) -> Stack:
        # daphne with a drain on SIGTERM (llm_platform/serve.py), as the run command starts it.
        self.others.append(self._spawn("daphne", [sys.executable, "-m", "llm_platform.serve",
                                                  "-b", "127.0.0.1", "-p", str(self.port),
                                                  "llm_platform.asgi:application"]))
        # As scripts/supervisord.conf starts it: no worker-to-worker chatter (docs/platform.md).
        self.others.append(self._spawn("celery", [str(BIN / "celery"), "-A", "llm_platform",
                                                  "worker", "-P", "solo", "-l", "info",
                                                  *CELERY_QUIET]))
        for _ in range(self.num_workers):
            self.start_worker()
        if self.beat:
            self.start_beat()
        self.wait_ready(self.num_workers, timeout_s)
        return self

    @property
    def names(self) -> list[str]:
        """The names of the processes started so far (``daphne``, ``celery``, ``worker0``, ...)."""
        return list(self.processes)

    def worker_id(self, name: str) -> str:
        """The ``WORKER_ID`` the worker ``name`` runs under (its heartbeat's member)."""
        return self._commands[name][1]["WORKER_ID"]

    def kill(self, name: str, sig: int = signal.SIGKILL, wait_s: float = 20) -> int | None:
        """Send ``sig`` to the process ``name`` and wait up to ``wait_s`` for it to exit (then
        SIGKILL it); return its exit status (None if it could not be reaped)."""
        proc = self.processes[name]
        if proc.poll() is None:
            proc.send_signal(sig)
        try:
            return proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            try:
                return proc.wait(5)
            except subprocess.TimeoutExpired:
                return None

    def restart(self, name: str, **env: str) -> subprocess.Popen:
        """Start the process ``name`` again with the same command, port and worker id (killing
        it first if it still runs); ``env`` overrides its environment from now on (e.g. a new
        ``WORKER_ID``). It replaces the old one in :attr:`workers` or :attr:`others`."""
        old = self.processes[name]
        if old.poll() is None:
            self.kill(name)
        args, before = self._commands[name]
        proc = self._spawn(name, args, **{**before, **env})
        for group in (self.workers, self.others):
            for i, member in enumerate(group):
                if member is old:
                    group[i] = proc
        return proc

    def wait_ready(self, workers: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for proc in self.workers + self.others:
                if proc.poll() is not None:
                    raise RuntimeError(f"a stack process exited early; see {self.log_dir}")
            try:
                ready = httpx.get(f"{self.url}/readyz", timeout=2)
                if (ready.status_code == 200 and ready.json()["checks"]["workers"] >= workers
                        and self.celery_ready() and self.workers_serving() >= workers):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"the stack was not ready within {timeout_s} s; see {self.log_dir}")

    def workers_serving(self) -> int:
        """How many of the workers have published their stats: they have loaded their model and
        take work (a loading worker already beats, so ``/readyz`` counts it earlier, and a
        request sent then waits for it in the queue)."""
        import redis

        from inference.protocol.keys import Keys

        keys = Keys(self.prefix)
        client = redis.Redis.from_url(self.env["REDIS_URL"])
        try:
            return sum(bool(client.exists(keys.stats(f"{self.prefix}-w{n}")))
                       for n in range(len(self.workers)))
        finally:
            client.close()

    def celery_ready(self) -> bool:
        """Whether the Celery worker consumes its queue (usage records are written by it)."""
        log = self.log_dir / "celery.log"
        return log.exists() and b" ready." in log.read_bytes()

    def wait_idle(self, timeout_s: float = 15) -> None:
        """Wait until no request is in flight and Celery has written every usage record.

        A test's database flush (TRUNCATE) must not race a usage record still being written: on
        PostgreSQL that is a deadlock.
        """
        import json

        import redis

        client = redis.Redis.from_url(self.env["REDIS_URL"])
        queue = self.env["CELERY_TASK_DEFAULT_QUEUE"]
        deadline = time.monotonic() + timeout_s
        quiet_since = None
        while time.monotonic() < deadline:
            busy = client.llen(queue) > 0
            # Every base model's queue: the default model's, and each other one used.
            queues = [self.prefix, *(q.decode() for q in client.smembers(Keys(self.prefix).queues))]
            busy = busy or any(int(client.eval(GATE1_LUA, 0, q)) > 0 for q in queues)
            busy = busy or client.hlen(f"{self.prefix}:usage:pending") > 0  # not yet recorded
            for raw in client.mget(list(client.scan_iter(f"{self.prefix}:stats:*"))) if not busy \
                    else []:
                snap = json.loads(raw or "{}")
                busy = busy or snap.get("num_active", 0) + snap.get("num_prefilling", 0) > 0
            if busy:
                quiet_since = None
            elif quiet_since is None:
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since > 1.2:  # a stats period and a task's commit
                return
            time.sleep(0.1)

    def stop(self) -> None:
        procs = self.workers + self.others
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
        import redis

        client = redis.Redis.from_url(self.env["REDIS_URL"])
        for pattern in (f"{self.prefix}:*", self.env["CELERY_TASK_DEFAULT_QUEUE"]):
            stale = list(client.scan_iter(pattern, count=1000))
            if stale:
                client.delete(*stale)

    def logs(self) -> str:
        return "\n".join(f"== {p.name}\n{p.read_text()[-3000:]}"
                         for p in sorted(self.log_dir.glob("*.log")))
