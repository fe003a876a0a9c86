"""Several base models in one deployment: each model's requests wait in its own queue and go only
to the workers of that model (docs/design.md, "Several base models").

Requests go through the web tier's admission into Redis; in-process workers (reference backend)
serve one model each. Whatever ends requests without a worker of theirs (an abort while waiting,
an admission deadline, a dead worker's reclaim) finds them in whichever model's queue they wait.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import pytest

from gateway import aborts, admission, housekeeping, usage
from gateway.admission import Principal
from gateway.errors import APIError
from inference.protocol.events import FinalEvent
from inference.protocol.keys import Keys
from inference.protocol.liveness import RedisSight
from inference.protocol.messages import RequestMessage
from inference.worker.fair_queue import FairQueue
from tenants.models import UsageRecord
from tests.support.e2e import wait_for
from tests.support.platform import InProcessWorker

pytestmark = [pytest.mark.django_db]

OTHER = "tiny-llama"


def message(key, model: str, **fields) -> RequestMessage:
    tenant = key.tenant
    return RequestMessage(
        request_id=uuid.uuid4().hex, tenant=tenant.slug, fairness_key=tenant.slug,
        priority=tenant.tier.priority, fairness_weight=tenant.fairness_weight, prompt="x" * 8,
        sampling={"max_tokens": 4, "ignore_eos": True},
        meta={"model": model, "tenant_id": tenant.pk, "api_key_id": key.pk}, **fields)


def admit(key, *messages: RequestMessage) -> list[RequestMessage | APIError]:
    async def each() -> list[RequestMessage | APIError]:
        out: list[RequestMessage | APIError] = []
        for m in messages:
            try:
                out.append(await admission.admit(Principal.for_api_key(key), m, 12))
            except APIError as exc:
                out.append(exc)
        return out

    return asyncio.run(each())


def final(rclient, keys: Keys, request_id: str) -> FinalEvent | None:
    for _, fields in rclient.xrange(keys.events(request_id)):
        data = json.loads(fields[b"data"])
        if data["type"] == "final":
            return FinalEvent.model_validate(data)
    return None


@pytest.fixture
def default_model(settings) -> str:
    return settings.LLM_PLATFORM["SERVED_MODEL_NAME"]


@pytest.fixture
def two_workers(redis_prefix, settings):
    started = [InProcessWorker(redis_prefix, settings.REDIS_URL, worker_id="w-default",
                               max_model_len=256),
               InProcessWorker(redis_prefix, settings.REDIS_URL, worker_id="w-other",
                               model=OTHER, max_model_len=256)]
    for worker in started:
        worker.start()
    yield started
    for worker in started:
        worker.stop()


def test_each_request_is_served_only_by_a_worker_of_its_model(tenant_key, two_workers,
                                                               default_model, rclient, keys):
    _, key, _ = tenant_key
    default_worker, other_worker = two_workers
    sent = admit(key, *[message(key, m) for m in [default_model, OTHER] * 4])
    assert all(isinstance(m, RequestMessage) for m in sent)
    assert wait_for(lambda: len(default_worker.usage) + len(other_worker.usage) == 8, 20)
    by_model = {m.request_id: m.meta["model"] for m in sent}
    assert {r.request_id for r in default_worker.usage} == {
        i for i, m in by_model.items() if m == default_model}
    assert {r.request_id for r in other_worker.usage} == {
        i for i, m in by_model.items() if m == OTHER}
    for request_id in by_model:
        end = final(rclient, keys, request_id)
        assert end is not None and end.error is None and end.usage.completion_tokens == 4
    # Each worker advertises its model; the other model's queue is known to the deployment.
    snapshots = {w: json.loads(rclient.get(keys.stats(w))) for w in ("w-default", "w-other")}
    assert snapshots["w-default"]["model"] == "" and snapshots["w-other"]["model"] == OTHER
    assert rclient.smembers(keys.queues) == {f"{keys.prefix}@{OTHER}".encode()}


def test_a_model_without_a_live_worker_is_refused_with_503_and_the_others_are_served(
        tenant_key, redis_prefix, settings, default_model):
    _, key, _ = tenant_key
    worker = InProcessWorker(redis_prefix, settings.REDIS_URL, worker_id="w-default",
                             max_model_len=256).start()
    try:
        refused, served = admit(key, message(key, OTHER), message(key, default_model))
        assert isinstance(refused, APIError) and refused.status == 503
        assert refused.code == "no_worker_available" and refused.retry_after_s
        assert OTHER in refused.message
        assert isinstance(served, RequestMessage)
        assert wait_for(lambda: len(worker.usage) == 1, 10)
    finally:
        worker.stop()


def test_gate_one_is_each_models_own(tenant_key, rclient, keys, settings, default_model):
    settings.LLM_PLATFORM = {**settings.LLM_PLATFORM, "MAX_QUEUE_SIZE": 2}
    _, key, _ = tenant_key
    other = Keys(keys.prefix, OTHER)
    # A live worker of each model that takes nothing: what is admitted waits.
    rclient.zadd(keys.workers, {"idle-default": time.time() + 3600,
                                "idle-other": time.time() + 3600})
    rclient.hset(keys.worker_queue, "idle-other", other.queue)
    results = admit(key, *[message(key, OTHER) for _ in range(3)],
                    *[message(key, default_model) for _ in range(2)])
    assert [type(r).__name__ for r in results] == ["RequestMessage"] * 2 + ["APIError"] + [
        "RequestMessage"] * 2
    assert results[2].status == 429 and results[2].code == "queue_full"
    assert rclient.hlen(other.fq("wait")) == 2 and rclient.hlen(keys.fq("wait")) == 2


def test_an_abort_and_a_deadline_end_a_request_waiting_in_another_models_queue(
        tenant_key, rclient, keys, settings):
    settings.LLM_PLATFORM = {**settings.LLM_PLATFORM, "MAX_QUEUE_WAIT_S": 0.05}
    _, key, _ = tenant_key
    other = Keys(keys.prefix, OTHER)
    rclient.zadd(keys.workers, {"idle-other": time.time() + 3600})
    rclient.hset(keys.worker_queue, "idle-other", other.queue)
    left, late = admit(key, message(key, OTHER), message(key, OTHER, queue_deadline_s=0.05))
    aborts.abort_sync(left.request_id, rclient)
    assert final(rclient, keys, left.request_id).finish_reason == "abort"
    time.sleep(0.1)
    assert late.request_id in housekeeping.sweep(rclient, sight=RedisSight(gap_s=5))
    assert final(rclient, keys, late.request_id).error.code == "queue_timeout"
    assert rclient.hlen(other.fq("wait")) == 0
    # Billed once each, for nothing: the abort's record is written at once, the expired
    # request's entry waits in the ledger for Celery.
    assert UsageRecord.objects.get(request_id=left.request_id).completion_tokens == 0
    assert rclient.hexists(keys.usage_pending, late.request_id)


def test_a_dead_workers_requests_go_back_to_its_models_queue_whoever_judges(rclient, keys):
    other = Keys(keys.prefix, OTHER)
    request = RequestMessage(request_id=uuid.uuid4().hex, tenant="acme", fairness_key="acme",
                             prompt="hi", meta={"model": OTHER})
    dead = FairQueue(rclient, other, "dead-other", "vtc")
    dead.enqueue(request)
    rclient.hset(keys.worker_queue, "dead-other", other.queue)
    assert [q.request_id for q in dead.take(1)] == [request.request_id]
    rclient.zadd(keys.workers, {"dead-other": time.time() - 60, "judge": time.time()})
    # A worker of the default model judges it.
    judge = FairQueue(rclient, keys, "judge", "vtc")
    assert judge.reclaim(ttl_s=10, events_ttl_s=60, sight_s=1e6) == (1, ["dead-other"], [])
    assert rclient.hexists(other.fq("wait"), request.request_id)  # back in its own queue
    assert not rclient.hexists(keys.fq("wait"), request.request_id)
    assert not rclient.hexists(keys.worker_queue, "dead-other")
    assert judge.take(1) == []  # never handed to a worker of another model
    assert [q.request_id for q in FairQueue(rclient, other, "live-other", "vtc").take(1)] == [
        request.request_id]


def test_stats_metrics_and_the_dashboard_show_each_model(tenant_key, two_workers, default_model,
                                                         admin_client, rclient, keys):
    from prometheus_client.parser import text_string_to_metric_families

    _, key, _ = tenant_key
    sent = admit(key, *[message(key, OTHER) for _ in range(3)], message(key, default_model))
    assert wait_for(lambda: sum(len(w.usage) for w in two_workers) == 4, 20)
    for request_id in (m.request_id for m in sent):  # as Celery records them
        usage.record(request_id, rclient)
    for worker in two_workers:  # a fresh snapshot
        worker.bridge.publish_stats(3600)

    stats = admin_client.get("/scheduler/stats").json()
    assert set(stats["models"]) == {default_model, OTHER}
    assert stats["models"][OTHER]["workers"] == ["w-other"]
    assert stats["models"][OTHER]["total"]["model"] == OTHER
    assert stats["models"][OTHER]["total"]["requests_finished"]["length"] == 3
    assert stats["models"][default_model]["workers"] == ["w-default"]
    assert stats["workers"]["w-other"]["model"] == OTHER

    families = {f.name: f for f in text_string_to_metric_families(
        admin_client.get("/metrics").content.decode())}
    alive = {s.labels["model"]: s.value for s in families["llm_workers_alive"].samples}
    assert alive == {default_model: 1, OTHER: 1}
    info = {s.labels["worker"]: s.labels["model"] for s in families["llm_worker_info"].samples}
    assert info == {"w-default": default_model, "w-other": OTHER}
    generated = {s.labels["model"]: s.value
                 for s in families["llm_model_generation_tokens"].samples
                 if s.name.endswith("_total")}
    assert generated == {OTHER: 12, default_model: 4}
    assert UsageRecord.objects.filter(model=OTHER).count() == 3

    live = admin_client.get("/admin/scheduler/data").json()["live"]
    assert live["per_model"][OTHER]["workers"] == 1
    assert live["per_model"][OTHER]["tokens_generated"] == 12
