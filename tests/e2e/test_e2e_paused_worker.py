"""A worker paused longer than its heartbeat TTL (``kill -STOP``: a GC pause, a stolen VM, swap),
then resumed, under a running platform (real daphne, worker and Celery processes).

While it is paused, the web tier's sweep takes it for dead: the requests it was generating end
with the retryable ``worker_lost``, those it had taken and not started go back to the queue. When
it resumes it must not fail what another take now owns: it takes those requests again (it is the
only worker) while its engine still holds its earlier takes of them, and each is served in full,
once, billed for what its client got.
"""

from __future__ import annotations

import signal
import time

import pytest
import redis

from tenants.models import UsageRecord
from tests.support.calls import Call, new_tenant
from tests.support.e2e import start_stack, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TTL_S = 3
STEP_S = 0.05
MAX_TOKENS = 30
# Paused long enough for the sweep to judge it dead (one TTL, up to two after a break in the
# judge's own sight of Redis) and to spare.
PAUSE_S = 4 * TTL_S


@pytest.fixture(scope="module")
def stack(request, django_db_setup, django_db_blocker, tmp_path_factory):
    # With Celery beat: its sweep judges heartbeats too, and its reconciliation records a usage
    # entry whose first recording failed (SQLite refuses concurrent writers at times).
    return start_stack(request, django_db_blocker, tmp_path_factory, workers=1, beat=True,
                       SWEEP_INTERVAL_S=1, USAGE_RECONCILE_INTERVAL_S=2,
                       REFERENCE_STEP_DELAY_S=STEP_S, MAX_BATCH_SIZE=4, WORKER_PREFETCH=2,
                       WORKER_HEARTBEAT_TTL_S=TTL_S, WEB_HEARTBEAT_TTL_S=TTL_S,
                       HEARTBEAT_INTERVAL_S=0.5, STREAM_DECISION_TIMEOUT_S=1,
                       SSE_KEEPALIVE_S=1)


def owned_by(client: redis.Redis, stack, state: str) -> set[str]:
    """The ids the queue records as ``taken`` or ``running`` by the stack's only worker."""
    return {rid.decode() for rid in client.hkeys(f"{stack.prefix}:fq:{state}:{stack.prefix}-w0")}


def test_a_worker_resumed_after_a_pause_fails_nothing_another_take_owns(
        stack, make_tenant, transactional_db):
    client = redis.Redis.from_url(stack.env["REDIS_URL"])
    # A tenant per request: each usage record is found by its tenant (an answer not streamed
    # that ends with an error tells its client no request id).
    tenants, calls = [], []
    for i in range(12):
        tenant, raw = new_tenant(make_tenant)
        tenants.append(tenant)
        calls.append(Call(stack.url, raw, MAX_TOKENS, stream=i % 2 == 0).start())
    time.sleep(0.6)
    worker = stack.processes["worker0"]
    worker.send_signal(signal.SIGSTOP)
    paused_at = time.monotonic()
    # The worker is frozen: what the queue records as its own is fixed until the sweep.
    running, taken = owned_by(client, stack, "running"), owned_by(client, stack, "taken")
    assert running and taken, (running, taken)  # generating some, taken others not started
    time.sleep(PAUSE_S)
    worker.send_signal(signal.SIGCONT)
    resumed_at = time.monotonic()
    assert wait_for(lambda: all(c.ended_at for c in calls), 60), calls

    records = {}
    for tenant, call in zip(tenants, calls, strict=True):
        rows = wait_for(lambda t=tenant: list(UsageRecord.objects.filter(tenant=t)), 15)
        assert len(rows) == 1, (call, rows)  # every request ended exactly once
        records[rows[0].request_id] = (call, rows[0])
    assert running | taken <= records.keys()
    for rid, (call, record) in records.items():
        assert not call.failure and call.code not in ("invalid_request", "interrupted"), call
        if rid in running:
            # It was generating when the worker stopped: ended by the sweep, while paused.
            assert call.code == "worker_lost" and call.retryable, call
            # (its last heartbeat came up to a heartbeat interval before the pause)
            assert call.ended_at < resumed_at and call.ended_at - paused_at >= TTL_S - 1, call
            assert record.error_code == "worker_lost"
            if call.stream:  # billed for the tokens its client got
                assert call.status == 200 and not call.done
                assert record.completion_tokens == call.tokens < MAX_TOKENS
            else:  # an answer not streamed goes out whole or not at all: billed nothing
                assert call.status == 503 and call.tokens == 0
                assert (record.prompt_tokens, record.completion_tokens) == (0, 0)
        else:
            # Taken and not started (then taken again by the same worker), or still waiting.
            assert call.status == 200 and not call.error, call
            assert call.tokens == MAX_TOKENS and (call.done or not call.stream), call
            assert (record.status, record.error_code) == (200, "")
            assert record.completion_tokens == MAX_TOKENS
    # Nothing is left held: gate 1, the queue's records of the worker, its leases.
    assert wait_for(lambda: not owned_by(client, stack, "taken")
                    and not owned_by(client, stack, "running"), 10)
    assert wait_for(lambda: not any(int(n) for n in
                                    client.hvals(f"{stack.prefix}:fq:held")), 10)
