"""Priority preemption across Redis: a worker whose rows are full takes a higher tier's request
and preempts for it; the preempted request goes back to the shared queue and any worker goes on
with it, its client reading one events stream without a token lost or repeated, billed once.

In-process workers (reference backend) on a private Redis prefix; requests are put in the shared
queue as a tool does (``FairQueue.enqueue``), their streams read with ``XRANGE``.
"""

from __future__ import annotations

import uuid

import pytest

from inference.engine.config import EngineConfig
from inference.engine.llm_engine import LLMEngine
from inference.engine.request import SamplingParams
from inference.protocol.events import FinalEvent, FinishReason, TokenEvent, decode_event
from inference.protocol.keys import EVENTS_TTL_S, Keys, queue_script
from inference.protocol.messages import RequestMessage
from inference.worker.fair_queue import FairQueue
from tests.support.e2e import wait_for
from tests.support.engine import run_until_idle
from tests.support.platform import InProcessWorker

PROMPT = "a batch job's prompt"
SAMPLING = {"max_tokens": 60, "temperature": 1.3, "seed": 7, "stop": ["zq"], "ignore_eos": True}
WORKER = {"max_model_len": 256, "max_batch_size": 1, "reference_step_delay_s": 0.01}


def message(tenant: str, priority: int, prompt: str = PROMPT, **sampling) -> RequestMessage:
    return RequestMessage(request_id=uuid.uuid4().hex, tenant=tenant, fairness_key=tenant,
                          priority=priority, prompt=prompt, sampling=sampling,
                          queue_deadline_s=120)


def stream(rclient, keys: Keys, request_id: str) -> list[tuple[tuple[int, int], object]]:
    """``(entry id as (ms, seq), event)`` of each entry of the request's events stream, in
    order (entry ids of two streams compare as the times they were written)."""
    return [(tuple(int(part) for part in entry.split(b"-")), decode_event(fields))
            for entry, fields in rclient.xrange(keys.events(request_id))]


def tokens_streamed(rclient, keys, request_id) -> int:
    return sum(isinstance(e, TokenEvent) for _, e in stream(rclient, keys, request_id))


def answer_alone() -> tuple[str, int, FinalEvent]:
    """The batch request's text, token count and final event on an idle engine of the same
    settings."""
    engine = LLMEngine(EngineConfig(backend="reference", max_model_len=256, max_batch_size=1))
    handle = engine.submit(prompt=PROMPT, sampling=SamplingParams(
        **{**SAMPLING, "stop": tuple(SAMPLING["stop"])}))
    run_until_idle(engine)
    text, tokens, final = handle.result(timeout=1)
    return text, len(tokens), final


@pytest.fixture
def workers(redis_prefix, settings):
    made: list[InProcessWorker] = []

    def make(name: str, **engine_settings) -> InProcessWorker:
        made.append(InProcessWorker(redis_prefix, settings.REDIS_URL, worker_id=name,
                                    prefetch=0, **{**WORKER, **engine_settings}).start())
        return made[-1]

    yield make
    for worker in made:
        worker.stop()


def test_a_full_worker_preempts_for_a_higher_tier_and_another_worker_goes_on(
        workers, rclient, keys):
    queue = FairQueue(rclient, keys, "tool", "vtc")
    first = workers("first")
    batch = message("bulk", 0, **SAMPLING)
    queue.enqueue(batch)
    assert wait_for(lambda: tokens_streamed(rclient, keys, batch.request_id) >= 5)
    vip = message("vip", 10, prompt="urgent", max_tokens=40, ignore_eos=True)
    queue.enqueue(vip)  # the only worker's only row is taken by the batch request
    # The batch request is preempted and waits in the queue (the first worker has no room).
    assert wait_for(lambda: rclient.hexists(keys.fq("wait"), batch.request_id))
    second = workers("second")
    assert wait_for(lambda: first.usage and second.usage and len(first.usage) + len(
        second.usage) == 2, timeout_s=20)

    events = stream(rclient, keys, batch.request_id)
    final_id, final = events[-1]
    text, n_tokens, alone = answer_alone()
    assert isinstance(final, FinalEvent) and final.finish_reason is alone.finish_reason
    assert [e.seq for _, e in events] == list(range(len(events)))  # no gap, no repeat
    assert "".join(e.text for _, e in events) == text  # with the seeded draws going on
    assert final.usage.completion_tokens == n_tokens > 5
    vip_first_id = stream(rclient, keys, vip.request_id)[0][0]
    assert vip_first_id < final_id, "the vip did not wait for the batch request to end"

    assert first.engine.stats()["preemptions"] == 1
    assert second.engine.stats()["tokens_generated"] > 0  # it went on with the batch request
    # Billed once, by the worker that ended it, for every token; its TTFT is its first run's.
    assert [u.request_id for u in second.usage] == [batch.request_id]
    assert [u.request_id for u in first.usage] == [vip.request_id]
    [report] = second.usage
    assert report.usage.completion_tokens == n_tokens
    assert report.usage.prompt_tokens == len(PROMPT.encode())
    assert report.first_token_at is not None and report.first_token_at < vip.enqueued_at
    assert rclient.hlen(keys.fq("wait")) == 0 and not rclient.hgetall(keys.fq("inflight"))


def test_a_preempted_request_withdrawn_while_it_waits_ends_after_its_tokens_billed_for_them(
        workers, rclient, keys):
    queue = FairQueue(rclient, keys, "tool", "vtc")
    worker = workers("only")
    batch = message("bulk", 0, **SAMPLING)
    queue.enqueue(batch)
    assert wait_for(lambda: tokens_streamed(rclient, keys, batch.request_id) >= 3)
    queue.enqueue(message("vip", 10, prompt="urgent", max_tokens=40, ignore_eos=True))
    assert wait_for(lambda: rclient.hexists(keys.fq("wait"), batch.request_id))
    streamed = tokens_streamed(rclient, keys, batch.request_id)

    # The client leaves: the web tier withdraws it from the queue (gateway.aborts.abort).
    ended = rclient.eval(queue_script("withdraw"), 0, keys.prefix, EVENTS_TTL_S, "ids",
                         batch.request_id)
    assert ended == [batch.request_id.encode()]
    events = stream(rclient, keys, batch.request_id)
    final = events[-1][1]
    assert isinstance(final, FinalEvent) and final.finish_reason is FinishReason.ABORT
    assert final.seq == streamed == len(events) - 1
    assert final.usage.completion_tokens == streamed
    assert final.usage.prompt_tokens == len(PROMPT.encode())
    assert worker.engine.stats()["preemptions"] == 1


def test_with_preemption_off_a_full_worker_leaves_a_higher_tier_waiting(
        workers, rclient, keys):
    queue = FairQueue(rclient, keys, "tool", "vtc")
    worker = workers("only", preemption=False)
    batch = message("bulk", 0, **{**SAMPLING, "max_tokens": 20})
    queue.enqueue(batch)
    assert wait_for(lambda: tokens_streamed(rclient, keys, batch.request_id) >= 3)
    vip = message("vip", 10, prompt="urgent", max_tokens=3, ignore_eos=True)
    queue.enqueue(vip)
    assert wait_for(lambda: len(worker.usage) == 2, timeout_s=20)
    batch_final_id = stream(rclient, keys, batch.request_id)[-1][0]
    assert stream(rclient, keys, vip.request_id)[0][0] > batch_final_id
    assert worker.engine.stats()["preemptions"] == 0


def test_a_take_for_preemption_takes_only_a_higher_tier(rclient, keys):
    queue = FairQueue(rclient, keys, "w", "fcfs")
    low, high = message("a", 0), message("b", 5)
    queue.enqueue(low)
    assert queue.take(1, above=0) == []  # the head is not above the worker's lowest row
    queue.enqueue(high)
    assert queue.take(4, above=5) == []
    assert [q.request_id for q in queue.take(4, above=0)] == [high.request_id]
    assert [q.request_id for q in queue.take(4)] == [low.request_id]
