"""Every end of a request bills what its client got (``gateway.usage``, ``gateway.delivery``).

Real Redis and a real database; the web tier's side runs as it does in a web process (a
:class:`gateway.lifecycle.Generation` read by the loop's event reader), the worker's side
through the shared queue's scripts. The tests commit what they write (``transaction=True``): a
web process records usage on a thread of its own.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from django.db import connections

from gateway import admission, delivery, lifecycle, monitor, usage
from gateway.admission import Principal
from gateway.clients import aredis
from gateway.errors import APIError
from gateway.tasks import record_usage
from inference.protocol.events import (
    ErrorCode,
    ErrorInfo,
    FinalEvent,
    FinishReason,
    TokenEvent,
    Usage,
)
from inference.protocol.messages import RequestMessage
from inference.worker.fair_queue import FairQueue
from tenants.models import UsageRecord

pytestmark = pytest.mark.django_db(transaction=True)

PROMPT = 30


@pytest.fixture
def web(rclient, keys) -> str:
    """This process as the web process relaying the requests (its heartbeat fresh)."""
    rclient.zadd(keys.web, {monitor.WEB_ID: time.time()})
    return monitor.WEB_ID


@pytest.fixture
def metered(make_tenant, live_worker):
    """A key of a tenant with a token budget (its reservations settle with each record)."""
    return make_tenant(token_budget=100_000)[1]


def admitted(key, *, origin: str, stream: bool, max_tokens: int = 100) -> RequestMessage:
    message = RequestMessage(
        request_id=uuid.uuid4().hex, tenant=key.tenant.slug, fairness_key=key.tenant.slug,
        prompt="hi", origin=origin,
        meta={"tenant_id": key.tenant.pk, "api_key_id": key.pk, "stream": stream})
    return asyncio.run(admission.admit(Principal.for_api_key(key), message,
                                       PROMPT + max_tokens))


class Worker:
    """A worker's writes to the shared queue for one request it took."""

    def __init__(self, rclient, keys, message: RequestMessage):
        self.queue = FairQueue(rclient, keys, "w1", "vtc")
        [taken] = self.queue.take(1)
        assert taken.request_id == message.request_id
        self.take, self.id, self.next = taken.take, message.request_id, 0

    def tokens(self, n: int) -> None:
        events = [TokenEvent(request_id=self.id, seq=self.next + i, token_id=97, text="a")
                  for i in range(n)]
        self.next += n
        assert not self.queue.write_events([(e, self.take) for e in events], 60,
                                           {self.id: PROMPT})

    def end(self, reason: FinishReason, error: ErrorInfo | None = None) -> None:
        final = FinalEvent(request_id=self.id, seq=self.next, finish_reason=reason, error=error,
                           usage=Usage(prompt_tokens=PROMPT, completion_tokens=self.next))
        assert not self.queue.write_events([(final, self.take)], 60, {self.id: PROMPT})


def record_of(message: RequestMessage) -> UsageRecord:
    return UsageRecord.objects.get(request_id=message.request_id)


def billed(row: UsageRecord) -> tuple:
    return row.prompt_tokens, row.completion_tokens, row.status, row.finish_reason, row.error_code


def budget_used(rclient, message: RequestMessage) -> int:
    return int(rclient.get(message.meta["admission"]["budgets"][0]["key"]))


def on_a_web_loop(body):
    """Run ``body()`` on an event loop as a web process would, then close the database
    connections its threads opened (the test database is flushed after the test)."""

    async def run():
        try:
            return await body()
        finally:
            from asgiref.sync import sync_to_async

            await sync_to_async(connections.close_all)()

    return asyncio.run(run())


async def relay(gen: lifecycle.Generation, n: int | None = None) -> list:
    """Relay ``gen``'s events as the REST API does (each token marked sent once handed over),
    up to ``n`` tokens (None: to the end); returns them."""
    got = []
    events = gen.events()
    try:
        async for event in events:
            got.append(event)
            if isinstance(event, TokenEvent):
                gen.sent(event.seq)
                if n is not None and sum(isinstance(e, TokenEvent) for e in got) == n:
                    break
    finally:
        await events.aclose()
    return got


# A web process that relayed the request says what its client got ----------------------------

def test_a_stream_relayed_to_its_end_is_billed_in_full(metered, web, rclient, keys):
    message = admitted(metered, origin=web, stream=True)
    worker = Worker(rclient, keys, message)
    worker.tokens(10)
    worker.end(FinishReason.LENGTH)

    async def web_process():
        gen = lifecycle.Generation(message)
        await relay(gen)
        await gen.close()

    on_a_web_loop(web_process)
    assert record_usage(message.request_id) is True
    assert billed(record_of(message)) == (PROMPT, 10, 200, "length", "")
    assert budget_used(rclient, message) == PROMPT + 10


def test_a_recorder_before_the_web_processs_note_waits_and_the_web_process_records(
        metered, web, rclient, keys):
    message = admitted(metered, origin=web, stream=False)
    worker = Worker(rclient, keys, message)
    worker.tokens(6)
    worker.end(FinishReason.LENGTH)
    # The usage task comes first: the answer is not sent yet (it may never be), so it waits.
    assert record_usage(message.request_id) is False
    assert not UsageRecord.objects.filter(request_id=message.request_id).exists()

    async def web_process():
        gen = lifecycle.Generation(message)
        await relay(gen)
        await gen.close()  # the answer goes out whole; the note finds the recorder waited

    on_a_web_loop(web_process)
    assert billed(record_of(message)) == (PROMPT, 6, 200, "length", "")
    assert usage.pending() == 0 and not rclient.exists(delivery.note_key(message.request_id))


def test_a_client_that_leaves_is_billed_the_tokens_it_was_sent(metered, web, rclient, keys):
    message = admitted(metered, origin=web, stream=True)
    worker = Worker(rclient, keys, message)
    worker.tokens(4)

    async def web_process():
        gen = lifecycle.Generation(message)
        await relay(gen, 4)
        await gen.close()  # the client went away: an abort

    on_a_web_loop(web_process)
    worker.tokens(3)  # generated before the abort reached the worker
    worker.end(FinishReason.ABORT)
    assert record_usage(message.request_id) is True
    assert billed(record_of(message)) == (PROMPT, 4, 499, "abort", "")


def test_an_answer_not_streamed_cut_at_a_drains_end_bills_nothing(metered, web, rclient, keys):
    # Past the drain's grace its view is cancelled: the response ends with neither a final
    # event nor an error, which outside a drain would be a client that left (billed its
    # prompt); during one the server cut it, and its client got nothing.
    message = admitted(metered, origin=web, stream=False)
    worker = Worker(rclient, keys, message)
    worker.tokens(40)

    async def web_process():
        gen = lifecycle.Generation(message)
        await gen.close()

    monitor.DRAINING.set()
    try:
        on_a_web_loop(web_process)
    finally:
        monitor.DRAINING.clear()
    worker.end(FinishReason.ABORT)
    assert record_usage(message.request_id) is True
    assert billed(record_of(message)) == (0, 0, 499, "abort", "")
    assert budget_used(rclient, message) == 0


def test_a_drain_that_interrupts_an_answer_not_streamed_bills_nothing(metered, web, rclient,
                                                                     keys):
    message = admitted(metered, origin=web, stream=False)
    worker = Worker(rclient, keys, message)
    worker.tokens(130)
    worker.end(FinishReason.ABORT)  # the drain's end stopped it: an abort nobody here asked

    async def web_process():
        gen = lifecycle.Generation(message)
        await relay(gen)
        await gen.close()
        return gen.final

    final = on_a_web_loop(web_process)
    # The client gets 503 interrupted, and the error counts what it got: nothing.
    assert final.error.code is ErrorCode.INTERRUPTED
    assert final.error.details["completion_tokens"] == 0
    assert APIError.from_worker(final.error).status == 503
    assert record_usage(message.request_id) is True
    assert billed(record_of(message)) == (0, 0, 503, "error", "interrupted")
    assert budget_used(rclient, message) == 0


def test_a_drain_that_interrupts_a_stream_bills_what_it_was_sent(metered, web, rclient, keys):
    message = admitted(metered, origin=web, stream=True)
    worker = Worker(rclient, keys, message)
    worker.tokens(12)
    worker.end(FinishReason.ABORT)

    async def web_process():
        gen = lifecycle.Generation(message)
        await relay(gen)
        await gen.close()
        return gen.final

    final = on_a_web_loop(web_process)
    assert final.error.details["completion_tokens"] == 12
    record_usage(message.request_id)
    assert billed(record_of(message)) == (PROMPT, 12, 503, "error", "interrupted")


# A web process that died says nothing: its checkpoint does ---------------------------------

def dies(rclient, keys, origin: str) -> None:
    """``origin``'s heartbeat lapses while the worker's beats on."""
    rclient.zadd(keys.web, {origin: time.time() - 60})
    rclient.zadd(keys.workers, {"w1": time.time()})


async def relay_then_die(gen: lifecycle.Generation, worker: Worker, n: int) -> None:
    """Relay ``n`` tokens and mark them sent; the loop's reader writes the checkpoint with a
    later read; then the process dies (its response never ends: no note)."""
    events = gen.events()
    seen = 0
    async for event in events:
        if isinstance(event, TokenEvent):
            gen.sent(event.seq)
            seen += 1
            if seen == n:
                break
    key = delivery.checkpoint_key(monitor.WEB_ID)
    client = aredis()
    await asyncio.sleep(delivery.CHECKPOINT_INTERVAL_S)
    worker.tokens(1)  # the reader's next read returns, and the one after carries the checkpoint
    deadline = time.monotonic() + 5
    want = str(n).encode() if gen.streaming else None  # an answer not streamed has none
    while await client.hget(key, gen.request_id) != want:
        assert time.monotonic() < deadline, "no checkpoint"
        await asyncio.sleep(0.02)
    await events.aclose()


@pytest.mark.parametrize("stream, bill", [(True, (PROMPT, 3, 499, "abort", "")),
                                          (False, (0, 0, 499, "abort", ""))])
def test_an_answer_ended_after_its_web_process_died_bills_up_to_the_checkpoint(
        metered, web, rclient, keys, stream, bill):
    message = admitted(metered, origin=web, stream=stream)
    worker = Worker(rclient, keys, message)
    worker.tokens(3)

    async def web_process():
        await relay_then_die(lifecycle.Generation(message), worker, 3)

    on_a_web_loop(web_process)
    worker.tokens(6)
    worker.end(FinishReason.LENGTH)  # finished within the web heartbeat's TTL: no one stopped it
    assert record_usage(message.request_id) is False  # its web process may still send it
    dies(rclient, keys, web)
    assert record_usage(message.request_id) is True
    # A stream billed what it was sent by its last checkpoint, an answer not streamed nothing.
    assert billed(record_of(message)) == bill
    assert budget_used(rclient, message) == bill[0] + bill[1]
    assert not rclient.hexists(delivery.checkpoint_key(web), message.request_id)


def test_the_reconciliation_records_at_once_what_a_dead_web_process_left(metered, web,
                                                                          rclient, keys):
    message = admitted(metered, origin=web, stream=False)
    worker = Worker(rclient, keys, message)
    worker.end(FinishReason.LENGTH)
    assert usage.reconcile() == 0  # young, its web process alive: left to its task
    dies(rclient, keys, web)
    assert usage.reconcile() == 1  # young, but no one else would record it sooner
    assert billed(record_of(message)) == (0, 0, 499, "abort", "")


def test_when_every_heartbeat_is_stale_it_is_an_outage_not_a_death(metered, web, rclient,
                                                                   keys):
    message = admitted(metered, origin=web, stream=False)
    worker = Worker(rclient, keys, message)
    worker.end(FinishReason.LENGTH)
    for name in (keys.web, keys.workers):  # nobody beat: Redis was away
        rclient.zadd(name, {member: time.time() - 60 for member in rclient.zrange(name, 0, -1)})
    assert record_usage(message.request_id) is False
    assert usage.pending() == 1


def test_a_web_process_gone_is_judged_against_the_others_heartbeats():
    now, ttl = 1000.0, 3.0
    assert delivery.web_gone(now - 4, now - 1, now - 10, now, ttl)
    assert not delivery.web_gone(now - 2, now - 1, now - 10, now, ttl)  # it beat within the TTL
    assert not delivery.web_gone(now - 4, now - 4, now - 10, now, ttl)  # nobody did: an outage
    # No heartbeat at all (Redis lost its data): gone only a TTL after the request's end.
    assert not delivery.web_gone(None, now - 1, now - 1, now, ttl)
    assert delivery.web_gone(None, now - 1, now - 4, now, ttl)


# Redis lost its data -------------------------------------------------------------------------

def lose_redis_data(rclient, prefix: str) -> None:
    """Redis restarted without its data (for this deployment's keys: the epoch included)."""
    stale = list(rclient.scan_iter(f"{prefix}:*", count=1000))
    if stale:
        rclient.delete(*stale)


def state_lost(message: RequestMessage, generated: int, streamed: int, rclient, keys) -> None:
    """The worker's end of a request Redis lost (its real path): it generated ``generated``
    tokens, its stream held ``streamed`` when Redis lost them."""
    from inference.worker.live import LiveRequest, WorkerState
    from inference.worker.publisher import EventPublisher

    publisher = EventPublisher(WorkerState(), None, None, rclient, keys)
    final = FinalEvent(request_id=message.request_id, seq=generated,
                       finish_reason=FinishReason.ABORT,
                       usage=Usage(prompt_tokens=PROMPT, completion_tokens=generated))
    publisher.write_unowned_final(final, LiveRequest(message, take="t", streamed=streamed))


def test_the_worker_bills_a_lost_request_for_what_its_stream_held(metered, rclient, keys,
                                                                  redis_prefix):
    message = admitted(metered, origin="", stream=True)  # no web process says (a chat answer)
    worker = Worker(rclient, keys, message)
    worker.tokens(5)
    lose_redis_data(rclient, redis_prefix)
    state_lost(message, generated=9, streamed=5, rclient=rclient, keys=keys)
    final = FinalEvent.model_validate_json(
        rclient.xrevrange(keys.events(message.request_id), count=1)[0][1][b"data"])
    assert final.error.code is ErrorCode.STATE_LOST
    assert final.error.details["completion_tokens"] == 5
    assert record_usage(message.request_id) is True
    assert billed(record_of(message)) == (PROMPT, 5, 503, "error", "state_lost")


def test_a_stream_redis_lost_is_billed_the_tokens_its_client_was_sent(
        metered, web, rclient, keys, redis_prefix):
    message = admitted(metered, origin=web, stream=True)
    worker = Worker(rclient, keys, message)
    worker.tokens(5)

    async def web_process():
        gen = lifecycle.Generation(message)
        events = gen.events()
        seen = 0
        async for event in events:
            if isinstance(event, TokenEvent):
                gen.sent(event.seq)
                seen += 1
                if seen == 5:
                    break
        worker.tokens(1)  # in the stream, never read: Redis loses it
        lose_redis_data(rclient, redis_prefix)
        await monitor.current().beat()  # the web monitor's round reads the new epoch
        with pytest.raises(APIError) as lost:
            async for _ in events:
                pass
        await gen.close()
        return lost.value

    lost = on_a_web_loop(web_process)
    assert (lost.status, lost.code) == (503, "service_unavailable")
    assert lost.details["completion_tokens"] == 5  # what the client got
    rclient.zadd(keys.web, {web: time.time()})
    state_lost(message, generated=9, streamed=6, rclient=rclient, keys=keys)
    assert record_usage(message.request_id) is True
    assert billed(record_of(message)) == (PROMPT, 5, 503, "error", "service_unavailable")
