"""A worker only paused longer than its heartbeat TTL (a GC pause, a stolen VM, swap) and
reclaimed meanwhile, on a real Redis, its engine stepped by hand so that every interleaving is
the test's: what it took before the reclaim is stale, and Redis refuses whatever it writes for
it, even for a request it takes again; the new take is served in full, once.
"""

from __future__ import annotations

import json
import time
import uuid

from inference.protocol.events import FinalEvent
from inference.protocol.messages import RequestMessage
from inference.worker.bridge import WorkerBridge
from inference.worker.fair_queue import FairQueue
from tests.support.engine import make_engine

SEEN = 3600.0  # the sight of Redis of a judge that has seen it answer for an hour


def message(max_tokens: int = 5) -> RequestMessage:
    return RequestMessage(request_id=uuid.uuid4().hex, tenant="acme", fairness_key="acme",
                          prompt="once upon a time",
                          sampling={"max_tokens": max_tokens, "ignore_eos": True})


def stream(rclient, keys, request_id: str) -> list[dict]:
    return [json.loads(f[b"data"]) for _, f in rclient.xrange(keys.events(request_id))]


def paused_and_reclaimed(rclient, keys, worker_id: str) -> None:
    """The worker's heartbeat is a minute old, and a judge with a long sight reclaims it."""
    rclient.zadd(keys.workers, {worker_id: time.time() - 60})
    _, workers, _ = FairQueue(rclient, keys, "judge", "vtc").reclaim(10, 60, sight_s=SEEN)
    assert workers == [worker_id]


def test_a_request_taken_again_while_its_stale_take_is_in_the_engine_is_served_once(
        rclient, keys):
    usage: list[str] = []
    bridge = WorkerBridge(make_engine(), rclient, keys, "paused", prefetch=1,
                          usage_sink=usage.append)
    engine = bridge.engine
    bridge.publish_stats(60)
    request = message()
    bridge.queue.enqueue(request)
    assert bridge.poll() == 1  # taken into its engine, which has not run it yet
    stale = bridge.state.get(request.request_id).take
    paused_and_reclaimed(rclient, keys, "paused")  # back in the queue, for any worker

    # Resumed: its first take is refused until it has learned of the reclaim; then it stops
    # what it held and registers afresh.
    assert bridge.poll() == 0
    assert rclient.zscore(keys.workers, "paused") and bridge.state.held == 0
    # It takes the request again at once, while its engine still holds the stale take.
    assert bridge.poll() == 1
    assert bridge.intake.num_waiting() == 1 and bridge.state.held == 1
    assert bridge.state.get(request.request_id).take != stale
    engine.step()  # the stale take leaves the engine: its final (abort) is refused by Redis
    assert stream(rclient, keys, request.request_id) == []
    assert bridge.poll() == 0  # ... and the new take enters the engine
    assert bridge.intake.num_waiting() == 0
    for _ in range(50):
        engine.step()
        bridge.reconcile_queue()
        bridge.flush_usage()
    events = stream(rclient, keys, request.request_id)
    assert [e["seq"] for e in events] == [0, 1, 2, 3, 4, 5]  # one run's tokens, then its end
    end = FinalEvent.model_validate(events[-1])
    assert end.finish_reason == "length" and end.error is None
    assert end.usage.completion_tokens == 5
    assert usage == [request.request_id]  # billed once
    assert bridge.queue.gate1() == 0 and int(rclient.hget(keys.fq("held"), "paused") or 0) == 0
    assert not bridge.state.holds_any()
    engine.shutdown(1)


def test_a_request_running_when_its_worker_paused_is_stopped_and_its_events_dropped(
        rclient, keys):
    usage: list[str] = []
    bridge = WorkerBridge(make_engine(), rclient, keys, "paused", prefetch=1,
                          usage_sink=usage.append)
    engine = bridge.engine
    bridge.publish_stats(60)
    request = message(50)
    bridge.queue.enqueue(request)
    assert bridge.poll() == 1
    for _ in range(6):
        engine.step()
    written = len(stream(rclient, keys, request.request_id))
    assert written >= 1  # running: its first events are in its stream
    paused_and_reclaimed(rclient, keys, "paused")  # it ends with worker_lost
    end = FinalEvent.model_validate(stream(rclient, keys, request.request_id)[-1])
    assert end.error.code == "worker_lost"
    # Resumed: the tokens it generates go nowhere, and it stops the request at once.
    engine.step()
    assert not bridge.state.holds_any()
    for _ in range(5):
        engine.step()
    assert len(stream(rclient, keys, request.request_id)) == written + 1
    assert engine.stats()["requests_finished"].get("abort") == 1
    assert usage == []  # the judge that ended it records its usage
    engine.shutdown(1)
