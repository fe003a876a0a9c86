"""Adapter affinity in the shared queue (take.lua): a worker that does not hold the LoRA adapter of
the order's next request leaves it, for a bounded time, to a live worker that holds it; the order
itself never changes.

Driven through :class:`inference.worker.fair_queue.FairQueue` on a real Redis.
"""

from __future__ import annotations

import time
import uuid

import pytest

from inference.protocol.keys import Keys
from inference.protocol.messages import AdapterRef, RequestMessage
from inference.worker.fair_queue import FairQueue

A = "a" * 64
B = "b" * 64
WAIT_S = 0.4


def ref(digest: str) -> AdapterRef:
    return AdapterRef(name=f"base:{digest[:4]}", path="/x", digest=digest, rank=8)


def message(key: str = "acme", adapter: str | None = None) -> RequestMessage:
    return RequestMessage(request_id=uuid.uuid4().hex, tenant=key, fairness_key=key,
                          prompt="hi", adapter=None if adapter is None else ref(adapter))


@pytest.fixture
def workers(rclient, redis_prefix):
    """w1 holds adapter A loaded; w2 holds nothing; both wait up to WAIT_S for affinity."""
    made = []
    for name in ("w1", "w2"):
        queue = FairQueue(rclient, Keys(redis_prefix), name, "fcfs")
        queue.affinity_s = WAIT_S
        made.append(queue)
    made[0].hold_adapters([ref(A).key], ttl_s=30)
    return made


def taken(queue: FairQueue, n: int = 4) -> list[str]:
    return [q.message.request_id for q in queue.take(n)]


def test_a_worker_without_the_adapter_leaves_the_head_to_its_holder_and_keeps_the_order(workers):
    w1, w2 = workers
    first, second = message(adapter=A), message()
    w1.enqueue(first)
    w1.enqueue(second)
    # The head is A's: w2 takes nothing, not even the bare request behind it (no reordering).
    assert taken(w2) == []
    assert taken(w1, 1) == [first.request_id]
    assert taken(w2) == [second.request_id]


def test_the_wait_for_a_holder_is_bounded(workers):
    w1, w2 = workers
    request = message(adapter=A)
    w2.enqueue(request)
    started = time.monotonic()
    assert taken(w2) == []
    while not (got := taken(w2)):
        assert time.monotonic() - started < WAIT_S + 2, "never taken"
        time.sleep(0.05)
    waited = time.monotonic() - started
    assert got == [request.request_id]
    assert WAIT_S * 0.9 <= waited < WAIT_S + 0.5


def test_no_wait_without_a_live_holder_for_the_bare_model_or_for_the_holder_itself(
        workers, rclient, redis_prefix):
    w1, w2 = workers
    for request in (message(adapter=B), message()):  # nobody holds B; no adapter
        w2.enqueue(request)
        assert taken(w2) == [request.request_id]
    request = message(adapter=A)
    w1.enqueue(request)
    assert taken(w1) == [request.request_id]  # the holder takes its own at once
    w1.hold_adapters([ref(A).key], ttl_s=-1)  # its hold lapsed (a dead worker's)
    request = message(adapter=A)
    w2.enqueue(request)
    assert taken(w2) == [request.request_id]


def test_affinity_zero_takes_at_once(workers):
    _, w2 = workers
    w2.affinity_s = 0
    request = message(adapter=A)
    w2.enqueue(request)
    assert taken(w2) == [request.request_id]
