"""The whole platform for an experiment: its own SQLite database in a temporary folder, tenants
with API keys, then daphne, the inference worker(s) and Celery (and Celery beat, when asked) as
separate processes on a private Redis key prefix (:class:`benchmarks.harness.stack.Stack`), on the
shared Redis or on one the caller names."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import redis

from benchmarks.harness.stack import REPO, Stack
from inference.protocol.settings import PlatformSettings

REDIS_URL = PlatformSettings().redis_url

_CREATE_TENANTS = """
import json, os
from tenants.models import PriorityTier
from tenants.services import create_tenant
keys = {}
for t in json.loads(os.environ["BENCH_TENANTS"]):
    _, _, raw = create_tenant(t["name"], tier=PriorityTier.objects.get(name=t["tier"]),
                              operator_key=t["operator"], requests_per_minute=t["rpm"],
                              max_concurrent_requests=t.get("max_concurrent", 0))
    keys[t["name"]] = raw
print("KEYS " + json.dumps(keys))
"""


@dataclass
class TenantSpec:
    """A tenant to create: its name (also its slug and fairness key), tier and limits
    (``max_concurrent``: its concurrent requests, 0 unlimited)."""

    name: str
    tier: str = "standard"
    rpm: int = 0
    operator: bool = False
    max_concurrent: int = 0


class Platform:
    """Start with ``with Platform(tenants, BACKEND=..., ...) as p``: ``p.url``, ``p.keys`` (tenant
    -> raw API key; ``p.keys["operator"]`` reads ``/scheduler/stats``), ``p.stats()``.

    Args:
        tenants: tenants to create (an ``operator`` tenant is added).
        workers: inference worker processes.
        redis_url: the Redis the platform runs on (default: ``REDIS_URL``, the shared one).
        beat: whether to run Celery beat too (stats snapshots, cleanup), as the run command does.
        env: settings for every process (``BACKEND``, ``MAX_BATCH_SIZE``, ...).
    """

    def __init__(self, tenants: list[TenantSpec], *, workers: int = 1,
                 redis_url: str | None = None, beat: bool = False, **env: Any):
        self.tenants = [*tenants, TenantSpec("operator", operator=True)]
        self.workers = workers
        self.redis_url = redis_url or REDIS_URL
        self.beat = beat
        self.env = {k: str(v) for k, v in env.items()}
        self._tmp = tempfile.TemporaryDirectory(prefix="bench-platform-")
        self.dir = Path(self._tmp.name)
        self.db_url = f"sqlite:///{self.dir / 'db.sqlite3'}"
        self.keys: dict[str, str] = {}
        self.stack: Stack | None = None

    def manage(self, *args: str, **extra_env: str) -> str:
        """Run ``manage.py ARGS`` on the platform's database; return its standard output.

        Raises:
            RuntimeError: the command failed (its output in the message).
        """
        return self._manage(*args, **extra_env)

    def _manage(self, *args: str, **extra_env: str) -> str:
        env = {**os.environ, **self.env, "DATABASE_URL": self.db_url, "REDIS_URL": self.redis_url,
               "DJANGO_SETTINGS_MODULE": "llm_platform.settings", **extra_env}
        done = subprocess.run([sys.executable, "manage.py", *args], cwd=REPO, env=env,
                              capture_output=True, text=True, check=False)
        if done.returncode:
            raise RuntimeError(f"manage.py {args[0]} failed:\n{done.stdout}\n{done.stderr}")
        return done.stdout

    def __enter__(self) -> Platform:
        self._manage("migrate", "--noinput")
        tenants = [t.__dict__ for t in self.tenants]
        out = self._manage("shell", "-c", _CREATE_TENANTS, BENCH_TENANTS=json.dumps(tenants))
        line = next(x for x in out.splitlines() if x.startswith("KEYS "))
        self.keys = json.loads(line[len("KEYS "):])
        self.stack = Stack(self.db_url, self.redis_url, self.dir, workers=self.workers,
                           beat=self.beat, **self.env)
        try:
            self.stack.start(timeout_s=300)
        except Exception:
            print(self.stack.logs(), file=sys.stderr)
            self.stack.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.stack is not None:
            self.stack.wait_idle(timeout_s=10)
            self.stack.stop()
            client = redis.Redis.from_url(self.redis_url)
            stale = list(client.scan_iter(f"{self.stack.prefix}*", count=1000))
            if stale:
                client.delete(*stale)
        self._tmp.cleanup()

    @property
    def url(self) -> str:
        assert self.stack is not None
        return self.stack.url

    def stats(self) -> dict[str, Any]:
        """``GET /scheduler/stats``: gate 1, each worker's snapshot and their sum."""
        return httpx.get(f"{self.url}/scheduler/stats", timeout=5,
                         headers={"Authorization": f"Bearer {self.keys['operator']}"}).json()
