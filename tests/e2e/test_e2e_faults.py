"""Processes killed under a running platform (real daphne, worker and Celery processes).

Heartbeats are short here (3 s) so that "within its TTL" is seconds; the reference backend takes
``STEP_S`` per forward pass, so a generation that ran on for nobody can be told from one stopped.
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

from tenants.models import UsageRecord
from tests.support.e2e import start_stack, stats, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STEP_S = 0.05
TTL_S = 3
DRAIN_S = 5


@pytest.fixture(scope="module")
def stack(request, django_db_setup, django_db_blocker, tmp_path_factory):
    return start_stack(request, django_db_blocker, tmp_path_factory, workers=1,
                       REFERENCE_STEP_DELAY_S=STEP_S, MAX_BATCH_SIZE=2, WORKER_PREFETCH=1,
                       WORKER_HEARTBEAT_TTL_S=TTL_S, WEB_HEARTBEAT_TTL_S=TTL_S,
                       HEARTBEAT_INTERVAL_S=0.5, STREAM_DECISION_TIMEOUT_S=1,
                       SSE_KEEPALIVE_S=1, WEB_DRAIN_S=DRAIN_S)


@pytest.fixture(autouse=True)
def whole_stack(stack):
    """Each test starts on a whole stack: a test that failed between killing a process and
    restarting it leaves the next ones their worker and web process, so that only it fails."""
    yield
    dead = [name for name in ("daphne", "worker0") if stack.processes[name].poll() is not None]
    for name in dead:
        stack.restart(name)
    if dead:
        stack.wait_ready(1, 60)


@dataclass
class Stream:
    """One streaming completion read on a thread: what the client saw, and when it ended."""

    url: str
    key: str
    max_tokens: int
    tokens: int = 0
    comments: int = 0
    done: bool = False
    error: dict = field(default_factory=dict)
    ended_at: float | None = None
    request_id: str = ""
    failure: str = ""

    def start(self) -> Stream:
        threading.Thread(target=self._read, daemon=True).start()
        return self

    def _read(self) -> None:
        body = {"model": "SmolLM2-135M-Instruct", "prompt": "once upon a time",
                "max_tokens": self.max_tokens, "stream": True, "temperature": 0}
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=120,
                              headers={"Authorization": f"Bearer {self.key}"}) as response:
                for line in response.iter_lines():
                    if line.startswith(":"):
                        self.comments += 1
                    elif line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: "):
                        data = json.loads(line[6:])
                        if "error" in data:
                            self.error = data["error"]
                        else:
                            self.request_id = data["id"].removeprefix("cmpl-")
                            self.tokens += sum(len(c["text"]) for c in data["choices"])
        except httpx.HTTPError as exc:
            self.failure = repr(exc)
        self.ended_at = time.monotonic()


def ready(stack, workers: int = 1) -> bool:
    try:
        reply = httpx.get(f"{stack.url}/readyz", timeout=2)
    except httpx.HTTPError:
        return False
    return reply.status_code == 200 and reply.json()["checks"]["workers"] == workers


def serving(stack) -> bool:
    """Ready, and a worker has published its stats since it started (a worker that stopped
    cleanly leaves its heartbeat to age out, so `/readyz` counts it for a TTL after it is gone:
    requests sent meanwhile wait for a restart; its stats it removes)."""
    client = redis.Redis.from_url(stack.env["REDIS_URL"])
    return ready(stack) and any(True for _ in client.scan_iter(f"{stack.prefix}:stats:*"))


def conc_leases(stack, tenant) -> int:
    client = redis.Redis.from_url(stack.env["REDIS_URL"])
    return client.zcount(f"{stack.prefix}:conc:tenant:{tenant.pk}", time.time() * 1000, "+inf")


def test_a_killed_workers_streams_end_within_its_ttl_and_its_waiting_ones_are_served(
        stack, make_tenant, transactional_db):
    tenant, _, raw = make_tenant(max_concurrent_requests=4)
    operator = make_tenant(operator_key=True)[2]
    streams = [Stream(stack.url, raw, 100).start() for _ in range(4)]
    assert wait_for(lambda: sum(s.tokens >= 3 for s in streams) == 2, 20)
    running = [s for s in streams if s.tokens]
    waiting = [s for s in streams if not s.tokens]
    killed_at = time.monotonic()
    stack.kill("worker0", signal.SIGKILL)
    # No worker is left: the web tier itself notices the death and ends the streams.
    assert wait_for(lambda: all(s.ended_at for s in running), TTL_S + 4)
    for s in running:
        assert s.error["code"] == "worker_lost" and not s.done, s
        assert s.error["retryable"] is True and s.error["retry_after_ms"] >= 1  # in the body
        assert s.ended_at - killed_at <= TTL_S + 2.5
        assert s.error["details"]["completion_tokens"] == s.tokens  # how far the client got
    # A new worker serves the two that waited (one was taken by the dead worker, not started).
    stack.restart("worker0", WORKER_ID=f"{stack.prefix}-w0-second")
    assert wait_for(lambda: all(s.ended_at for s in waiting), 30)
    assert all(s.done and s.tokens == 100 and not s.error for s in waiting), waiting
    assert wait_for(lambda: stats(stack, operator)["gate1"]["queued"] == 0, 5)
    assert wait_for(lambda: conc_leases(stack, tenant) == 0, 5)
    records = wait_for(lambda: (r := list(UsageRecord.objects.filter(tenant=tenant)))
                       and len(r) == 4 and r, 15)
    assert records, "usage records missing"
    by_id = {r.request_id: r for r in records}
    for s in streams:
        assert by_id[s.request_id].completion_tokens == s.tokens
    assert sorted(r.error_code for r in records) == ["", "", "worker_lost", "worker_lost"]


def test_a_killed_web_process_stops_its_generations_and_frees_its_slots(
        stack, make_tenant, transactional_db):
    tenant, _, raw = make_tenant(max_concurrent_requests=1)
    orphan = Stream(stack.url, raw, 1000).start()
    assert wait_for(lambda: orphan.tokens >= 5, 20)
    stack.kill("daphne", signal.SIGKILL)
    killed_at = time.monotonic()
    stack.restart("daphne")
    assert wait_for(lambda: ready(stack), 30)
    record = wait_for(lambda: UsageRecord.objects.filter(tenant=tenant).first(), TTL_S + 10)
    assert record is not None, "the orphaned generation ran on"
    assert record.finish_reason == "abort" and record.status == 499
    ran_for = (time.monotonic() - killed_at) + orphan.tokens * STEP_S
    assert record.completion_tokens < 1000 and record.completion_tokens * STEP_S <= ran_for + 2
    # The tenant's one slot is free again: the next request gets in.
    nxt = Stream(stack.url, raw, 5).start()
    assert wait_for(lambda: nxt.ended_at, 20) and nxt.done and nxt.tokens == 5, nxt


def test_a_stream_waiting_for_a_busy_worker_gets_keepalive_comments(
        stack, make_tenant, transactional_db):
    _, _, busy_key = make_tenant()
    _, _, raw = make_tenant()
    busy = [Stream(stack.url, busy_key, 120).start() for _ in range(3)]  # rows and prefetch
    assert wait_for(lambda: sum(s.tokens > 0 for s in busy) == 2, 20)
    quiet = Stream(stack.url, raw, 3).start()
    time.sleep(4)
    assert quiet.tokens == 0 and quiet.comments >= 3, quiet  # one a second, not one in all
    assert wait_for(lambda: quiet.ended_at, 30) and quiet.done and quiet.tokens == 3


def test_sigterm_drains_a_worker_its_running_stream_finishes(stack, make_tenant,
                                                             transactional_db):
    _, _, raw = make_tenant()
    stream = Stream(stack.url, raw, 40).start()
    assert wait_for(lambda: stream.tokens >= 3, 20)
    status = stack.kill("worker0", signal.SIGTERM, wait_s=20)
    assert status == 0
    assert stream.done and stream.tokens == 40 and not stream.error, stream
    stack.restart("worker0")
    assert wait_for(lambda: serving(stack), 60)  # the new worker, not the old one's heartbeat


def test_sigterm_drains_the_web_process_its_streams_finish(stack, make_tenant,
                                                           transactional_db):
    _, _, raw = make_tenant()
    stream = Stream(stack.url, raw, 60).start()  # 3 s of tokens
    assert wait_for(lambda: stream.tokens >= 3, 20)
    stack.kill("daphne", signal.SIGTERM, wait_s=20)  # returns once it exited
    assert stream.done and stream.tokens == 60 and not stream.error, stream
    assert not ready(stack)  # it stopped listening (and has exited)
    stack.restart("daphne")
    assert wait_for(lambda: ready(stack), 30)


def test_a_stream_longer_than_the_web_drain_ends_with_a_clear_error_and_stops(
        stack, make_tenant, transactional_db):
    tenant, _, raw = make_tenant()
    stream = Stream(stack.url, raw, 1000).start()  # 50 s of tokens: longer than the drain
    assert wait_for(lambda: stream.tokens >= 3, 20)
    stack.kill("daphne", signal.SIGTERM, wait_s=30)
    # Not a cut connection, not a normal end: a retryable error event the client can act on.
    assert stream.error.get("code") == "interrupted" and not stream.done, stream
    assert stream.error["retryable"] is True
    record = wait_for(lambda: UsageRecord.objects.filter(tenant=tenant).first(), 10)
    assert record is not None and record.completion_tokens < 1000 / 2  # stopped, not run out
    stack.restart("daphne")
    assert wait_for(lambda: ready(stack), 30)
