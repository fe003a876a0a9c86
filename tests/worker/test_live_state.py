"""A worker's live-request table and what its bridge's parts share
(:class:`inference.worker.live.WorkerState`), without Redis; and that the bridge's collaborators
share one such state and one queue client."""

from __future__ import annotations

import uuid

from inference.protocol.events import FinishReason
from inference.protocol.messages import RequestMessage
from inference.worker.live import LiveRequest, WorkerState


def live(origin: str = "") -> LiveRequest:
    return LiveRequest(RequestMessage(request_id=uuid.uuid4().hex, tenant="acme",
                                      fairness_key="acme", prompt="hi", origin=origin),
                       take="1", prompt_tokens=3)


def test_the_table_holds_a_request_from_its_take_to_its_end():
    state = WorkerState()
    request = live("web-1")
    rid = request.message.request_id
    assert not state.is_mine(rid) and not state.holds_any()
    state.add(rid, request)
    assert state.is_mine(rid) and state.get(rid) is request
    assert state.live_origins() == {rid: "web-1"}
    assert state.missing([rid, "other"]) == ["other"]
    assert state.unstarted_prompts([(rid, "1"), (rid, "0"), ("other", "1")]) == {rid: 3}
    request.started = True
    assert state.unstarted_prompts([(rid, "1")]) == {}
    assert state.forget(rid) is request and state.forget(rid) is None
    assert not state.holds_any()


def test_taking_all_empties_the_table():
    state = WorkerState()
    a, b = live(), live()
    state.add(a.message.request_id, a)
    state.add(b.message.request_id, b)
    assert state.take_all() == {a.message.request_id: a, b.message.request_id: b}
    assert not state.holds_any() and state.take_all() == {}


def test_ended_ids_reach_the_usage_sink_once_each_even_when_it_fails():
    seen: list[str] = []

    def sink(request_id: str) -> None:
        seen.append(request_id)
        if request_id == "b":
            raise RuntimeError("broker down")

    state = WorkerState(sink)
    for rid in ("a", "b", "c"):
        state.record_ended(rid)
    assert state.flush_usage() == 3
    assert seen == ["a", "b", "c"]
    assert state.flush_usage() == 0
    state.count_outside(FinishReason.ERROR)
    state.count_outside(FinishReason.ERROR)
    state.count_outside(FinishReason.ABORT)
    assert state.ended_outside == {"error": 2, "abort": 1}


def test_the_bridges_collaborators_share_one_state_and_one_queue(rclient, keys):
    from inference.worker.bridge import WorkerBridge
    from tests.support.engine import make_engine

    engine = make_engine()
    bridge = WorkerBridge(engine, rclient, keys, "w", prefetch=1)
    parts = (bridge.intake, bridge.publisher, bridge.recovery, bridge.origins)
    assert all(part.state is bridge.state for part in parts)
    assert all(part.queue is bridge.queue
               for part in (bridge.intake, bridge.publisher, bridge.recovery))
    assert engine.event_sink == bridge.publisher.on_events
    assert engine.preempt_sink == bridge.intake.on_preempted
    assert bridge.origins.state.sight is bridge.state.sight
