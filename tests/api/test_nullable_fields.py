"""OpenAI clients work unchanged: an optional field sent as ``null`` means its default.

The official ``openai`` client sends ``null`` for a parameter given as ``None``
(``temperature=None``, ``top_p=None``, ...); the OpenAI API marks those fields nullable. Both
endpoints take ``null`` for every optional field, as raw JSON and from the real client (driven
in-process over ASGI, and over HTTP in ``test_e2e_openai_compat.py``).
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from asgiref.sync import async_to_sync
from django.core.asgi import get_asgi_application
from django.core.signals import request_finished, request_started
from django.db import close_old_connections

from api.schemas import ChatCompletionRequest, CompletionRequest, validate
from gateway.errors import APIError
from tests.api.test_api import CHAT, MODEL, chat, error_of, post

pytestmark = pytest.mark.django_db

TEXT = "/v1/completions"

# The optional request fields of each endpoint in the OpenAI API (all nullable there), with the
# extensions this server takes (top_k, min_tokens, ignore_eos) and fields it ignores.
COMMON = ["max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed",
          "user", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "top_k",
          "min_tokens", "ignore_eos", "service_tier", "metadata", "store"]
CHAT_FIELDS = COMMON + ["max_completion_tokens", "top_logprobs", "response_format", "tools",
                        "tool_choice", "parallel_tool_calls", "functions", "function_call",
                        "modalities", "audio", "prediction", "reasoning_effort",
                        "web_search_options", "verbosity"]
TEXT_FIELDS = COMMON + ["best_of", "echo", "suffix"]


def text(**extra):
    return {"model": MODEL, "prompt": "Once upon", "max_tokens": 3, **extra}


REQUIRED_NULLS = {
    CHAT: [({"model": None}, "model"), ({"messages": None}, "messages"),
           ({"messages": [None]}, "messages[0]"),
           ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
           ({"messages": [{"role": None, "content": "Hi"}]}, "messages[0].role")],
    TEXT: [({"prompt": None}, "prompt"), ({"model": None}, "model")],
}


@pytest.mark.parametrize(("path", "model", "body", "fields"), [
    (CHAT, ChatCompletionRequest, chat(max_tokens=3), CHAT_FIELDS),
    (TEXT, CompletionRequest, text(), TEXT_FIELDS),
])
def test_null_means_the_default_where_there_is_one(client, tenant_key, path, model, body,
                                                   fields):
    differ = [field for field in fields
              if _validated(model, {**body, field: None})
              != _validated(model, {k: v for k, v in body.items() if k != field})]
    assert differ == [], "null is not the default for these fields"
    # A required field has no default: null is refused, naming it.
    for change, param in REQUIRED_NULLS[path]:
        response = post(client, tenant_key[2], {**body, **change}, path=path)
        assert response.status_code == 400 and error_of(response)["param"] == param


def _validated(model, body):
    try:
        return validate(model, body)
    except APIError as exc:
        return exc.param


def test_nested_nulls_are_defaults_too():
    req = validate(ChatCompletionRequest, chat(stream=True, stream_options={"include_usage": None}))
    assert req.include_usage is False
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None},
               {"role": "user", "content": "Again"}]
    req = validate(ChatCompletionRequest, {**chat(), "messages": history})
    assert [m.as_dict()["content"] for m in req.messages] == ["Hi", "", "Again"]


@pytest.mark.parametrize(("path", "body", "fields"), [
    (CHAT, chat(max_tokens=3), CHAT_FIELDS),
    (TEXT, text(), TEXT_FIELDS),
])
def test_every_optional_field_null_at_once_as_raw_json(client, tenant_key, inproc_worker, path,
                                                       body, fields):
    nulls = {field: None for field in fields if field != "max_tokens"}
    response = post(client, tenant_key[2], json.dumps({**body, **nulls}), path=path)
    assert response.status_code == 200, response.content
    assert response.json()["usage"]["completion_tokens"] == 3


def in_process(raw_key: str, calls):
    """Run ``calls(client)`` with an ``openai.AsyncOpenAI`` client served by this process's ASGI
    application (the test database's transaction stays open across its requests)."""

    async def go():
        transport = httpx.ASGITransport(app=get_asgi_application())
        async with httpx.AsyncClient(transport=transport) as http:
            client = openai.AsyncOpenAI(base_url="http://testserver/v1", api_key=raw_key,
                                        http_client=http, max_retries=0)
            return await calls(client)

    # As Django's test client does: a request's end must not close the test's connection.
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    try:
        return async_to_sync(go)()
    finally:
        request_started.connect(close_old_connections)
        request_finished.connect(close_old_connections)


NONE_PARAMS = dict(temperature=None, top_p=None, n=None, seed=None, stop=None, user=None,
                   presence_penalty=None, frequency_penalty=None, logprobs=None, logit_bias=None)


def test_the_openai_client_with_none_parameters(tenant_key, inproc_worker):
    messages = [{"role": "user", "content": "Hello"}]

    async def calls(client: openai.AsyncOpenAI):
        chat_reply = await client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=3, stream=None, stream_options=None,
            max_completion_tokens=None, top_logprobs=None, response_format=None,
            tool_choice=None, service_tier=None, **NONE_PARAMS)
        chunks = [chunk async for chunk in await client.chat.completions.create(
            model=MODEL, messages=messages, max_completion_tokens=3, max_tokens=None,
            stream=True, stream_options=None, **NONE_PARAMS)]
        text_reply = await client.completions.create(
            model=MODEL, prompt="Once upon", max_tokens=3, stream=None, best_of=None, echo=None,
            suffix=None, **NONE_PARAMS)
        text_chunks = [chunk async for chunk in await client.completions.create(
            model=MODEL, prompt="Once upon", max_tokens=3, stream=True,
            stream_options={"include_usage": None}, **NONE_PARAMS)]
        return chat_reply, chunks, text_reply, text_chunks

    chat_reply, chunks, text_reply, text_chunks = in_process(tenant_key[2], calls)
    assert chat_reply.usage.completion_tokens == 3
    assert chat_reply.choices[0].finish_reason == "length"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert text_reply.usage.completion_tokens == 3
    assert [c.choices[0].finish_reason for c in text_chunks if c.choices][-1] == "length"


def test_the_openai_client_reads_the_rate_limit_headers(make_tenant, inproc_worker):
    _, _, raw = make_tenant(requests_per_minute=7)

    async def calls(client: openai.AsyncOpenAI):
        first = await client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
            temperature=None)
        second = await client.completions.with_raw_response.create(
            model=MODEL, prompt="Hi", max_tokens=1, temperature=None)
        return first.headers, second.headers

    first, second = in_process(raw, calls)
    assert first["x-ratelimit-limit-requests"] == second["x-ratelimit-limit-requests"] == "7"
    assert (first["x-ratelimit-remaining-requests"], second["x-ratelimit-remaining-requests"]) \
        == ("6", "5")
