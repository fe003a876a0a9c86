"""OpenAI's ``x-ratelimit-*`` headers tell what the rate limiter holds, through the REST API.

Requests go through the whole web tier to an in-process worker (reference backend); the numbers
are the admission script's own: they move by one request, and by the request's reserved tokens,
per admitted request, and a refused request (429) reports the window that is full.
"""

from __future__ import annotations

import asyncio
import re
import uuid

import pytest

from gateway import admission
from gateway.admission import Principal
from gateway.ratelimits import WindowUse, duration, headers
from inference.protocol.messages import RequestMessage
from tenants.services import create_api_key
from tests.api.test_api import chat, post, post_stream
from tests.support.platform import InProcessWorker

pytestmark = pytest.mark.django_db

NAMES = [f"x-ratelimit-{what}-{kind}" for kind in ("requests", "tokens")
         for what in ("limit", "remaining", "reset")]


def limits_of(response) -> dict[str, str]:
    return {name: response[name] for name in NAMES if response.has_header(name)}


def ms(text: str) -> float:
    """A duration in OpenAI's format (``1m30.5s``, ``250ms``), in milliseconds."""
    assert re.fullmatch(r"(\d+h)?(\d+m)?(\d+(\.\d+)?s)?|\d+ms", text) and text, text
    if text.endswith("ms"):
        return float(text[:-2])
    total = 0.0
    for value, unit in re.findall(r"(\d+(?:\.\d+)?)([hms])", text):
        total += float(value) * {"h": 3_600_000, "m": 60_000, "s": 1000}[unit]
    return total




def test_the_numbers_move_as_requests_are_admitted(client, make_tenant, inproc_worker):
    _, _, raw = make_tenant(requests_per_minute=4, tokens_per_minute=100_000)
    seen = []
    for _ in range(3):
        response = post(client, raw, chat(max_tokens=3, temperature=0))
        assert response.status_code == 200
        seen.append(limits_of(response))
    assert [s["x-ratelimit-limit-requests"] for s in seen] == ["4"] * 3
    assert [s["x-ratelimit-remaining-requests"] for s in seen] == ["3", "2", "1"]
    assert [s["x-ratelimit-limit-tokens"] for s in seen] == ["100000"] * 3
    # Each request reserves its prompt and max_tokens: the same amount each time.
    tokens = [100_000] + [int(s["x-ratelimit-remaining-tokens"]) for s in seen]
    costs = {before - after for before, after in zip(tokens, tokens[1:], strict=False)}
    assert len(costs) == 1 and costs.pop() >= 3
    # Just admitted: the window holds this request for a whole minute more.
    assert {s["x-ratelimit-reset-requests"] for s in seen} == {"1m0s"}
    assert {s["x-ratelimit-reset-tokens"] for s in seen} == {"1m0s"}

    response, content = post_stream(raw, chat(max_tokens=3, stream=True))
    assert response.status_code == 200 and content.endswith(b"data: [DONE]\n\n")
    assert limits_of(response)["x-ratelimit-remaining-requests"] == "0"

    refused = post(client, raw, chat())
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limit_exceeded"
    figures = limits_of(refused)
    assert figures["x-ratelimit-limit-requests"] == "4"
    assert figures["x-ratelimit-remaining-requests"] == "0"
    assert 0 < ms(figures["x-ratelimit-reset-requests"]) <= 60_000
    # The refused request consumed nothing.
    assert int(figures["x-ratelimit-remaining-tokens"]) == tokens[-1] - (tokens[0] - tokens[1])


def test_the_tighter_of_the_key_and_the_tenant_window_is_told(client, make_tenant,
                                                               inproc_worker):
    tenant, key_a, raw_a = make_tenant(requests_per_minute=4)
    key_a.requests_per_minute = 3
    key_a.save()
    _, raw_b = create_api_key(tenant, "second")

    def requests(raw: str) -> tuple[str, str]:
        response = post(client, raw, chat(max_tokens=1))
        assert response.status_code == 200
        return (response["x-ratelimit-limit-requests"],
                response["x-ratelimit-remaining-requests"])

    assert requests(raw_a) == ("3", "2")  # key a: 2 left; the tenant: 3
    assert requests(raw_b) == ("4", "2")  # key b has no limit of its own: the tenant's
    assert requests(raw_a) == ("3", "1")  # key a: 1 left; the tenant: 1, a tie: the key's
    assert requests(raw_b) == ("4", "0")
    refused = post(client, raw_a, chat(max_tokens=1))
    assert refused.status_code == 429
    assert refused["x-ratelimit-limit-requests"] == "4"  # the tenant's window is full
    assert refused["x-ratelimit-remaining-requests"] == "0"
    assert "x-ratelimit-limit-tokens" not in refused


def test_no_limit_no_headers(client, make_tenant, inproc_worker):
    _, _, unlimited = make_tenant()
    response = post(client, unlimited, chat(max_tokens=1))
    assert response.status_code == 200 and limits_of(response) == {}
    response, _ = post_stream(unlimited, chat(max_tokens=1, stream=True))
    assert response.status_code == 200 and limits_of(response) == {}

    _, _, tokens_only = make_tenant(tokens_per_minute=10_000)
    response = post(client, tokens_only, chat(max_tokens=1))
    assert set(limits_of(response)) == {n for n in NAMES if n.endswith("-tokens")}


def test_a_refusal_by_another_limit_tells_the_windows_too(client, make_tenant, live_worker):
    tenant, key, raw = make_tenant(requests_per_minute=10, max_concurrent_requests=1)
    in_flight = RequestMessage(request_id=uuid.uuid4().hex, tenant=tenant.slug,
                               fairness_key=tenant.slug, prompt="hi")
    asyncio.run(admission.admit(Principal.for_api_key(key), in_flight, 5))
    refused = post(client, raw, chat())
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "concurrency_limit_exceeded"
    assert refused["x-ratelimit-remaining-requests"] == "9"
    assert 0 < ms(refused["x-ratelimit-reset-requests"]) <= 60_000


@pytest.fixture
def small_kv_worker(redis_prefix, settings):
    """An in-process worker whose active-KV budget (gate 2) is 64 tokens of a 256 context."""
    worker = InProcessWorker(redis_prefix, settings.REDIS_URL, max_model_len=256,
                             max_batch_size=4, active_kv_budget=64).start()
    yield worker
    worker.stop()


@pytest.mark.parametrize("streaming", [False, True])
def test_an_admitted_request_refused_by_the_worker_tells_its_windows(client, make_tenant,
                                                                     small_kv_worker, streaming):
    _, _, raw = make_tenant(requests_per_minute=10)
    body = chat(max_tokens=100, stream=streaming)  # fits the context, never gate 2's budget
    response = post(client, raw, body)
    assert response.status_code == 429 and not response.streaming
    assert response.json()["error"]["code"] == "kv_budget_exceeded"
    assert response["x-ratelimit-remaining-requests"] == "9"


@pytest.mark.parametrize(("ms_", "text"), [
    (0, "0s"), (1, "1ms"), (250, "250ms"), (999, "999ms"), (1000, "1s"), (1500, "1.5s"),
    (59_999, "59.999s"), (60_000, "1m0s"), (90_500, "1m30.5s"), (360_000, "6m0s"),
    (3_600_000, "1h0m0s"), (3_723_004, "1h2m3.004s"), (-5, "0s"),
])
def test_durations_are_written_as_openai_writes_them(ms_, text):
    assert duration(ms_) == text
    assert ms(text) == max(ms_, 0)


def test_ties_go_to_the_window_that_resets_last():
    early = WindowUse(kind="requests", limit=10, used=10, reset_ms=1000)
    late = WindowUse(kind="requests", limit=5, used=5, reset_ms=30_000)
    assert headers([early, late])["x-ratelimit-reset-requests"] == "30s"
    assert headers([late, early])["x-ratelimit-limit-requests"] == "5"
