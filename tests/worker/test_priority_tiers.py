"""Priority tiers across Redis: the shared queue hands out the highest tier's requests first.

A worker takes only what it can start soon, so a high tier's request must not wait behind a low
tier's backlog in the queue. The bridge tests drive ``WorkerBridge.poll`` by hand on an engine
whose scheduler thread never runs (nothing is admitted, so what was taken stays in its pending
queue); the last ones run a real in-process worker.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import Iterator

import pytest
import redis

from gateway import admission
from gateway.admission import Principal
from inference.engine.config import EngineConfig
from inference.engine.llm_engine import LLMEngine
from inference.engine.request import TokenEvent
from inference.protocol.keys import Keys, queue_script
from inference.protocol.messages import RequestMessage
from inference.worker.bridge import WorkerBridge
from tenants.models import PriorityTier
from tests.support.e2e import wait_for
from tests.support.platform import InProcessWorker

pytestmark = pytest.mark.django_db


@pytest.fixture
def tier_key(make_tenant):
    """``tier_key(priority) -> ApiKey`` of a new tenant on a tier of that priority."""

    def make(priority: int):
        tier, _ = PriorityTier.objects.get_or_create(name=f"p{priority}",
                                                     defaults={"priority": priority})
        return make_tenant(tier=tier)[1]

    return make


def submit(key, max_tokens: int = 4) -> RequestMessage:
    """Admit one request of ``key`` as the REST API does; return its message."""
    tenant = key.tenant
    message = RequestMessage(
        request_id=uuid.uuid4().hex, tenant=tenant.slug, fairness_key=tenant.slug,
        priority=tenant.tier.priority, prompt="hi",
        sampling={"max_tokens": max_tokens, "ignore_eos": True})
    return asyncio.run(admission.admit(Principal.for_api_key(key), message, 2 + max_tokens))


class Bridge:
    """A bridge on an engine that is never started; records what it submits, in order."""

    def __init__(self, prefix: str, redis_url: str, *, prefetch: int, **engine_settings):
        self.engine = LLMEngine(EngineConfig(backend="reference", max_model_len=256,
                                             **engine_settings))
        self.client = redis.Redis.from_url(redis_url)
        self.bridge = WorkerBridge(self.engine, self.client, Keys(prefix), "w-test",
                                   prefetch=prefetch)
        self.submitted: list[str] = []
        submit_to_engine = self.engine.submit

        def record(**kwargs):
            handle = submit_to_engine(**kwargs)
            self.submitted.append(kwargs["request_id"])
            return handle

        self.engine.submit = record


@pytest.fixture
def make_bridge(redis_prefix, settings) -> Iterator:
    made: list[Bridge] = []

    def make(prefetch: int, **engine_settings) -> Bridge:
        made.append(Bridge(redis_prefix, settings.REDIS_URL, prefetch=prefetch,
                           **engine_settings))
        return made[-1]

    yield make
    for b in made:
        b.engine.shutdown(1)


def blocked_reads(rclient) -> int:
    """Redis clients blocked in XREADGROUP right now (a worker waiting on the tiers' streams)."""
    return sum(1 for c in rclient.client_list()
               if c.get("cmd") == "xreadgroup" and "b" in c.get("flags", ""))


def waiting_ids(rclient, keys: Keys, priority: int) -> list[str]:
    """Request ids waiting in one tier, over all fairness keys, in arrival order."""
    records = [json.loads(r) for r in rclient.hvals(keys.fq("wait"))]
    return [r["id"] for r in sorted(records, key=lambda r: r["seq"]) if r["prio"] == priority]


def gate1(rclient, keys: Keys) -> int:
    return int(rclient.eval(queue_script("gate1"), 0, keys.prefix))


def test_admission_puts_each_request_in_its_tier(tier_key, live_worker, rclient, keys):
    low, high, batch = tier_key(0), tier_key(10), tier_key(-10)
    messages = [submit(k) for k in (low, high, low, batch)]
    assert waiting_ids(rclient, keys, 0) == [messages[0].request_id, messages[2].request_id]
    assert waiting_ids(rclient, keys, 10) == [messages[1].request_id]
    assert waiting_ids(rclient, keys, -10) == [messages[3].request_id]
    assert rclient.zrevrange(keys.fq("tiers"), 0, -1) == [b"10", b"0", b"-10"]
    assert gate1(rclient, keys) == 4


def test_poll_fills_its_room_from_the_highest_tier_down(tier_key, live_worker, make_bridge,
                                                      rclient, keys):
    low, high, batch = tier_key(0), tier_key(10), tier_key(-10)
    for _ in range(3):
        submit(batch)
    backlog = [submit(low) for _ in range(4)]
    late = [submit(high) for _ in range(2)]  # arrives last, behind the backlog
    b = make_bridge(prefetch=1, max_batch_size=2)  # room: 2 free rows and 1 more

    assert b.bridge.poll() == 3
    assert b.submitted == [m.request_id for m in late + backlog[:1]]
    assert b.bridge.poll() == 0  # no room left: nothing more is taken
    assert len(waiting_ids(rclient, keys, -10)) == 3
    # What was taken still counts in gate 1 (nothing was admitted).
    assert gate1(rclient, keys) == 9


def test_a_new_tier_is_served_without_a_restart(tier_key, live_worker, make_bridge):
    low = tier_key(0)
    submit(low)
    b = make_bridge(prefetch=0, max_batch_size=1)
    assert b.bridge.poll() == 1
    b.engine.abort(b.submitted[-1])
    b.engine.step()  # the abort leaves the pending queue: room for one
    newer = submit(tier_key(7))  # a tier created after the worker started
    submit(low)
    assert b.bridge.poll() == 1
    assert b.submitted[-1] == newer.request_id


def blocked_waits(rclient) -> int:
    """Redis clients blocked waiting for an enqueue right now (an idle worker's poll)."""
    return sum(1 for c in rclient.client_list()
               if c.get("cmd") == "blpop" and "b" in c.get("flags", ""))


def test_an_idle_poll_wakes_for_the_first_request(tier_key, live_worker, make_bridge, rclient):
    low, high = tier_key(0), tier_key(10)
    submit(high)
    submit(low)
    b = make_bridge(prefetch=4)
    assert b.bridge.poll() == 2
    rclient.delete(b.bridge.keys.fq("wake"))  # the wake-ups of the two taken already
    result: list[tuple[int, float]] = []

    def poll() -> None:
        start = time.monotonic()
        result.append((b.bridge.poll(block_ms=5000), time.monotonic() - start))

    thread = threading.Thread(target=poll)
    thread.start()
    assert wait_for(lambda: blocked_waits(rclient) > 0, 5, every_s=0.01), "the poll never blocked"
    late = submit(low)
    thread.join(10)
    [(taken, waited)] = result
    assert taken == 1 and b.submitted[-1] == late.request_id
    assert waited < 3, "it woke for the request, long before its 5 s block ran out"


def test_shutdown_hands_each_unadmitted_request_back_to_its_place(
        tier_key, live_worker, make_bridge, rclient, keys):
    high, batch = tier_key(10), tier_key(-10)
    batch_one, high_one = submit(batch), submit(high)
    batch_two = submit(batch)
    b = make_bridge(prefetch=0, max_batch_size=2)
    assert b.bridge.poll() == 2
    assert b.submitted == [high_one.request_id, batch_one.request_id]

    assert b.bridge.shutdown(1) == 2

    # Back where they were, ahead of the later request of their tier: any worker's now.
    assert waiting_ids(rclient, keys, 10) == [high_one.request_id]
    assert waiting_ids(rclient, keys, -10) == [batch_one.request_id, batch_two.request_id]
    assert rclient.hlen(keys.fq("taken", "w-test")) == 0
    assert gate1(rclient, keys) == 3  # all still wait for admission


@pytest.mark.parametrize("refusal", ["queue_full", "stopped"])
def test_a_request_the_engine_cannot_take_goes_back_to_its_place(
        tier_key, live_worker, make_bridge, rclient, keys, refusal):
    high, batch = tier_key(10), tier_key(-10)
    first, second = submit(high), submit(batch)
    b = make_bridge(prefetch=4, max_pending=1)
    if refusal == "stopped":
        b.engine.shutdown(0)
    assert b.bridge.poll() == 2
    expected = [] if refusal == "stopped" else [first.request_id]
    assert b.submitted == expected
    handed_back = [second] if refusal == "queue_full" else [first, second]
    for m in handed_back:
        assert waiting_ids(rclient, keys, m.priority) == [m.request_id]
    assert gate1(rclient, keys) == 2


def test_high_tier_gets_its_first_token_before_a_low_tier_backlog_in_redis(
        tier_key, redis_prefix, settings):
    """A worker saturated by a low tier (batch of 1, prefetch of 1) with a backlog in the queue:
    a later high-tier request waits for what the worker already took, not for the backlog."""
    low, high = tier_key(0), tier_key(10)
    worker = InProcessWorker(redis_prefix, settings.REDIS_URL, prefetch=1, max_model_len=256,
                             max_batch_size=1, reference_step_delay_s=0.005)
    first_tokens: list[str] = []
    sink = worker.engine.event_sink

    def record(events) -> None:
        for event in events:
            if isinstance(event, TokenEvent) and event.request_id not in first_tokens:
                first_tokens.append(event.request_id)
        sink(events)

    worker.engine.event_sink = record
    worker.start()
    try:
        backlog = [submit(low, max_tokens=30) for _ in range(6)]
        deadline = time.monotonic() + 10
        while not first_tokens and time.monotonic() < deadline:
            time.sleep(0.005)
        urgent = submit(high, max_tokens=4)
        deadline = time.monotonic() + 30
        while len(worker.usage) < 7 and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        worker.stop()

    assert {u.finish_reason for u in worker.usage} == {"length"} and len(worker.usage) == 7
    # At most the request being served and the one prefetched come first.
    assert first_tokens.index(urgent.request_id) <= 2
    assert first_tokens[-3:] == [m.request_id for m in backlog[-3:]]
