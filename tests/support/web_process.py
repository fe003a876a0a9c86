"""A web process of the test's own (``python -m llm_platform.serve``, as the run command starts
it) on a free port, an API key committed to the test database for it, and raw HTTP/1.1 over a
socket (what no HTTP client sends: malformed requests, raw bytes, odd request targets)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import redis

from benchmarks.harness.stack import REPO, database_url, free_port


class WebProcess:
    """One web process on ``database_url`` (``env``: more settings); its output in ``log``."""

    def __init__(self, database_url: str, log: Path, **env: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.redis_prefix = f"test-{uuid.uuid4().hex[:10]}"
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "llm_platform.serve", "-b", "127.0.0.1", "-p",
                 str(self.port), "llm_platform.asgi:application"],
                cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                env={**os.environ, "DATABASE_URL": database_url,
                     "REDIS_PREFIX": self.redis_prefix,
                     "DJANGO_SETTINGS_MODULE": "llm_platform.settings", **env})

    def wait_up(self, timeout_s: float = 60) -> WebProcess:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError("the web process did not start:\n" + self.output()[-3000:])
            time.sleep(0.2)

    def output(self) -> str:
        """What the process logged so far."""
        return self.log.read_text(errors="replace")

    def stop(self, redis_url: str | None = None) -> None:
        """Kill it, and drop its Redis keys from ``redis_url`` when given."""
        self.proc.kill()
        self.proc.wait(10)
        if redis_url:
            client = redis.Redis.from_url(redis_url)
            stale = list(client.scan_iter(f"{self.redis_prefix}*", count=1000))
            if stale:
                client.delete(*stale)


@contextmanager
def committed_key(django_db_blocker, name: str) -> Iterator[tuple[str, str]]:
    """A tenant ``name`` with an API key, committed to the test database (a web process of the
    test's own reads it), deleted afterwards: (the ``DATABASE_URL`` of that database, the raw
    key). The test database must be set up (a test of the module is marked ``django_db``).

    The key's ``last_used_at`` is set a day ahead: the web process then never writes it, which
    would wait for SQLite's write lock while a test holds its transaction open.
    """
    from datetime import timedelta

    from django.db import connection
    from django.utils import timezone

    from tenants.models import ApiKey, Tenant
    from tenants.services import create_tenant

    with django_db_blocker.unblock():
        url = database_url(connection.settings_dict)
        tenant, key, raw = create_tenant(f"{name}-{uuid.uuid4().hex[:6]}")
        ApiKey.objects.filter(pk=key.pk).update(last_used_at=timezone.now() + timedelta(days=1))
    try:
        yield url, raw
    finally:
        with django_db_blocker.unblock():
            Tenant.objects.filter(pk=tenant.pk).delete()


@dataclass
class RawResponse:
    """An HTTP response as read off the socket: ``status`` (0 when none came), ``headers``
    (names in lower case), ``body`` (bytes after the headers, as sent: chunked framing kept)."""

    status: int
    headers: dict[str, str]
    body: bytes
    raw: bytes

    def json_error(self) -> dict:
        """The platform's error object of a JSON body (asserts its shape)."""
        import json

        assert self.headers.get("content-type") == "application/json", self.raw[:400]
        body = self.body
        if self.headers.get("transfer-encoding") == "chunked":
            body = dechunk(body)
        error = json.loads(body)["error"]
        assert set(error) >= {"message", "type", "param", "code"}, error
        assert isinstance(error["message"], str) and error["message"]
        return error


def dechunk(body: bytes) -> bytes:
    """The payload of a chunked body."""
    out, rest = b"", body
    while rest:
        size, _, rest = rest.partition(b"\r\n")
        length = int(size.split(b";")[0] or b"0", 16)
        if length == 0:
            break
        out, rest = out + rest[:length], rest[length + 2:]
    return out


def parse_response(raw: bytes) -> RawResponse:
    """The first response in ``raw`` (what a server sent on one connection)."""
    if not raw.startswith(b"HTTP/"):
        return RawResponse(0, {}, b"", raw)
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split(b" ")[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return RawResponse(status, headers, body, raw)


def exchange(port: int, data: bytes, *, timeout_s: float = 30) -> RawResponse:
    """Send ``data`` on a new connection, read until the server closes it (or ``timeout_s``
    passes without a byte), and parse what came back."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as conn:
        with contextlib.suppress(OSError):  # refused while sending: the answer came before
            conn.sendall(data)
        out = b""
        try:
            while part := conn.recv(65536):
                out += part
        except OSError:
            pass
    return parse_response(out)
