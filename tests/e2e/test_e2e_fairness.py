"""Fairness with the platform's real processes: a light tenant does not wait behind a heavy
tenant's backlog in the shared queue (daphne, one worker on the reference backend, Celery)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.support.e2e import MODEL, client, start_stack, stats, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROWS = 4


@pytest.fixture(scope="module")
def stack(request, django_db_setup, django_db_blocker, tmp_path_factory):
    return start_stack(request, django_db_blocker, tmp_path_factory, workers=1,
                       REFERENCE_STEP_DELAY_S=0.02, MAX_BATCH_SIZE=ROWS, MAX_QUEUE_SIZE=200)


def test_a_light_tenant_is_served_before_a_heavy_tenants_earlier_backlog(stack, make_tenant,
                                                                         transactional_db):
    heavy = client(stack, make_tenant()[2])
    light = client(stack, make_tenant()[2])
    operator = make_tenant(operator_key=True)[2]
    ended: dict[str, float] = {}

    def ask(who, name: str, tokens: int) -> None:
        heavy_or_light = who.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": name}], max_tokens=tokens,
            temperature=0, extra_body={"ignore_eos": True})
        assert heavy_or_light.usage.completion_tokens == tokens
        ended[name] = time.monotonic()

    backlog = [f"heavy {i}" for i in range(40)]
    with ThreadPoolExecutor(len(backlog) + 1) as pool:
        running = [pool.submit(ask, heavy, name, 24) for name in backlog]
        # The rows are full and a backlog waits in the shared queue: under FCFS the light request
        # would wait for all of it (at least 20 requests, 5 rounds of rows). How much of the 40
        # waits at once depends on how fast the clients' requests reach the queue against how
        # fast the worker drains it, so only what ends after the light request counts below.
        assert wait_for(lambda: stats(stack, operator)["queue"]["waiting"] >= 20, 60)
        asked = time.monotonic()
        late = pool.submit(ask, light, "light", 8)
        late.result(120)
        for future in running:
            future.result(120)
    before_light = sum(asked < t < ended["light"] for name, t in ended.items() if name != "light")
    # The light request waited for a row to free up, not for the backlog queued before it.
    assert before_light <= 2 * ROWS, before_light
