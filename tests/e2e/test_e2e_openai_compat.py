"""End to end over HTTP (daphne, a worker on the reference backend, Celery, Redis, the database),
driven by the ``openai`` client: ``None`` parameters (sent as ``null``) are the defaults, the
responses carry the rate limiter's ``x-ratelimit-*`` headers, and bodies no encoder writes get a
JSON 400, never a 5xx."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.support.e2e import MODEL, client, start_stack

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

NONE_PARAMS = dict(temperature=None, top_p=None, n=None, seed=None, stop=None, user=None,
                   presence_penalty=None, frequency_penalty=None, logprobs=None, logit_bias=None)


@pytest.fixture(scope="module")
def stack(request, django_db_setup, django_db_blocker, tmp_path_factory):
    return start_stack(request, django_db_blocker, tmp_path_factory, workers=1)


def test_none_parameters_are_the_defaults(stack, make_tenant, transactional_db):
    c = client(stack, make_tenant()[2])
    messages = [{"role": "user", "content": "Hi"}]
    reply = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, stream=None,
                                      stream_options=None, max_completion_tokens=None,
                                      top_logprobs=None, response_format=None, **NONE_PARAMS)
    assert reply.usage.completion_tokens == 4
    chunks = list(c.chat.completions.create(model=MODEL, messages=messages, max_tokens=4,
                                            stream=True, stream_options=None, **NONE_PARAMS))
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    text = c.completions.create(model=MODEL, prompt="Once upon", max_tokens=4, stream=None,
                                best_of=None, echo=None, suffix=None, **NONE_PARAMS)
    assert text.usage.completion_tokens == 4


def test_rate_limit_headers_over_http(stack, make_tenant, transactional_db):
    c = client(stack, make_tenant(requests_per_minute=2, tokens_per_minute=50_000)[2])
    messages = [{"role": "user", "content": "Hi"}]
    first = c.chat.completions.with_raw_response.create(model=MODEL, messages=messages,
                                                        max_tokens=2)
    with c.chat.completions.with_streaming_response.create(
            model=MODEL, messages=messages, max_tokens=2, stream=True) as second:
        assert second.headers["x-ratelimit-remaining-requests"] == "0"
        list(second.iter_lines())
    assert first.headers["x-ratelimit-limit-requests"] == "2"
    assert first.headers["x-ratelimit-remaining-requests"] == "1"
    assert first.headers["x-ratelimit-reset-requests"] == "1m0s"
    spent = 50_000 - int(first.headers["x-ratelimit-remaining-tokens"])
    assert spent > 2 and int(second.headers["x-ratelimit-remaining-tokens"]) <= 50_000 - spent
    with pytest.raises(openai.RateLimitError) as refused:
        c.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    headers = refused.value.response.headers
    assert headers["x-ratelimit-limit-requests"] == "2"
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert headers["retry-after"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_body_nested_100000_deep_gets_a_json_400(stack, make_tenant, transactional_db, path):
    raw = make_tenant()[2]
    response = httpx.post(f"{stack.url}{path}", content="[" * 100_000 + "]" * 100_000,
                          headers={"Authorization": f"Bearer {raw}",
                                   "Content-Type": "application/json"}, timeout=30)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_json"
