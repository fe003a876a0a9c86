"""The shared request queue: one fair order for the whole deployment, and reclaim after a crash.

Driven through :class:`inference.worker.fair_queue.FairQueue`, the workers' side of the queue's Lua
scripts, on a real Redis under a private prefix.
"""

from __future__ import annotations

import json
import time
import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inference.protocol.events import FinalEvent, FinishReason, TokenEvent, Usage
from inference.protocol.keys import Keys
from inference.protocol.messages import RequestMessage
from inference.worker.fair_queue import FairQueue, QueuedRequest, Reclaimed

KEYS = ["acme", "beta", "gamma"]
# The sight of Redis of a judge that has seen it answer for an hour (heartbeats are judged).
SEEN = 3600.0
PRIORITY = {"acme": 0, "beta": 0, "gamma": 10}


def message(key: str, priority: int = 0, deadline_s: float = 0.0) -> RequestMessage:
    return RequestMessage(request_id=uuid.uuid4().hex, tenant=key, fairness_key=key,
                          priority=priority, prompt="hi", queue_deadline_s=deadline_s)


def token(request_id: str) -> TokenEvent:
    return TokenEvent(request_id=request_id, seq=0, token_id=1, text="x")


def final(request_id: str) -> FinalEvent:
    return FinalEvent(request_id=request_id, seq=1, finish_reason=FinishReason.LENGTH)


class Model:
    """The fair order as docs/design.md states it, in plain Python."""

    def __init__(self, policy: str):
        self.policy = policy
        self.counter: dict[str, float] = {}
        self.inflight: dict[str, int] = {}
        self.waiting: list[tuple[int, str, str]] = []  # (arrival, key, request id)
        self.last_idle = 0.0
        self.seq = 0

    def enqueue(self, key: str, request_id: str) -> None:
        self.seq += 1
        if not self.inflight.get(key):
            busy = [self.counter[k] for k, n in self.inflight.items() if n]
            floor = min(busy) if busy else self.last_idle
            self.counter[key] = max(self.counter.get(key, 0.0), floor)
        self.inflight[key] = self.inflight.get(key, 0) + 1
        self.waiting.append((self.seq, key, request_id))

    def take(self) -> str | None:
        if not self.waiting:
            return None

        def sort_key(item: tuple[int, str, str]) -> tuple:
            arrival, key, _ = item
            fair = 0.0 if self.policy == "fcfs" else self.counter[key]
            return (-PRIORITY[key], fair, arrival)

        best = min(self.waiting, key=sort_key)
        self.waiting.remove(best)
        return best[2]

    def charge(self, key: str, amount: float) -> None:
        self.counter[key] = self.counter.get(key, 0.0) + amount

    def finish(self, key: str) -> None:
        self.inflight[key] -= 1
        if not self.inflight[key]:
            self.last_idle = self.counter.get(key, 0.0)


@pytest.fixture
def queue_for(rclient, redis_prefix):
    def make(worker: str = "w1", policy: str = "vtc") -> FairQueue:
        return FairQueue(rclient, Keys(redis_prefix), worker, policy)

    return make


OPERATION = st.one_of(
    st.tuples(st.just("enqueue"), st.sampled_from(KEYS)),
    st.tuples(st.just("take"), st.just("")),
    st.tuples(st.just("charge"), st.sampled_from(KEYS), st.integers(1, 400)),
    st.tuples(st.just("finish"), st.integers(0, 50)),
)


@pytest.mark.parametrize("policy", ["vtc", "fcfs"])
@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(operations=st.lists(OPERATION, min_size=1, max_size=40))
def test_requests_leave_the_queue_in_the_sort_key_order(rclient, redis_prefix, policy,
                                                        operations):
    prefix = f"{redis_prefix}-{uuid.uuid4().hex[:6]}"
    queue = FairQueue(rclient, Keys(prefix), "w1", policy)
    model = Model(policy)
    keys_of: dict[str, str] = {}
    taken: list[QueuedRequest] = []
    try:
        for op in operations:
            if op[0] == "enqueue":
                m = message(op[1], PRIORITY[op[1]])
                keys_of[m.request_id] = op[1]
                queue.enqueue(m)
                model.enqueue(op[1], m.request_id)
            elif op[0] == "take":
                got = queue.take(1)
                expected = model.take()
                assert [q.request_id for q in got] == ([expected] if expected else [])
                taken += got
            elif op[0] == "charge":
                queue.charge({op[1]: op[2]})
                model.charge(op[1], op[2])
            elif taken:
                done = taken.pop(op[1] % len(taken))
                request_id = done.request_id
                assert queue.write_events([(token(request_id), done.take),
                                           (final(request_id), done.take)], 60) == set()
                model.finish(keys_of[request_id])
        # Whatever is left comes out in the model's order too.
        while (expected := model.take()) is not None:
            assert [q.request_id for q in queue.take(1)] == [expected]
        assert queue.take(5) == []
    finally:
        stale = list(rclient.scan_iter(f"{prefix}:*", count=1000))
        if stale:
            rclient.delete(*stale)


def test_a_key_that_comes_back_is_lifted_to_the_busy_keys_least_service(queue_for):
    queue = queue_for()
    queue.enqueue(message("acme"))
    queue.enqueue(message("acme"))
    queue.charge({"acme": 500.0})
    queue.enqueue(message("beta"))  # new: lifted to 500, not served from 0 for a long while
    queue.charge({"acme": 1.0})
    assert [q.fairness_key for q in queue.take(3)] == ["beta", "acme", "acme"]


def test_taken_requests_count_in_gate_one_until_admitted(queue_for, rclient, keys):
    queue = queue_for()
    for _ in range(3):
        queue.enqueue(message("acme"))
    assert queue.gate1() == 3
    queue.take(2)
    assert queue.gate1() == 3  # two held by the worker, one waiting
    queue.release_held(2)  # its engine admitted them
    assert queue.gate1() == 1


def test_a_dead_workers_taken_request_goes_back_once_and_its_running_one_ends_with_its_count(
        queue_for, rclient, keys):
    dead, alive = queue_for("dead"), queue_for("alive")
    first, second, later = message("acme"), message("acme"), message("acme")
    for m in (first, second, later):
        dead.enqueue(m)
    rclient.zadd(keys.workers, {"dead": time.time(), "alive": time.time()})
    took = dead.take(2)
    assert [q.request_id for q in took] == [first.request_id, second.request_id]
    tokens = [(TokenEvent(request_id=first.request_id, seq=i, token_id=1, text="x"),
               took[0].take) for i in range(3)]
    assert dead.write_events(tokens, 60, {first.request_id: 7}) == set()  # first is running

    rclient.zadd(keys.workers, {"dead": time.time() - 60})  # its heartbeat lapsed
    requeued, workers, ended = alive.reclaim(ttl_s=10, events_ttl_s=60, sight_s=SEEN)
    assert (requeued, workers, ended) == (1, ["dead"], [first.request_id])
    assert alive.reclaim(ttl_s=10, events_ttl_s=60, sight_s=SEEN) == (0, [], [])  # once
    # The running one ended with a retryable error that says how far it got, billed for that.
    entries = [json.loads(f[b"data"]) for _, f in rclient.xrange(keys.events(first.request_id))]
    assert [e["type"] for e in entries] == ["token"] * 3 + ["final"]
    end = FinalEvent.model_validate(entries[-1])
    assert end.error.code == "worker_lost" and end.error.retryable and end.seq == 3
    assert end.error.details["completion_tokens"] == 3
    assert "details.completion_tokens" in end.error.message  # no count of its own to go stale
    ledger = json.loads(rclient.hget(keys.usage_pending, first.request_id))
    assert FinalEvent.model_validate_json(ledger["final"]).usage.model_dump() == {
        "prompt_tokens": 7, "cached_prompt_tokens": 0, "completion_tokens": 3}
    # The taken one is back at its place, before the later request.
    assert [q.request_id for q in alive.take(2)] == [second.request_id, later.request_id]
    # Whatever the dead worker still writes for them is dropped.
    stale = (token(second.request_id), took[1].take)
    assert dead.write_events([stale], 60) == {(second.request_id, took[1].take)}
    assert rclient.xlen(keys.events(second.request_id)) == 0
    assert queue_for("alive").gate1() == 2  # both held by the live worker now
    assert not rclient.zscore(keys.workers, "dead")


def test_an_event_written_again_after_a_lost_reply_is_not_doubled(queue_for, rclient, keys):
    queue = queue_for()
    request = message("acme")
    queue.enqueue(request)
    [taken] = queue.take(1)
    first = [(TokenEvent(request_id=request.request_id, seq=i, token_id=1, text=str(i)),
              taken.take) for i in range(2)]
    queue.write_events(first, 60)
    queue.write_events(first + [(TokenEvent(request_id=request.request_id, seq=2, token_id=1,
                                            text="2"), taken.take)], 60)  # the retry, and more
    texts = [json.loads(f[b"data"])["text"] for _, f in
             rclient.xrange(keys.events(request.request_id))]
    assert texts == ["0", "1", "2"]
    end = (FinalEvent(request_id=request.request_id, seq=3, finish_reason=FinishReason.LENGTH),
           taken.take)
    assert queue.write_events([end], 60) == set()
    assert queue.write_events([end], 60) == {(request.request_id, taken.take)}  # written once
    assert rclient.xlen(keys.events(request.request_id)) == 4
    assert rclient.hexists(keys.usage_pending, request.request_id)


def test_a_write_of_several_ticks_of_several_requests_writes_each_token_once_in_order(
        queue_for, rclient, keys):
    """A held write carries two ticks of each stream, and a request may end inside it: every
    token once, in order, the next seq of a running request recorded, none left of an ended one,
    and the whole write sent again (a lost reply) adds nothing."""
    queue = queue_for()
    requests = [message("acme") for _ in range(3)]
    for request in requests:
        queue.enqueue(request)
    takes = {q.request_id: q.take for q in queue.take(3)}
    ids = [r.request_id for r in requests]

    def tok(rid: str, seq: int) -> tuple[TokenEvent, str]:
        return TokenEvent(request_id=rid, seq=seq, token_id=1, text=f"{rid[:4]}{seq}"), takes[rid]

    ended = ids[1]
    write = [tok(rid, 0) for rid in ids] + [tok(rid, 1) for rid in ids] + [
        (FinalEvent(request_id=ended, seq=2, finish_reason=FinishReason.LENGTH,
                    usage=Usage(prompt_tokens=3, completion_tokens=2)), takes[ended])]
    for again in (False, True):  # again: the ended request's take is gone, named as no longer owned
        assert queue.write_events(write, 60, {rid: 3 for rid in ids}) == (
            {(ended, takes[ended])} if again else set())
        for rid in ids:
            events = [json.loads(f[b"data"]) for _, f in rclient.xrange(keys.events(rid))]
            assert [e.get("text") for e in events if e["type"] == "token"] == [
                f"{rid[:4]}0", f"{rid[:4]}1"]
            assert [e["type"] for e in events][-1] == ("final" if rid == ended else "token")
            assert 0 < rclient.ttl(keys.events(rid)) <= 60
        assert rclient.hget(keys.fq("next"), ids[0]) == b"2"
        assert not rclient.hexists(keys.fq("next"), ended)  # ended: nothing left behind
        assert rclient.hexists(keys.usage_pending, ended)
    # The running ones go on from where they were.
    assert queue.write_events([tok(ids[0], 1), tok(ids[0], 2)], 60) == set()
    assert rclient.xlen(keys.events(ids[0])) == 3 and rclient.hget(keys.fq("next"), ids[0]) == b"3"


def test_a_waiting_request_past_its_deadline_ends_with_queue_timeout(queue_for, rclient, keys):
    queue = queue_for()
    late, patient = message("acme", deadline_s=0.01), message("acme")
    queue.enqueue(late)
    queue.enqueue(patient)
    time.sleep(0.05)
    assert queue.expire(60) == [late.request_id]
    [(_, fields)] = rclient.xrange(keys.events(late.request_id))
    end = FinalEvent.model_validate_json(fields[b"data"])
    assert end.error.code == "queue_timeout" and end.error.retryable
    assert end.error.details == {"max_queue_wait_s": 0.01}
    assert rclient.hexists(keys.usage_pending, late.request_id)
    assert [q.request_id for q in queue.take(5)] == [patient.request_id]


def test_a_malformed_record_is_handed_out_without_a_message(queue_for, rclient, keys):
    queue = queue_for()
    good = message("acme")
    queue.enqueue(good)
    raw = json.loads(rclient.hget(keys.fq("wait"), good.request_id))
    rclient.hset(keys.fq("wait"), good.request_id, json.dumps({**raw, "body": "{not json"}))
    [taken] = queue.take(1)
    assert taken.request_id == good.request_id and taken.message is None


def test_a_dead_workers_request_is_served_once_by_another_worker(redis_prefix, settings,
                                                                  rclient, keys):
    from inference.worker.bridge import WorkerBridge
    from tests.support.e2e import wait_for
    from tests.support.engine import make_engine
    from tests.support.platform import InProcessWorker

    request = RequestMessage(request_id=uuid.uuid4().hex, tenant="acme", fairness_key="acme",
                             prompt="hello", sampling={"max_tokens": 5, "ignore_eos": True})
    silent = WorkerBridge(make_engine(), rclient, keys, "silent", prefetch=1)
    silent.queue.enqueue(request)
    assert silent.poll() == 1  # taken into its engine, which does not run yet
    rclient.zadd(keys.workers, {"silent": time.time() - 60})  # then its heartbeat lapsed
    live = InProcessWorker(redis_prefix, settings.REDIS_URL, worker_id="live",
                           heartbeat_ttl_s=5, max_model_len=256).start()
    try:
        assert wait_for(lambda: live.usage, 10), "the live worker never served it"
        silent.engine.start()  # the silent worker wakes up and runs it too
        assert wait_for(
            lambda: silent.engine.stats()["requests_finished"]["abort"] == 1, 10)
    finally:
        live.stop()
        silent.engine.shutdown(1)
    [report] = live.usage
    assert report.request_id == request.request_id and report.usage.completion_tokens == 5
    events = [json.loads(f[b"data"]) for _, f in rclient.xrange(keys.events(request.request_id))]
    assert [e["seq"] for e in events] == [0, 1, 2, 3, 4, 5]  # one run's tokens, then its end
    assert [e["type"] for e in events].count("final") == 1


def test_a_worker_that_finds_itself_reclaimed_stops_what_it_took(queue_for, rclient, keys):
    from inference.worker.bridge import WorkerBridge
    from tests.support.engine import make_engine

    usage = []
    silent = WorkerBridge(make_engine(), rclient, keys, "silent", prefetch=1,
                          usage_sink=usage.append)
    silent.publish_stats(60)
    request = message("acme")
    silent.queue.enqueue(request)
    assert silent.poll() == 1
    rclient.zadd(keys.workers, {"silent": time.time() - 60})
    assert queue_for("live").reclaim(ttl_s=10, events_ttl_s=60, sight_s=SEEN)[0] == 1  # back

    silent.publish_stats(60)  # its next heartbeat: it learns it was reclaimed
    silent.engine.step()
    silent.flush_usage()
    assert silent.engine.stats()["requests_finished"]["abort"] == 1
    assert usage == [] and rclient.xlen(keys.events(request.request_id)) == 0
    assert queue_for("live").gate1() == 1  # waiting again, counted once
    assert rclient.zscore(keys.workers, "silent")  # registered afresh


def test_a_stale_take_writes_nothing_even_once_the_same_worker_took_the_request_again(
        queue_for, rclient, keys):
    paused, judge = queue_for("paused"), queue_for("judge")
    request = message("acme")
    paused.enqueue(request)
    [first] = paused.take(1)
    rclient.zadd(keys.workers, {"paused": time.time() - 60})
    assert judge.reclaim(ttl_s=10, events_ttl_s=60, sight_s=SEEN)[:2] == (1, ["paused"])
    # Reclaimed while paused: it takes nothing, and releases nothing, until it registers again.
    with pytest.raises(Reclaimed):
        paused.take(1)
    assert paused.release_held(1) is False
    rclient.delete(keys.fq("reclaimed", "paused"))  # it stopped what it held: registered afresh
    [second] = paused.take(1)
    assert second.request_id == request.request_id and second.take != first.take
    rid = request.request_id
    # The first take's writes and ends are refused: a token, a final, a hand-back, a preemption.
    assert paused.write_events([(token(rid), first.take)], 60) == {(rid, first.take)}
    assert paused.write_events([(final(rid), first.take)], 60) == {(rid, first.take)}
    assert paused.requeue({rid: first.take}) == 0
    assert not paused.preempt(request, Usage(), first.take)
    assert rclient.xlen(keys.events(rid)) == 0 and not rclient.hexists(keys.usage_pending, rid)
    # The second take is served: both takes' events in one write, only its own go in.
    assert paused.write_events([(token(rid), first.take), (token(rid), second.take),
                                (final(rid), second.take)], 60) == {(rid, first.take)}
    assert [json.loads(f[b"data"])["type"] for _, f in rclient.xrange(keys.events(rid))] == [
        "token", "final"]
    assert rclient.hexists(keys.usage_pending, rid) and not rclient.hexists(keys.fq("take"), rid)


def test_a_take_handed_back_or_preempted_leaves_no_token_behind(queue_for, rclient, keys):
    queue = queue_for()
    back, preempted = message("acme"), message("acme")
    queue.enqueue(back)
    queue.enqueue(preempted)
    first, second = queue.take(2)
    assert queue.requeue({back.request_id: first.take}) == 1
    assert queue.write_events([(token(preempted.request_id), second.take)], 60) == set()
    assert queue.preempt(preempted, Usage(completion_tokens=1), second.take)
    assert rclient.hlen(keys.fq("take")) == 0
    # Taken again, each has a new token; the earlier ones stay refused.
    again = {q.request_id: q.take for q in queue.take(2)}
    assert again.keys() == {back.request_id, preempted.request_id}
    assert not set(again.values()) & {first.take, second.take}
    assert queue.requeue({back.request_id: first.take}) == 0
