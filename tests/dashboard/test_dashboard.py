"""The admin dashboard, its data, the snapshot and cleanup tasks, and ``GET /metrics``."""

from __future__ import annotations

import json
import time
from datetime import timedelta

import pytest
from django.utils import timezone

from dashboard import tasks
from dashboard.models import StatsSnapshot
from dashboard.stats import tokens_rate
from tenants.models import UsageRecord

pytestmark = pytest.mark.django_db

STATS = {
    "num_pending": 2, "num_prefilling": 1, "num_active": 3, "active_kv_reserved": 900,
    "active_kv_budget": 4000, "kv_admit_blocked": 7, "tokens_generated": 500,
    "prompt_tokens_computed": 1200, "kv_pressure": 0.25, "kv_blocks_total": 40,
    "kv_blocks_held": 10, "kv_blocks_free": 30, "kv_blocks_evictable": 0, "uptime_s": 100.0,
    "max_model_len": 8192,
    "admissions_soft_held": {"2": 5, "3": 2}, "admissions_hard_rejected": {"2": 1},
    "requests_finished": {"stop": 4, "abort": 1},
    "per_key": {"acme": {"vtc_counter": 120.0, "in_flight": 2, "pending": 1,
                         "prompt_tokens_served": 60, "completion_tokens_served": 30}},
}


@pytest.fixture
def published(rclient, keys):
    """Publish a worker's stats snapshot, as a live worker does."""

    def publish(worker: str = "w1", **changes):
        rclient.zadd(keys.workers, {worker: time.time()})
        rclient.set(keys.stats(worker), json.dumps({**STATS, **changes, "worker_id": worker}))

    return publish


def test_the_dashboard_is_for_staff_only(client, admin_client, django_user_model):
    assert client.get("/admin/scheduler/").status_code == 302
    django_user_model.objects.create_user("bob", password="pw-pw-pw-1")
    client.login(username="bob", password="pw-pw-pw-1")
    response = client.get("/admin/scheduler/")
    assert response.status_code == 302 and "/admin/login/" in response["Location"]
    assert client.get("/admin/scheduler/data").status_code == 302
    page = admin_client.get("/admin/scheduler/")
    assert page.status_code == 200
    assert b"m-kv_pressure" in page.content and b"uPlot" in page.content
    assert b"Scheduler dashboard" in admin_client.get("/admin/").content


def test_the_data_sums_the_live_workers_and_returns_the_history(admin_client, published):
    published("w1")
    published("w2", num_active=1, kv_pressure=0.75, kv_blocks_held=30, kv_blocks_free=10)
    StatsSnapshot.objects.create(taken_at=timezone.now() - timedelta(minutes=5), num_active=4)
    StatsSnapshot.objects.create(taken_at=timezone.now() - timedelta(hours=2), num_active=9)
    data = admin_client.get("/admin/scheduler/data").json()
    live = data["live"]
    assert live["workers"] == 2
    # Blocks held over blocks in all pools: (10 + 30) / (40 + 40).
    assert live["totals"]["num_active"] == 4 and live["totals"]["kv_pressure"] == 0.5
    assert live["totals"]["kv_admit_blocked"] == 14
    assert live["per_key"]["acme"]["in_flight"] == 4
    assert [p["num_active"] for p in data["history"]] == [4]  # the last hour only
    newer = admin_client.get(f"/admin/scheduler/data?since={data['history'][0]['t']}").json()
    assert newer["history"] == []


def test_snapshots_record_the_generation_rate(published, settings):
    published("w1", tokens_generated=500)
    first = StatsSnapshot.objects.get(pk=tasks.snapshot_stats())
    earlier = first.taken_at - timedelta(seconds=10)
    StatsSnapshot.objects.filter(pk=first.pk).update(taken_at=earlier)
    published("w1", tokens_generated=800)
    second = StatsSnapshot.objects.get(pk=tasks.snapshot_stats())
    assert second.num_active == 3 and second.per_key["acme"]["completion_tokens_served"] == 30
    assert second.tokens_per_s == pytest.approx(30, rel=0.05)


def test_the_rate_survives_worker_restarts_and_new_workers():
    before = {"a": {"tokens_generated": 100}, "b": {"tokens_generated": 900}}
    after = {"a": {"tokens_generated": 160, "uptime_s": 500},
             "b": {"tokens_generated": 40, "uptime_s": 3},  # restarted
             "c": {"tokens_generated": 20, "uptime_s": 2},  # started in the interval
             "d": {"tokens_generated": 999, "uptime_s": 900}}  # history unknown
    assert tokens_rate(before, after, 10) == pytest.approx((60 + 40 + 20) / 10)


def test_cleanup_deletes_old_snapshots_and_orphaned_event_streams(rclient, keys):
    StatsSnapshot.objects.create(taken_at=timezone.now() - timedelta(days=2))
    kept = StatsSnapshot.objects.create(taken_at=timezone.now())
    old_ms = int((time.time() - 3600) * 1000)
    rclient.xadd(keys.events("lost"), {"data": "{}"}, id=f"{old_ms}-0")  # no expiry, old
    rclient.xadd(keys.events("recent"), {"data": "{}"})  # no expiry yet, new
    rclient.xadd(keys.events("live"), {"data": "{}"}, id=f"{old_ms}-0")
    rclient.expire(keys.events("live"), 600)

    result = tasks.cleanup()

    assert list(StatsSnapshot.objects.all()) == [kept]
    assert result == {"snapshots": 1, "event_streams": 1}
    assert not rclient.exists(keys.events("lost"))
    assert rclient.exists(keys.events("recent")) and rclient.exists(keys.events("live"))


def test_metrics_need_staff_or_an_operator_key(client, admin_client, make_tenant, settings):
    assert client.get("/metrics").status_code == 401
    _, _, plain = make_tenant()
    # A valid key that may not read them: 403, as /scheduler/stats answers it.
    for path in ("/metrics", "/scheduler/stats"):
        assert client.get(path, HTTP_AUTHORIZATION=f"Bearer {plain}").status_code == 403
    _, _, operator = make_tenant(operator_key=True)
    assert client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {operator}").status_code == 200
    settings.DASHBOARD = {**settings.DASHBOARD, "METRICS_TOKEN": "scrape-me"}
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer scrape-me").status_code == 200
    assert admin_client.get("/metrics").status_code == 200


def test_metrics_expose_queues_gates_tokens_and_latencies(admin_client, published, tenant_key,
                                                           rclient):
    from prometheus_client.parser import text_string_to_metric_families

    published("w1")
    tenant, key, _ = tenant_key
    UsageRecord.objects.create(request_id="r1", tenant=tenant, api_key=key, model="m",
                               prompt_tokens=10, cached_prompt_tokens=4, completion_tokens=21,
                               ttft_s=0.3, duration_s=2.3, finish_reason="stop", status=200)
    from dashboard.recorder import refused_key

    rclient.hincrby(refused_key(), "queue_full", 2)
    response = admin_client.get("/metrics")
    assert response["Content-Type"].startswith("text/plain")
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(response.content.decode())
               for s in family.samples}
    t = tenant.slug
    assert samples[("llm_scheduler_queue_requests", (("queue", "active"), ("worker", "w1")))] == 3
    assert samples[("llm_kv_pressure", (("worker", "w1"),))] == 0.25
    assert samples[("llm_admissions_blocked_total", (("gate", "2"), ("worker", "w1")))] == 5
    assert samples[("llm_admissions_rejected_total", (("gate", "2"), ("worker", "w1")))] == 1
    assert samples[("llm_admissions_rejected_total", (("gate", "1"), ("worker", "web")))] == 2
    assert samples[("llm_prompt_tokens_total", (("tenant", t),))] == 10
    assert samples[("llm_generation_tokens_total", (("tenant", t),))] == 21
    assert samples[("llm_time_to_first_token_seconds_bucket", (("le", "0.25"), ("tenant", t)))] == 0
    assert samples[("llm_time_to_first_token_seconds_bucket", (("le", "0.5"), ("tenant", t)))] == 1
    assert samples[("llm_e2e_request_latency_seconds_count", (("tenant", t),))] == 1
    assert samples[("llm_inter_token_latency_seconds_sum", (("tenant", t),))] == \
        pytest.approx(0.1)


def test_metrics_count_the_tokens_charged_batch_work_apart(admin_client, tenant_key):
    from prometheus_client.parser import text_string_to_metric_families

    tenant, key, _ = tenant_key
    UsageRecord.objects.create(request_id="i1", tenant=tenant, api_key=key, model="m",
                               prompt_tokens=10, completion_tokens=5)  # charged in full
    UsageRecord.objects.create(request_id="b1", tenant=tenant, api_key=key, model="m",
                               prompt_tokens=10, completion_tokens=5, billed_tokens=8,
                               batch_id="batch_1")
    samples = {(s.name, s.labels["service_class"]): s.value
               for family in text_string_to_metric_families(
                   admin_client.get("/metrics").content.decode())
               for s in family.samples if s.name == "llm_billed_tokens_total"
               and s.labels["tenant"] == tenant.slug}
    assert samples == {("llm_billed_tokens_total", "interactive"): 15,
                       ("llm_billed_tokens_total", "batch"): 8}


def test_a_refused_rest_request_is_counted_in_the_metrics(admin_client, client, tenant_key):
    from prometheus_client.parser import text_string_to_metric_families

    _, _, raw = tenant_key
    # No worker is alive: the REST API answers 503 before anything is queued.
    response = client.post("/v1/chat/completions", content_type="application/json",
                           HTTP_AUTHORIZATION=f"Bearer {raw}",
                           data={"model": "SmolLM2-135M-Instruct",
                                 "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 503
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(
                   admin_client.get("/metrics").content.decode())
               for s in family.samples}
    assert samples[("llm_requests_refused_total", (("code", "no_worker_available"),))] == 1


ADAPTERS = {"loaded": ["m:support", "m:legal"], "loaded_keys": ["a" * 64, "b" * 64],
            "capacity": 8, "loading": 1, "loads": 5, "load_failures": 1, "evictions": 3,
            "last_load_s": 0.4, "load_s_total": 2.0, "build_s_total": 0.2, "num_parked": 2,
            "running": {"m:support": 3}}


def test_the_dashboard_and_the_metrics_show_the_lora_adapters(admin_client, published,
                                                              tenant_key):
    from prometheus_client.parser import text_string_to_metric_families

    published("w1", adapters=ADAPTERS)
    # w2 holds two tenants' adapters named m:support (names are per tenant).
    published("w2", adapters={**ADAPTERS, "loaded": ["m:support", "m:support"],
                              "loaded_keys": ["c" * 64, "d" * 64], "running": {}})
    live = admin_client.get("/admin/scheduler/data").json()["live"]
    assert live["per_adapter"] == {"m:legal": {"workers": 1, "running": 0},
                                   "m:support": {"workers": 2, "running": 3}}
    assert b'id="per-adapter"' in admin_client.get("/admin/scheduler/").content
    tenant, key, _ = tenant_key
    for i, adapter in enumerate(("m:support", "m:support", "")):
        UsageRecord.objects.create(request_id=f"a{i}", tenant=tenant, api_key=key, model="m",
                                   adapter=adapter, prompt_tokens=10, completion_tokens=4,
                                   status=200)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(
                   admin_client.get("/metrics").content.decode())
               for s in family.samples}
    assert samples[("llm_adapter_loaded", (("adapter", "m:legal"), ("worker", "w1")))] == 1
    assert ("llm_adapter_loaded", (("adapter", "m:legal"), ("worker", "w2"))) not in samples
    assert samples[("llm_adapter_loaded", (("adapter", "m:support"), ("worker", "w2")))] == 2
    assert samples[("llm_adapter_running_rows",
                    (("adapter", "m:support"), ("worker", "w1")))] == 3
    assert samples[("llm_adapter_parked_requests", (("worker", "w1"),))] == 2
    assert samples[("llm_adapter_evictions_total", (("worker", "w1"),))] == 3
    assert samples[("llm_adapter_load_failures_total", (("worker", "w2"),))] == 1
    assert samples[("llm_adapter_generation_tokens_total", (("adapter", "m:support"),))] == 8
    assert samples[("llm_adapter_requests_total",
                    (("adapter", "m:support"), ("status", "200")))] == 2
    assert samples[("llm_model_requests_total", (("model", "m"), ("status", "200")))] == 3
