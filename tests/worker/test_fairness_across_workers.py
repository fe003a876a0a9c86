"""Fairness through the platform: the tenant order holds in the shared queue, across workers.

Requests go through the web tier's admission (tenants, tiers and weights from the database) into
the shared queue, and two in-process workers (reference backend) serve them.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest

from gateway import admission
from gateway.admission import Principal
from inference.protocol.messages import RequestMessage
from tests.support.e2e import wait_for
from tests.support.platform import InProcessWorker

pytestmark = [pytest.mark.django_db, pytest.mark.slow]

PROMPT = "x" * 20  # 20 prompt tokens on the reference backend's byte tokenizer
MAX_TOKENS = 20


def admit(key, n: int, max_tokens: int = MAX_TOKENS) -> list[RequestMessage]:
    """Admit ``n`` requests of ``key`` as the REST API does (tier and weight from its tenant)."""
    tenant = key.tenant

    async def all_of_them() -> list[RequestMessage]:
        out = []
        for _ in range(n):
            message = RequestMessage(
                request_id=uuid.uuid4().hex, tenant=tenant.slug, fairness_key=tenant.slug,
                priority=tenant.tier.priority, fairness_weight=tenant.fairness_weight,
                prompt=PROMPT, sampling={"max_tokens": max_tokens, "ignore_eos": True})
            out.append(await admission.admit(Principal.for_api_key(key), message, 40))
        return out

    return asyncio.run(all_of_them())


def start_workers(redis_prefix: str, redis_url: str, n: int, **engine) -> list[InProcessWorker]:
    return [InProcessWorker(redis_prefix, redis_url, worker_id=f"w{i}",
                            scheduling_policy=engine.pop("policy", "vtc"), max_model_len=256,
                            max_batch_size=4, **engine).start() for i in range(n)]


def service(workers: list[InProcessWorker], tenant: str) -> float:
    """Weighted service (``w_in`` x computed prompt + ``w_out`` x generated, / weight) a tenant
    received from every worker."""
    return sum(w.engine.stats()["per_key"].get(tenant, {}).get("weighted_service", 0.0)
               for w in workers)


def test_weighted_fairness_holds_across_two_workers(make_tenant, live_worker, redis_prefix,
                                                    settings):
    settings.LLM_PLATFORM = {**settings.LLM_PLATFORM, "MAX_QUEUE_SIZE": 1000}
    light, light_key, _ = make_tenant(fairness_weight=1.0)
    heavy, heavy_key, _ = make_tenant(fairness_weight=2.0)
    # Both backlogged throughout: more than the window needs.
    admit(light_key, 150)
    admit(heavy_key, 300)
    workers = start_workers(redis_prefix, settings.REDIS_URL, 2)
    try:
        assert wait_for(lambda: min(service(workers, light.slug),
                                    service(workers, heavy.slug)) >= 5000, 120, every_s=0.02)
        a, b = service(workers, light.slug), service(workers, heavy.slug)
    finally:
        for w in workers:
            w.stop()
    # Weight 2 got about twice the tokens, so the same weighted service: within 10 %.
    assert abs(a - b) <= 0.1 * max(a, b), (a, b)


def test_a_light_tenant_is_served_before_a_heavy_tenants_earlier_backlog(
        make_tenant, live_worker, redis_prefix, settings):
    _, heavy_key, _ = make_tenant()
    light, light_key, _ = make_tenant()
    backlog = admit(heavy_key, 60)
    workers = start_workers(redis_prefix, settings.REDIS_URL, 1, reference_step_delay_s=0.002)
    [worker] = workers
    try:
        assert wait_for(lambda: len(worker.usage) >= 4, 30, every_s=0.01)
        [late] = admit(light_key, 1, max_tokens=4)
        assert wait_for(lambda: any(u.request_id == late.request_id for u in worker.usage), 30,
                        every_s=0.01)
        done_before = [u.request_id for u in worker.usage]
    finally:
        worker.stop()
    finished_heavy = [rid for rid in done_before if rid != late.request_id]
    # It waited for rows to free up, not for the 60-request backlog ahead of it in the queue.
    assert len(finished_heavy) < 20, len(finished_heavy)
    assert {m.request_id for m in backlog} >= set(finished_heavy)
