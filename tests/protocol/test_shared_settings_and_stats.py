"""What both tiers must agree on: the settings they share, and one aggregation of the workers."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import uuid

import pytest

from gateway import admission
from gateway.admission import Principal
from gateway.workers import FIELD_RULES, PER_KEY_RULES, PER_WORKER_ONLY, RATIOS, aggregate
from inference.protocol.messages import RequestMessage
from inference.protocol.settings import PlatformSettings
from inference.worker.bridge import WorkerBridge
from tests.api.test_api import chat, error_of, post
from tests.support.engine import make_engine
from tests.support.platform import InProcessWorker

pytestmark = pytest.mark.django_db

def test_a_request_waiting_in_a_workers_pending_queue_ends_at_the_deadline(
        client, tenant_key, redis_prefix, settings):
    """MAX_QUEUE_WAIT_S counts from the web tier's acceptance, also inside a worker."""
    settings.LLM_PLATFORM = {**settings.LLM_PLATFORM, "MAX_QUEUE_WAIT_S": 0.6}
    # One row, busy for seconds; the second request is taken into the worker's pending queue.
    worker = InProcessWorker(redis_prefix, settings.REDIS_URL, prefetch=2, max_model_len=4096,
                             max_batch_size=1, reference_step_delay_s=0.01).start()
    try:
        busy = RequestMessage(request_id=uuid.uuid4().hex, tenant="t", fairness_key="t",
                              prompt="busy", sampling={"max_tokens": 300, "ignore_eos": True})
        asyncio.run(admission.admit(Principal.for_api_key(tenant_key[1]), busy, 310))
        started = time.monotonic()
        late = post(client, tenant_key[2], chat(max_tokens=4))
        waited = time.monotonic() - started
    finally:
        worker.stop()
    assert late.status_code == 503
    assert error_of(late)["code"] == "queue_timeout"
    assert 0.5 < waited < 3, "ended by its deadline, not by the long request finishing"
    assert worker.engine.stats()["requests_finished"]["error"] >= 1


def test_the_web_tier_and_the_worker_read_one_default_for_each_shared_setting(monkeypatch):
    for name in PlatformSettings.model_fields:
        monkeypatch.delenv(name.upper(), raising=False)
    code = ("import json, django; django.setup(); from django.conf import settings; "
            "print(json.dumps({k: settings.LLM_PLATFORM[k] for k in ('REDIS_PREFIX', "
            "'MAX_QUEUE_SIZE', 'MAX_QUEUE_WAIT_S', 'WORKER_HEARTBEAT_TTL_S')}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={"DJANGO_SETTINGS_MODULE": "llm_platform.settings",
                                          "PATH": "/usr/bin:/bin"})
    web = json.loads(out.stdout.strip().splitlines()[-1])
    from inference.worker.settings import WorkerSettings

    worker = WorkerSettings()
    assert web == {"REDIS_PREFIX": worker.redis_prefix, "MAX_QUEUE_SIZE": worker.max_queue_size,
                   "MAX_QUEUE_WAIT_S": worker.max_queue_wait_s,
                   "WORKER_HEARTBEAT_TTL_S": worker.worker_heartbeat_ttl_s}
    assert worker.max_queue_wait_s > 0, "a request has an admission deadline by default"


def published_snapshot(bridge: WorkerBridge, rclient, keys) -> dict:
    bridge.publish_stats(60)
    return json.loads(rclient.get(keys.stats(bridge.worker_id)))


def test_every_field_of_a_workers_snapshot_has_an_aggregation_rule(rclient, keys):
    bridge = WorkerBridge(make_engine(), rclient, keys, "w-rules", prefetch=4)
    snapshot = published_snapshot(bridge, rclient, keys)
    unruled = (set(snapshot) - set(FIELD_RULES) - set(RATIOS) - PER_WORKER_ONLY
               - {"per_key", "worker_id"})
    assert not unruled, f"fields the aggregate would drop: {sorted(unruled)}"
    engine = bridge.engine
    engine.submit(prompt_token_ids=[1, 2, 3], tenant="acme")
    engine.step()
    [row] = engine.stats()["per_key"].values()
    assert set(row) == set(PER_KEY_RULES)


def test_scheduler_stats_aggregate_two_workers_field_by_field(admin_client, rclient, keys):
    snapshots = []
    for name, blocks in (("w-a", 256), ("w-b", 128)):
        engine = make_engine(kv_num_blocks=blocks)
        engine.submit(prompt_token_ids=list(range(1, 40)), tenant="acme")
        engine.step()
        snapshots.append(published_snapshot(
            WorkerBridge(engine, rclient, keys, name, prefetch=4), rclient, keys))
        rclient.zadd(keys.workers, {name: time.time()})
    total = admin_client.get("/scheduler/stats").json()["total"]
    a, b = snapshots
    assert total["workers"] == 2
    assert total["max_model_len"] == a["max_model_len"] == 8192  # not 16384
    assert total["max_batch_size"] == a["max_batch_size"]  # a setting, not summed
    assert abs(total["published_at"] - time.time()) < 60  # a time, not a sum of two
    assert total["num_active"] + total["num_prefilling"] == 2
    assert total["kv_blocks_total"] == 384
    assert total["kv_blocks_held"] == a["kv_blocks_held"] + b["kv_blocks_held"]
    assert total["kv_pressure"] == pytest.approx(total["kv_blocks_held"] / 384)
    assert total["per_key"]["acme"]["in_flight"] == 2
    assert total["admissions_soft_held"] == {"1": 0, "2": 0, "3": 0}
    dashboard = admin_client.get("/admin/scheduler/data").json()["live"]["totals"]
    for name in ("num_active", "kv_blocks_total", "kv_pressure", "tokens_generated"):
        assert dashboard[name] == total[name], name


def test_workers_that_differ_in_a_setting_show_no_common_value():
    total = aggregate([{"policy": "vtc", "max_batch_size": 32},
                       {"policy": "fcfs", "max_batch_size": 32}])
    assert total["policy"] is None and total["max_batch_size"] == 32
