"""Client disconnects abort the request in the worker promptly, mid-prefill and mid-stream.

The worker runs the reference backend at a model-like pace (each forward pass takes
``STEP_S``), so "promptly" can be told apart from "ran on to the end".
"""

from __future__ import annotations

import httpx
import pytest

from tenants.models import UsageRecord
from tests.support.e2e import MODEL, start_stack, stats, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STEP_S = 0.05
CHUNK = 8


@pytest.fixture(scope="module")
def stack(request, django_db_setup, django_db_blocker, tmp_path_factory):
    return start_stack(request, django_db_blocker, tmp_path_factory, workers=1,
                       REFERENCE_STEP_DELAY_S=STEP_S, PREFILL_CHUNK_SIZE=CHUNK)


def post_stream(stack, raw_key, content, max_tokens, read_timeout):
    return httpx.stream(
        "POST", f"{stack.url}/v1/chat/completions",
        timeout=httpx.Timeout(30, read=read_timeout),
        headers={"Authorization": f"Bearer {raw_key}"},
        json={"model": MODEL, "messages": [{"role": "user", "content": content}],
              "max_tokens": max_tokens, "stream": True})


def test_a_disconnect_mid_prefill_aborts_before_any_token(stack, make_tenant,
                                                          transactional_db):
    tenant, _, raw = make_tenant()
    operator = make_tenant(operator_key=True)[2]
    prompt = "x" * 2400  # 2,400 byte tokens: 300 chunks, about 15 s of prefill
    with pytest.raises(httpx.ReadTimeout), post_stream(stack, raw, prompt, 50, read_timeout=1.0):
        pass  # the status is decided only at the first token: no headers before the timeout
    record = wait_for(lambda: UsageRecord.objects.filter(tenant=tenant).first(), 10)
    assert record is not None and record.finish_reason == "abort"
    assert record.completion_tokens == 0
    assert record.duration_s < 4, "the prefill was not cut short"
    assert wait_for(lambda: stats(stack, operator)["total"]["active_kv_reserved"] == 0, 5)


def test_a_disconnect_mid_stream_stops_generation_within_a_few_ticks(stack, make_tenant,
                                                                     transactional_db):
    tenant, _, raw = make_tenant()
    received = 0
    with post_stream(stack, raw, "tell me a long story", 2000, read_timeout=10) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {") and '"content"' in line:
                received += 1
                if received == 10:
                    break
    record = wait_for(lambda: UsageRecord.objects.filter(tenant=tenant).first(), 10)
    assert record is not None and record.finish_reason == "abort" and record.status == 499
    # Billed the tokens it was sent (the first chunk, the role, holds none): those it read and
    # those sent before its leaving was seen, a handful of ticks; not the 2,000 asked for.
    tokens = received - 1
    assert tokens <= record.completion_tokens <= tokens + 10
