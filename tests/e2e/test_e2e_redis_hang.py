"""Redis hanging longer than the heartbeat TTL (``kill -STOP`` of a redis-server of the test's
own, then ``-CONT``) under a platform serving streams: daphne, two workers, Celery and Celery
beat, all on that Redis (it is Celery's broker too).

No process could beat while it hung, so every heartbeat is stale when it answers again; each
process that judges heartbeats (the workers, the web monitor's sweep, the beat sweep, the
admission's count of live workers) judges against its own sight of Redis, which the hang broke:
no worker is reclaimed, no generation stopped, and the streams go on to their end.
"""

from __future__ import annotations

import signal
import time

import pytest

from benchmarks.harness.redis_server import PrivateRedis
from benchmarks.harness.stack import Stack, database_url
from tenants.models import UsageRecord
from tests.support.calls import Call, new_tenant
from tests.support.e2e import TEST_HEARTBEATS, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TTL_S = TEST_HEARTBEATS["WORKER_HEARTBEAT_TTL_S"]
HANG_S = 5 * TTL_S
STEP_S = 0.1
MAX_TOKENS = 240  # 24 s of tokens: the streams outlast the hang


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("redis")
    server = PrivateRedis(folder, folder / "redis.log", "none")
    server.start()
    yield server
    server.proc.send_signal(signal.SIGCONT)  # (if the test stopped it)
    server.kill(signal.SIGKILL)


@pytest.fixture(scope="module")
def stack(request, redis_server, django_db_setup, django_db_blocker, tmp_path_factory):
    from django.db import connection

    with django_db_blocker.unblock():
        db_url = database_url(connection.settings_dict)
    env = {**TEST_HEARTBEATS, "REFERENCE_STEP_DELAY_S": STEP_S, "MAX_BATCH_SIZE": 4,
           "WORKER_PREFETCH": 1, "STREAM_DECISION_TIMEOUT_S": 1, "SSE_KEEPALIVE_S": 1,
           # The streams ride the hang out (a reader's own bound on an outage).
           "REDIS_OUTAGE_TOLERANCE_S": 60,
           # The beat sweep judges heartbeats every second (it keeps a sight of Redis), and
           # its reconciliation records the usage that SQLite refused at first.
           "SWEEP_INTERVAL_S": 1, "USAGE_RECONCILE_INTERVAL_S": 2}
    stack = Stack(db_url, redis_server.url, tmp_path_factory.mktemp("stack"), workers=2,
                  beat=True, **{k: str(v) for k, v in env.items()})
    request.addfinalizer(stack.stop)
    try:
        stack.start()
    except Exception:
        print(stack.logs())
        raise
    return stack


def test_redis_hanging_longer_than_the_ttl_reclaims_no_worker_and_fails_no_stream(
        stack, redis_server, make_tenant, transactional_db):
    tenants = [new_tenant(make_tenant) for _ in range(10)]
    streams = [Call(stack.url, raw, MAX_TOKENS, stream=True).start() for _, raw in tenants[:8]]
    assert wait_for(lambda: all(s.tokens >= 3 for s in streams), 30), streams  # both busy
    time.sleep(2 * TTL_S)  # every judge has seen Redis answer for a whole TTL
    redis_server.proc.send_signal(signal.SIGSTOP)
    time.sleep(HANG_S)
    redis_server.proc.send_signal(signal.SIGCONT)
    # Requests sent as it answers again, before the workers have beaten (their loops back off
    # after the failed calls): admitted (no 503 no_worker_available), and served.
    late = [Call(stack.url, raw, 10, stream=False).start() for _, raw in tenants[8:]]
    assert wait_for(lambda: all(c.ended_at for c in streams + late), 90), streams + late

    for call in streams:
        assert call.done and not call.error and not call.failure, call
        assert call.tokens == MAX_TOKENS and call.text == streams[0].text, call  # no gap
    for call in late:
        assert call.status == 200 and call.tokens == 10, call
    logs = "".join(p.read_text() for p in stack.log_dir.glob("*.log"))
    assert "reclaimed dead worker" not in logs and "heartbeat lapsed" not in logs
    assert "is gone: stopping it" not in logs  # no answer stopped for its web process
    for (tenant, _), call in zip(tenants, streams + late, strict=True):
        rows = wait_for(lambda t=tenant: list(UsageRecord.objects.filter(tenant=t)), 15)
        assert len(rows) == 1, (call, rows)
        assert (rows[0].status, rows[0].completion_tokens) == (200, call.tokens)
