"""A request of ``n`` > 1 choices through a worker: the message's ``n`` reaches the engine, the
request's one events stream counts every choice's tokens on one ``seq`` and ends with one final
event holding a :class:`~inference.protocol.events.ChoiceEnd` per choice, billed once for the
prompt and every choice's tokens; preempted for a higher tier, it goes back to the shared queue
whole and another worker goes on with every choice; more choices than the worker's rows is
refused naming ``n``.

In-process workers (reference backend) on a private Redis prefix; requests are put in the shared
queue as a tool does (``FairQueue.enqueue``), their streams read with ``XRANGE``.
"""

from __future__ import annotations

import uuid

import pytest

from inference.engine.backends.reference import ByteTokenizer
from inference.protocol.events import FinalEvent, FinishReason, TokenEvent, decode_event
from inference.protocol.messages import RequestMessage
from inference.worker.fair_queue import FairQueue
from inference.worker.preparation import submit_args
from tests.support.e2e import wait_for
from tests.support.platform import InProcessWorker

WORKER = {"max_model_len": 256, "max_batch_size": 3, "reference_step_delay_s": 0.005}


def message(tenant: str, priority: int = 0, prompt: str = "three answers, please",
            **sampling) -> RequestMessage:
    return RequestMessage(request_id=uuid.uuid4().hex, tenant=tenant, fairness_key=tenant,
                          priority=priority, prompt=prompt, sampling=sampling,
                          queue_deadline_s=120)


def events_of(rclient, keys, request_id: str) -> list:
    return [decode_event(fields) for _, fields in rclient.xrange(keys.events(request_id))]


def ended(rclient, keys, request_id: str) -> bool:
    events = events_of(rclient, keys, request_id)
    return bool(events) and isinstance(events[-1], FinalEvent)


@pytest.fixture
def worker(redis_prefix, settings):
    made = InProcessWorker(redis_prefix, settings.REDIS_URL, worker_id="w", prefetch=0,
                           **WORKER).start()
    yield made
    made.stop()


def test_the_message_s_n_reaches_the_engine():
    args = submit_args(message("t", n=4, max_tokens=5), ByteTokenizer(), 256)
    assert args["sampling"].n == 4
    assert submit_args(message("t", max_tokens=5), ByteTokenizer(), 256)["sampling"].n == 1


def test_n_choices_stream_on_one_seq_and_end_with_one_final_event(worker, rclient, keys):
    queue = FairQueue(rclient, keys, "tool", "vtc")
    request = message("t", n=3, max_tokens=8, temperature=5.0, seed=9, ignore_eos=True)
    queue.enqueue(request)
    assert wait_for(lambda: ended(rclient, keys, request.request_id), timeout_s=20)
    events = events_of(rclient, keys, request.request_id)
    final = events[-1]
    assert [e.seq for e in events] == list(range(len(events)))
    assert sum(isinstance(e, FinalEvent) for e in events) == 1
    tokens = [e for e in events[:-1] if isinstance(e, TokenEvent)]
    assert sorted({e.index for e in tokens}) == [0, 1, 2]
    assert [c.index for c in final.choices] == [0, 1, 2]
    assert all(c.finish_reason is FinishReason.LENGTH for c in final.choices)
    assert final.usage.completion_tokens == len(tokens) == 24
    assert final.usage.prompt_tokens == len(request.prompt.encode())
    assert wait_for(lambda: len(worker.usage) == 1)
    [report] = worker.usage
    assert report.usage.completion_tokens == 24
    assert worker.engine.stats()["prompt_tokens_computed"] == len(request.prompt.encode())


def by_choice(events: list) -> tuple[list[str], tuple]:
    """Each choice's text (its token events' and its end's) and the final event's choices."""
    final = events[-1]
    texts = [""] * len(final.choices)
    for event in events[:-1]:
        texts[event.index] += event.text
    for end in final.choices:
        texts[end.index] += end.text
    return texts, final.choices


def test_a_forked_request_preempted_whole_goes_on_in_another_worker(
        redis_prefix, settings, rclient, keys):
    """A full worker preempts every choice of a lower tier's request at once; the request goes
    back to the shared queue with each choice's state (``Resume.choices``) and another worker
    goes on with it: one events stream, no token lost or repeated, each choice exactly as
    alone, billed once."""
    sampling = {"n": 3, "max_tokens": 30, "temperature": 5.0, "seed": 3, "ignore_eos": True}
    made: list[InProcessWorker] = []

    def start(name: str) -> InProcessWorker:
        made.append(InProcessWorker(redis_prefix, settings.REDIS_URL, worker_id=name,
                                    prefetch=0, **WORKER).start())
        return made[-1]

    try:
        queue = FairQueue(rclient, keys, "tool", "vtc")
        alone = message("solo", **sampling)
        solo = start("solo")
        queue.enqueue(alone)
        assert wait_for(lambda: ended(rclient, keys, alone.request_id), timeout_s=20)
        solo.stop()
        made.remove(solo)
        expected = by_choice(events_of(rclient, keys, alone.request_id))

        first = start("first")
        bulk = message("bulk", 0, **sampling)
        queue.enqueue(bulk)
        assert wait_for(lambda: len(events_of(rclient, keys, bulk.request_id)) >= 9)
        # Every row of the only worker is the bulk request's, and the vip needs them all.
        vip = message("vip", 10, prompt="urgent", max_tokens=20, ignore_eos=True, n=3)
        queue.enqueue(vip)
        assert wait_for(lambda: rclient.hexists(keys.fq("wait"), bulk.request_id))
        second = start("second")
        assert wait_for(lambda: ended(rclient, keys, bulk.request_id), timeout_s=30)

        events = events_of(rclient, keys, bulk.request_id)
        final = events[-1]
        assert [e.seq for e in events] == list(range(len(events)))  # no gap, no repeat
        assert sum(isinstance(e, FinalEvent) for e in events) == 1
        assert by_choice(events) == expected  # each choice's seeded draws went on
        assert final.usage.completion_tokens == 90 == len(events) - 1
        assert first.engine.stats()["preemptions"] == 1
        assert wait_for(lambda: [u.request_id for u in second.usage] == [bulk.request_id])
        [report] = second.usage
        assert report.usage.completion_tokens == 90
        assert report.usage.prompt_tokens == len(bulk.prompt.encode())
    finally:
        for worker in made:
            worker.stop()


def test_more_choices_than_rows_is_refused_naming_n(worker, rclient, keys):
    queue = FairQueue(rclient, keys, "tool", "vtc")
    request = message("t", n=4, max_tokens=5)
    queue.enqueue(request)
    assert wait_for(lambda: ended(rclient, keys, request.request_id), timeout_s=20)
    (final,) = events_of(rclient, keys, request.request_id)
    assert final.finish_reason is FinishReason.ERROR
    assert final.error.code == "invalid_request" and final.error.details["param"] == "n"
    assert [c.finish_reason for c in final.choices] == [FinishReason.ERROR] * 4
