"""The publisher's hold (``EVENT_HOLD_MS``): a tick of tokens after each request's first waits
for the next tick's and goes out in the same write; a first token, a final event, a flush and
the hold's end are never waited for. What Redis is sent is recorded at the queue's write."""

from __future__ import annotations

import threading
import time

import pytest
import redis

from inference.protocol.events import FinalEvent, FinishReason, TokenEvent, Usage
from inference.worker.live import WorkerState
from inference.worker.publisher import EventPublisher


class RecordingQueue:
    """The shared queue's write, recorded: each write's ``(request id, seq)`` in order."""

    def __init__(self) -> None:
        self.writes: list[list[tuple[str, int]]] = []
        self.written = threading.Event()

    def write_events(self, events, ttl_s, prompt_tokens=None):
        self.writes.append([(event.request_id, event.seq) for event, _take in events])
        self.written.set()
        return set()

    def nudge(self) -> None:
        pass

    def wait_write(self, timeout_s: float) -> bool:
        got = self.written.wait(timeout_s)
        self.written.clear()
        return got


def token(rid: str, seq: int) -> TokenEvent:
    return TokenEvent(request_id=rid, seq=seq, token_id=65, text="A")


def final(rid: str, seq: int) -> FinalEvent:
    return FinalEvent(request_id=rid, seq=seq, finish_reason=FinishReason.LENGTH,
                      usage=Usage(prompt_tokens=3, completion_tokens=seq))


@pytest.fixture
def publisher():
    made: list[EventPublisher] = []

    def make(hold_s: float, min_streams: int = 1) -> tuple[EventPublisher, RecordingQueue]:
        queue = RecordingQueue()
        pub = EventPublisher(WorkerState(), None, queue, None, None, hold_s=hold_s,
                             hold_min_streams=min_streams)
        pub.start_publisher()
        made.append(pub)
        return pub, queue

    yield make
    for pub in made:
        pub.stop_publisher()


def test_a_tick_of_later_tokens_goes_out_with_the_next_tick(publisher):
    pub, queue = publisher(hold_s=30.0)
    pub.on_events([token("a", 1), token("b", 1)])
    assert not queue.wait_write(0.3), "a tick of later tokens went out alone"
    pub.on_events([token("a", 2), token("b", 2)])
    assert queue.wait_write(5.0)
    assert queue.writes == [[("a", 1), ("b", 1), ("a", 2), ("b", 2)]]
    # The tick after a write is held again: two tokens a stream in each write.
    pub.on_events([token("a", 3), token("b", 3)])
    assert not queue.wait_write(0.3)
    pub.on_events([token("a", 4), token("b", 4)])
    assert queue.wait_write(5.0)
    assert queue.writes[1] == [("a", 3), ("b", 3), ("a", 4), ("b", 4)]


def test_a_lone_streams_tokens_go_one_at_a_time_and_two_streams_are_held(publisher):
    # EVENT_HOLD_MIN_STREAMS=2 (the worker's default): one stream's tick goes at once.
    pub, queue = publisher(hold_s=30.0, min_streams=2)
    pub.on_events([token("a", 1)])
    assert queue.wait_write(5.0)
    pub.on_events([token("a", 2)])
    assert queue.wait_write(5.0)
    assert queue.writes == [[("a", 1)], [("a", 2)]]
    pub.on_events([token("a", 3), token("b", 1)])
    assert not queue.wait_write(0.3), "a tick of two streams' later tokens went out alone"
    pub.on_events([token("a", 4), token("b", 2)])
    assert queue.wait_write(5.0)
    assert queue.writes[2] == [("a", 3), ("b", 1), ("a", 4), ("b", 2)]


@pytest.mark.parametrize("tick", [
    pytest.param([token("a", 0)], id="a first token"),
    pytest.param([token("a", 5), token("b", 0)], id="beside another's first token"),
    pytest.param([token("a", 5), final("b", 9)], id="beside a final event"),
    pytest.param([final("a", 6)], id="a final event"),
])
def test_a_first_token_or_a_final_event_is_never_held(publisher, tick):
    pub, queue = publisher(hold_s=30.0)
    pub.on_events(tick)
    assert queue.wait_write(5.0), "the tick waited"
    assert queue.writes == [[(e.request_id, e.seq) for e in tick]]


def test_a_held_tick_goes_out_alone_when_its_hold_ends(publisher):
    pub, queue = publisher(hold_s=0.2)
    started = time.monotonic()
    pub.on_events([token("a", 1)])
    assert queue.wait_write(5.0)
    assert time.monotonic() - started >= 0.15
    assert queue.writes == [[("a", 1)]]


def test_a_flush_writes_a_held_tick_at_once(publisher):
    """A preempted request's hand-back (and a stop) flushes: every token its stream should hold
    is there before it moves."""
    pub, queue = publisher(hold_s=30.0)
    pub.on_events([token("a", 1)])
    assert not queue.wait_write(0.2)
    pub.flush_events()
    assert queue.writes == [[("a", 1)]]
    assert pub.num_unsent() == 0


def test_the_main_loops_flush_leaves_a_held_tick_to_the_publisher(publisher):
    """The worker's main loop flushes every poll (what an outage kept back): a held tick stays
    held until the next tick's events come."""
    pub, queue = publisher(hold_s=30.0)
    pub.on_events([token("a", 1)])
    assert not queue.wait_write(0.2)
    pub.flush_events(held=False)
    assert queue.writes == []
    pub.on_events([token("a", 2)])
    assert queue.wait_write(5.0)
    assert queue.writes == [[("a", 1), ("a", 2)]]


def test_no_hold_writes_every_tick(publisher):
    pub, queue = publisher(hold_s=0.0)
    pub.on_events([token("a", 1)])
    assert queue.wait_write(5.0)
    pub.on_events([token("a", 2)])
    assert queue.wait_write(5.0)
    assert queue.writes == [[("a", 1)], [("a", 2)]]


class UnreachableNudgeQueue(RecordingQueue):
    """A queue whose nudge meets an unreachable Redis (its writes still go through)."""

    def nudge(self) -> None:
        raise redis.TimeoutError("Timeout reading from socket")


@pytest.mark.parametrize("thread", [True, False], ids=["publisher thread", "engine thread"])
def test_a_tick_whose_nudge_meets_an_unreachable_redis_keeps_its_events(thread):
    # A tick with a final, while the main thread waits with its rows full, nudges it; Redis
    # paused meanwhile failed the nudge, and the tick's events (one token of every other
    # stream) were dropped: a gap in each stream, each client one token short.
    queue = UnreachableNudgeQueue()
    state = WorkerState()
    pub = EventPublisher(state, None, queue, None, None)
    if thread:
        pub.start_publisher()
    try:
        state.waiting_full = True
        pub.on_events([token("a", 1), token("b", 1)])
        pub.on_events([token("a", 2), final("b", 2)])  # b ends: a row is free
        pub.on_events([token("a", 3)])
        pub.flush_events()
        written = [item for write in queue.writes for item in write]
        assert written == [("a", 1), ("b", 1), ("a", 2), ("b", 2), ("a", 3)]
        assert state.row_freed.is_set()
    finally:
        pub.stop_publisher()
