"""Every end bills what its client got, with the whole platform as processes: daphne killed with
answers in flight, daphne drained with an answer not streamed, Redis flushed under load.

Heartbeats are short (3 s) so "within its TTL" is seconds; the reference backend takes ``STEP_S``
per forward pass, so an answer's tokens arrive at a known pace.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest
import redis

from benchmarks.harness.redis_server import PrivateRedis
from benchmarks.harness.stack import Stack, database_url
from gateway import delivery
from tenants.models import UsageRecord
from tests.support.e2e import TEST_HEARTBEATS, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STEP_S = 0.05
TTL_S = 3
# After a web process died, a stream is billed up to its last checkpoint: at most the tokens sent
# in the last checkpoint interval and the last read's (a worker tick: one token) below what its
# client got, never above.
CHECKPOINT_LAG = round(delivery.CHECKPOINT_INTERVAL_S / STEP_S) + 2
SETTINGS = {**TEST_HEARTBEATS, "WORKER_HEARTBEAT_TTL_S": TTL_S, "WEB_HEARTBEAT_TTL_S": TTL_S,
            "REFERENCE_STEP_DELAY_S": STEP_S, "MAX_BATCH_SIZE": 8, "WORKER_PREFETCH": 2,
            "STREAM_DECISION_TIMEOUT_S": 1, "SSE_KEEPALIVE_S": 1, "WEB_DRAIN_S": 2,
            "USAGE_RECONCILE_INTERVAL_S": 1, "SWEEP_INTERVAL_S": 1}


def start(request, django_db_blocker, tmp_path, redis_url: str) -> Stack:
    """The platform on ``redis_url``, Celery beat included (the reconciliation runs each
    second)."""
    from django.db import connection

    with django_db_blocker.unblock():
        db_url = database_url(connection.settings_dict)
    stack = Stack(db_url, redis_url, tmp_path, workers=1, beat=True,
                  **{k: str(v) for k, v in SETTINGS.items()})
    request.addfinalizer(stack.stop)
    try:
        stack.start()
    except Exception:
        print(stack.logs())
        raise
    return stack


@pytest.fixture(scope="module")
def stack(request, django_db_setup, django_db_blocker, tmp_path_factory):
    from django.conf import settings

    return start(request, django_db_blocker, tmp_path_factory.mktemp("stack"),
                 settings.REDIS_URL)


@dataclass
class Client:
    """One completion read on a thread: what its client got."""

    url: str
    key: str
    max_tokens: int
    stream: bool = True
    tokens: int = 0
    status: int | None = None
    error: dict = field(default_factory=dict)
    done: bool = False
    cut: bool = False  # the connection dropped
    ended_at: float | None = None
    request_id: str = ""

    def start(self) -> Client:
        threading.Thread(target=self._run, daemon=True).start()
        return self

    def _run(self) -> None:
        body = {"model": "SmolLM2-135M-Instruct", "prompt": "once upon a time",
                "max_tokens": self.max_tokens, "stream": self.stream, "temperature": 0}
        headers = {"Authorization": f"Bearer {self.key}"}
        try:
            if self.stream:
                self._read_stream(body, headers)
            else:
                reply = httpx.post(f"{self.url}/v1/completions", json=body, headers=headers,
                                   timeout=120)
                self.status = reply.status_code
                data = reply.json()
                self.error = data.get("error") or {}
                if not self.error:
                    self.request_id = data["id"].removeprefix("cmpl-")
                    self.tokens = data["usage"]["completion_tokens"]
                    self.done = True
        except httpx.HTTPError:
            self.cut = True
        self.ended_at = time.monotonic()

    def _read_stream(self, body: dict, headers: dict) -> None:
        with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=120,
                          headers=headers) as response:
            self.status = response.status_code
            for line in response.iter_lines():
                if line == "data: [DONE]":
                    self.done = True
                elif line.startswith("data: "):
                    data = json.loads(line[6:])
                    if "error" in data:
                        self.error = data["error"]
                    else:
                        self.request_id = data["id"].removeprefix("cmpl-")
                        self.tokens += sum(len(c["text"]) for c in data["choices"])


def ready(stack: Stack) -> bool:
    try:
        return httpx.get(f"{stack.url}/readyz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def records(tenant, n: int, timeout_s: float) -> list[UsageRecord]:
    found = wait_for(lambda: (r := list(UsageRecord.objects.filter(tenant=tenant)))
                     and len(r) >= n and r, timeout_s)
    return found or list(UsageRecord.objects.filter(tenant=tenant))


def test_answers_that_end_after_their_web_process_is_killed_bill_what_their_clients_got(
        stack, make_tenant, transactional_db):
    tenant, _, raw = make_tenant()
    streams = [Client(stack.url, raw, 40).start() for _ in range(3)]
    plain = [Client(stack.url, raw, 40, stream=False).start() for _ in range(2)]
    assert wait_for(lambda: all(s.tokens >= 8 for s in streams), 30)
    stack.kill("daphne", signal.SIGKILL)
    # 2 s of tokens each: they end within the web heartbeat's TTL, no one stops them.
    assert wait_for(lambda: all(c.ended_at for c in streams + plain), 10)
    assert all(c.cut and not c.done for c in streams + plain), streams + plain
    stack.restart("daphne")
    assert wait_for(lambda: ready(stack), 30)
    # Recorded once the web process is judged gone (its TTL) by the reconciliation (each s).
    rows = records(tenant, 5, TTL_S + 20)
    assert len(rows) == 5, rows
    by_id = {r.request_id: r for r in rows}
    for s in streams:
        row = by_id.pop(s.request_id)
        assert (row.status, row.finish_reason, row.error_code) == (499, "abort", ""), row
        assert s.tokens - CHECKPOINT_LAG <= row.completion_tokens <= s.tokens, (row, s)
        assert row.prompt_tokens > 0
    for row in by_id.values():  # the answers not streamed: nobody got them
        assert (row.prompt_tokens, row.completion_tokens, row.status) == (0, 0, 499), row


def test_a_web_drain_bills_nothing_for_an_answer_not_streamed_it_interrupted(
        stack, make_tenant, transactional_db):
    tenant, _, raw = make_tenant()
    plain = Client(stack.url, raw, 1000, stream=False).start()  # 50 s: longer than the drain
    streamed = Client(stack.url, raw, 1000).start()
    assert wait_for(lambda: streamed.tokens >= 3, 30)
    stack.kill("daphne", signal.SIGTERM, wait_s=30)
    assert wait_for(lambda: plain.ended_at and streamed.ended_at, 10)
    assert plain.status == 503 and plain.error["code"] == "interrupted", plain
    assert plain.error["details"]["completion_tokens"] == 0
    assert streamed.error["code"] == "interrupted", streamed
    assert streamed.error["details"]["completion_tokens"] == streamed.tokens
    stack.restart("daphne")
    assert wait_for(lambda: ready(stack), 30)
    rows = records(tenant, 2, 15)
    by_id = {r.request_id: r for r in rows}
    row = by_id.pop(streamed.request_id)
    assert (row.completion_tokens, row.status, row.error_code) == (streamed.tokens, 503,
                                                                    "interrupted")
    assert row.prompt_tokens > 0
    [row] = by_id.values()
    assert (row.prompt_tokens, row.completion_tokens, row.status, row.error_code) == (
        0, 0, 503, "interrupted"), row


@pytest.fixture(scope="module")
def volatile(request, django_db_setup, django_db_blocker, tmp_path_factory):
    """The platform on a redis-server of its own, which the test flushes."""
    folder = tmp_path_factory.mktemp("volatile")
    server = PrivateRedis(folder, folder / "redis.log", "none")
    server.start()
    request.addfinalizer(lambda: server.kill(signal.SIGKILL))
    return start(request, django_db_blocker, folder, server.url)


def test_streams_redis_lost_are_billed_the_tokens_their_clients_got(
        volatile, make_tenant, transactional_db):
    tenant, _, raw = make_tenant()
    streams = [Client(volatile.url, raw, 200).start() for _ in range(4)]
    plain = [Client(volatile.url, raw, 200, stream=False).start() for _ in range(2)]
    assert wait_for(lambda: all(s.tokens >= 5 for s in streams), 30)
    redis.Redis.from_url(volatile.env["REDIS_URL"]).flushall()
    assert wait_for(lambda: all(c.ended_at for c in streams + plain), 15)
    for s in streams:  # each says how many tokens it got, and is billed those
        assert s.error["code"] in ("state_lost", "service_unavailable") and not s.done, s
        assert s.error["retryable"] is True
        assert s.error["details"]["completion_tokens"] == s.tokens, s
    for p in plain:
        assert p.status == 503 and p.error["details"]["completion_tokens"] == 0, p
    rows = records(tenant, len(streams) + len(plain), 30)  # each ran: each has its entry
    by_id = {r.request_id: r for r in rows}
    for s in streams:
        row = by_id.pop(s.request_id)
        assert (row.completion_tokens, row.status) == (s.tokens, 503), (row, s)
        assert row.prompt_tokens > 0
    for row in by_id.values():  # the answers not streamed: nobody got them
        assert (row.prompt_tokens, row.completion_tokens) == (0, 0), row
