"""The REST API in-process: auth, validation, error bodies, response shapes (reference backend)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from asgiref.sync import async_to_sync
from django.test import AsyncClient

from tenants.models import PriorityTier
from tenants.services import revoke_api_key

pytestmark = pytest.mark.django_db

MODEL = "SmolLM2-135M-Instruct"
CHAT = "/v1/chat/completions"


def post(client, raw_key: str | None, body, path: str = CHAT):
    headers = {"HTTP_AUTHORIZATION": f"Bearer {raw_key}"} if raw_key else {}
    data = body if isinstance(body, str) else json.dumps(body)
    return client.post(path, data, content_type="application/json", **headers)


def chat(max_tokens: int = 4, **extra):
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}],
            "max_tokens": max_tokens, **extra}


def error_of(response) -> dict:
    body = response.json()
    assert set(body["error"]) >= {"message", "type", "param", "code"}
    return body["error"]


@pytest.mark.parametrize("auth", [None, "sk-wrong", "revoked"])
def test_missing_wrong_or_revoked_key_gets_401(client, tenant_key, auth):
    _, key, raw = tenant_key
    if auth == "revoked":
        revoke_api_key(key)
        auth = raw
    response = post(client, auth, chat())
    assert response.status_code == 401
    assert error_of(response)["code"] in ("missing_api_key", "invalid_api_key")


@pytest.mark.parametrize(("body", "param"), [
    ("{not json", None),
    ("[1, 2]", None),
    (chat(max_tokens=0), "max_tokens"),
    ({**chat(), "messages": []}, "messages"),
    ({"model": MODEL}, "messages"),
    (chat(tools=[{"type": "function", "function": {"name": "not a name"}}]),
     "tools[0].function.name"),
    (chat(response_format={"type": "xml"}), "response_format.type"),
    (chat(structured_outputs={"regex": "[a-z"}), "structured_outputs.regex"),
    (chat(logit_bias={"1": 2}), "logit_bias"),
    (chat(n=99), "n"),
    (chat(max_completion_tokens=9), "max_completion_tokens"),  # chat() gives max_tokens 4
    (chat(temperature=-1), "temperature"),
])
def test_bad_input_gets_400_naming_the_field(client, tenant_key, body, param):
    response = post(client, tenant_key[2], body)
    assert response.status_code == 400
    error = error_of(response)
    assert error["type"] == "invalid_request_error" and error["param"] == param


def test_unknown_fields_are_refused_and_neutral_ones_accepted(client, tenant_key, inproc_worker):
    body = chat(logprobs=False, response_format={"type": "text"}, user="u1")
    assert post(client, tenant_key[2], body).status_code == 200
    response = post(client, tenant_key[2], {**body, "some_future_field": 1})
    assert response.status_code == 400 and error_of(response)["param"] == "some_future_field"


def test_another_model_gets_404(client, tenant_key):
    response = post(client, tenant_key[2], {**chat(), "model": "gpt-4o"})
    assert response.status_code == 404
    assert error_of(response)["code"] == "model_not_found"


def test_no_worker_gets_503(client, tenant_key):
    response = post(client, tenant_key[2], chat())
    assert response.status_code == 503


def test_chat_completion_shape_and_usage(client, tenant_key, inproc_worker):
    response = post(client, tenant_key[2], chat(max_tokens=5, temperature=0))
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    [choice] = body["choices"]
    assert choice["finish_reason"] == "length" and choice["message"]["role"] == "assistant"
    usage = body["usage"]
    assert usage["completion_tokens"] == 5
    assert usage["total_tokens"] == usage["prompt_tokens"] + 5
    assert "cached_tokens" in usage["prompt_tokens_details"]


def test_text_completion_and_max_completion_tokens(client, tenant_key, inproc_worker):
    response = post(client, tenant_key[2], {"model": MODEL, "prompt": "Once", "max_tokens": 3},
                    path="/v1/completions")
    assert response.status_code == 200
    assert response.json()["object"] == "text_completion"
    assert response.json()["usage"]["completion_tokens"] == 3
    body = {**chat(), "max_completion_tokens": 2}
    del body["max_tokens"]
    assert post(client, tenant_key[2], body).json()["usage"]["completion_tokens"] == 2


def test_omitted_max_tokens_is_what_is_left_of_the_context(client, tenant_key, inproc_worker):
    # Greedy, so the answer cannot end early on a sampled EOS (the reference backend's EOS has
    # a small but nonzero probability at temperature 1).
    body = chat(temperature=0)
    del body["max_tokens"]
    response = post(client, tenant_key[2], body).json()
    usage = response["usage"]
    # The in-process worker's context is 256 tokens (below DEFAULT_MAX_TOKENS).
    assert response["choices"][0]["finish_reason"] == "length"
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 256


def test_prompt_beyond_the_context_gets_400_with_both_numbers(client, tenant_key,
                                                              inproc_worker):
    response = post(client, tenant_key[2], chat(max_tokens=250))
    assert response.status_code == 400
    error = error_of(response)
    assert error["code"] == "context_length_exceeded"
    assert "250" in error["message"] and "256" in error["message"]


def test_refused_stream_gets_its_real_status(client, tenant_key, inproc_worker):
    response = post(client, tenant_key[2], chat(max_tokens=250, stream=True))
    assert response.status_code == 400 and not response.streaming


def post_stream(raw_key: str, body: dict):
    """POST with the async client and read the whole event stream in the same event loop."""

    async def go():
        response = await AsyncClient().post(CHAT, json.dumps(body), content_type="application/json",
                                            headers={"Authorization": f"Bearer {raw_key}"})
        content = b"".join([part async for part in response.streaming_content])
        return response, content

    return async_to_sync(go)()


def read_sse(content: bytes) -> list:
    text = content.decode()
    frames = [f for f in text.split("\n\n") if f.strip()]
    assert all(f.startswith("data: ") for f in frames)
    return [f.removeprefix("data: ") for f in frames]


def test_stream_framing_with_usage(client, tenant_key, inproc_worker):
    response, content = post_stream(
        tenant_key[2], chat(max_tokens=4, stream=True, stream_options={"include_usage": True}))
    assert response.status_code == 200 and response["Content-Type"] == "text/event-stream"
    frames = read_sse(content)
    assert frames[-1] == "[DONE]" and frames.count("[DONE]") == 1
    chunks = [json.loads(f) for f in frames[:-1]]
    assert len({c["id"] for c in chunks}) == 1
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "length" and finishes[:-1] == [None] * (len(finishes) - 1)
    usage_chunks = [c for c in chunks if not c["choices"]]
    assert len(usage_chunks) == 1 and chunks[-1] is usage_chunks[0]
    assert usage_chunks[0]["usage"]["completion_tokens"] == 4
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    plain = post(client, tenant_key[2], chat(max_tokens=4, temperature=0)).json()
    assert len(text) > 0 and plain["choices"][0]["message"]["content"]


def test_priority_tier_change_takes_effect_on_the_next_request(client, tenant_key, live_worker,
                                                               rclient, keys, quick_timeouts,
                                                               monkeypatch):
    from gateway import admission

    dispatched, tiers_seen = [], []
    real_admit = admission.admit

    async def admit(*args, **kwargs):
        message = await real_admit(*args, **kwargs)
        dispatched.append(message)
        tiers_seen.append(rclient.zrevrange(keys.fq("tiers"), 0, -1))
        return message

    monkeypatch.setattr(admission, "admit", admit)
    tenant, _, raw = tenant_key
    post(client, raw, chat())  # nobody answers: it waits in the queue until the client gives up
    tenant.tier = PriorityTier.objects.get(name="premium")
    tenant.save()
    client.raise_request_exception = False
    post(client, raw, chat())
    assert [m.priority for m in dispatched] == [0, 10]
    assert tiers_seen == [[b"0"], [b"10"]]  # each waited in its own tier
    assert rclient.hlen(keys.fq("wait")) == 0, "a client that gave up withdrew its request"


@pytest.fixture
def quick_timeouts(settings):
    settings.LLM_PLATFORM = {**settings.LLM_PLATFORM, "REQUEST_IDLE_TIMEOUT_S": 0.3}


def test_no_answer_from_a_worker_ends_with_504(client, tenant_key, live_worker, quick_timeouts):
    response = post(client, tenant_key[2], chat())
    assert response.status_code == 504


def test_stats_for_operators_and_staff_only(client, admin_client, make_tenant, inproc_worker):
    _, _, plain = make_tenant()
    _, _, operator = make_tenant(operator_key=True)
    assert client.get("/scheduler/stats").status_code == 401
    assert client.get("/scheduler/stats", HTTP_AUTHORIZATION=f"Bearer {plain}").status_code == 403
    body = client.get("/scheduler/stats", HTTP_AUTHORIZATION=f"Bearer {operator}").json()
    assert body["total"]["workers"] == 1 and "active_kv_reserved" in body["total"]
    assert "kv_pressure" in body["workers"]["inproc"]
    assert admin_client.get("/scheduler/stats").status_code == 200


def test_health_and_readiness(client, inproc_worker):
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["checks"]["workers"] == 1


def test_not_ready_without_a_worker(client, db):
    assert client.get("/readyz").status_code == 503


def test_not_ready_with_only_a_stale_heartbeat_this_process_cannot_tell_dead(client, db, rclient,
                                                                             keys, settings):
    # A worker that stopped beating a TTL ago, judged by a process without a TTL of sight of
    # Redis (it just started): the admission does not take it for gone (requests wait for it),
    # but readiness counts only a heartbeat within the TTL.
    from gateway import workers

    ttl = settings.LLM_PLATFORM.get("WORKER_HEARTBEAT_TTL_S", 10)
    rclient.zadd(keys.workers, {"stopped": time.time() - ttl - 1})
    assert asyncio.run(workers.alive_workers()) == ["stopped"]
    ready = client.get("/readyz")
    assert ready.status_code == 503 and ready["Retry-After"] == "1"
    assert ready.json()["checks"]["workers"] == "error: no live worker"


def test_models(client, tenant_key):
    response = client.get("/v1/models", HTTP_AUTHORIZATION=f"Bearer {tenant_key[2]}")
    assert [m["id"] for m in response.json()["data"]] == [MODEL]
    assert client.get("/v1/models").status_code == 401


def test_omitting_max_tokens_fits_the_default_answer_to_a_small_token_limit(
        client, make_tenant, inproc_worker):
    """A default the client did not choose is never the reason for a 'can never fit' 429."""
    _, _, raw = make_tenant(tokens_per_minute=100)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}]}
    response = post(client, raw, body)
    assert response.status_code == 200, response.content
    usage = response.json()["usage"]
    assert usage["completion_tokens"] >= 1
    # The reservation (the web tier's prompt count plus the capped default) fit in 100.
    again = post(client, raw, {**body, "max_tokens": 100})
    assert again.status_code == 429 and error_of(again)["code"] == "rate_limit_exceeded"


def test_a_stream_whose_worker_holds_ticks_gets_each_token_once_two_to_a_write(
        client, tenant_key, redis_prefix, settings):
    """A worker that sends a stream's tokens two at a time (``EVENT_HOLD_MS``): each write of the
    SSE body carries what one read found, as one chunk, so most carry two tokens (their text
    and their logprobs entries joined); the client gets every token once, in order, the same
    answer and logprobs as without the hold, and the first token alone."""
    from tests.support.platform import InProcessWorker

    def is_token(chunk: dict) -> bool:  # a token's chunk (not the opening, the end or usage)
        return bool(chunk["choices"]) and "role" not in chunk["choices"][0]["delta"] and (
            chunk["choices"][0]["finish_reason"] is None)

    body = chat(max_tokens=24, stream=True, temperature=0, logprobs=True, top_logprobs=2)
    answers, entries = {}, {}
    for hold_s in (0.0, 5.0):
        worker = InProcessWorker(redis_prefix, settings.REDIS_URL, max_model_len=256,
                                 max_batch_size=4, event_hold_s=hold_s,
                                 reference_step_delay_s=0.02).start()
        try:
            async def go():
                response = await AsyncClient().post(
                    CHAT, json.dumps(body), content_type="application/json",
                    headers={"Authorization": f"Bearer {tenant_key[2]}"})
                return [part async for part in response.streaming_content]

            writes = async_to_sync(go)()
        finally:
            worker.stop()
        frames = [read_sse(w) for w in writes]
        chunks = [json.loads(f) for write in frames for f in write if f != "[DONE]"]
        tokens = [c for c in chunks if is_token(c)]
        answers[hold_s] = "".join(c["choices"][0]["delta"]["content"] for c in tokens)
        entries[hold_s] = [e for c in tokens for e in c["choices"][0]["logprobs"]["content"]]
        per_write = [[json.loads(f) for f in write if f != "[DONE]"] for write in frames]
        chunks_per_write = [sum(1 for c in write if is_token(c)) for write in per_write]
        tokens_per_write = [sum(len(c["choices"][0]["logprobs"]["content"])
                                for c in write if is_token(c)) for write in per_write]
        assert max(chunks_per_write) == 1  # a write's tokens are one chunk
        if hold_s:
            token_writes = [n for n in tokens_per_write if n]
            assert token_writes[0] == 1, "the first token waited for the second"
            assert token_writes.count(2) >= 8, tokens_per_write
            assert sum(token_writes) == 24
        else:
            assert max(tokens_per_write) == 1
    assert answers[5.0] == answers[0.0] and len(answers[0.0]) > 0
    assert entries[5.0] == entries[0.0] and len(entries[0.0]) == 24
