"""``n`` choices served end to end on the reference backend (fast lane): the real ``openai``
client, the REST API and an in-process worker that prefills the prompt once and forks it."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.api.test_api import MODEL, error_of, post
from tests.api.test_nullable_fields import in_process

pytestmark = pytest.mark.django_db

USER = {"role": "user", "content": "Tell me a story."}
SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0,
                                                  "maximum": 99},
                                           "word": {"type": "string", "maxLength": 6}},
          "required": ["id", "word"], "additionalProperties": False}


async def streamed(stream) -> dict[int, dict]:
    """Each choice of a stream: its text, finish reason and how many finish chunks it got."""
    choices: dict[int, dict] = {}
    async for chunk in stream:
        for choice in chunk.choices:
            entry = choices.setdefault(choice.index, {"text": "", "finish": None, "ends": 0})
            delta = getattr(choice, "delta", None)
            entry["text"] += (delta.content or "") if delta is not None else (choice.text or "")
            if choice.finish_reason:
                entry["finish"], entry["ends"] = choice.finish_reason, entry["ends"] + 1
    return choices


def test_seeded_choices_repeat_streamed_or_not(tenant_key, inproc_worker):
    # The reference backend's next token is nearly certain: its hottest sampling differs.
    ask = {"model": MODEL, "messages": [USER], "max_tokens": 12, "n": 3, "seed": 11,
           "temperature": 2.0, "extra_body": {"ignore_eos": True}}

    async def calls(client: openai.AsyncOpenAI):
        first = await client.chat.completions.create(**ask)
        again = await client.chat.completions.create(**ask)
        stream = await streamed(await client.chat.completions.create(**ask, stream=True))
        one = await client.chat.completions.create(**{**ask, "n": 1})
        return first, again, stream, one

    first, again, stream, one = in_process(tenant_key[2], calls)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in again.choices]
    assert texts == [stream[i]["text"] for i in range(3)]
    assert all(stream[i]["ends"] == 1 for i in range(3))
    assert len(set(texts)) > 1  # independent draws
    # The prompt is billed once; the completions of every choice.
    assert first.usage.prompt_tokens == one.usage.prompt_tokens
    assert [c.finish_reason for c in first.choices] == ["length"] * 3
    assert first.usage.completion_tokens == 3 * 12


def test_n_with_stop_logprobs_and_a_schema(tenant_key, inproc_worker):
    async def calls(client: openai.AsyncOpenAI):
        stopped = await client.completions.create(
            model=MODEL, prompt="Once", max_tokens=30, n=4, seed=3, temperature=1.0,
            stop=["e"], logprobs=2)
        shaped = await client.chat.completions.create(
            model=MODEL, messages=[USER], max_tokens=60, n=3, seed=5,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "x", "schema": SCHEMA}})
        return stopped, shaped

    stopped, shaped = in_process(tenant_key[2], calls)
    assert len(stopped.choices) == 4
    for choice in stopped.choices:
        assert "e" not in choice.text
        assert "".join(choice.logprobs.tokens) == choice.text
        assert all(len(top) == 2 for top in choice.logprobs.top_logprobs)
    for choice in shaped.choices:
        if choice.finish_reason == "stop":
            jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_n_with_tools_reads_each_choice_for_calls(tenant_key, inproc_worker_long):
    tool = {"type": "function", "function": {"name": "now"}}

    async def calls(client: openai.AsyncOpenAI):
        return await client.chat.completions.create(
            model=MODEL, messages=[USER], max_tokens=60, n=2, tools=[tool],
            tool_choice="required", parallel_tool_calls=False)

    reply = in_process(tenant_key[2], calls)
    assert [c.finish_reason for c in reply.choices] == ["tool_calls", "tool_calls"]
    assert all(c.message.tool_calls[0].function.arguments == "{}" for c in reply.choices)


def test_n_is_bounded_and_reserved_n_times(client, make_tenant, inproc_worker, settings):
    _, _, raw = make_tenant()
    body = {"model": MODEL, "messages": [USER], "max_tokens": 4}
    response = post(client, raw, {**body, "n": 9})
    assert response.status_code == 400
    error = error_of(response)
    assert error["param"] == "n" and "MAX_N" in error["message"]
    # More choices than the worker's batch (4 rows) can never run together.
    response = post(client, raw, {**body, "n": 5})
    assert response.status_code == 400 and error_of(response)["param"] == "n"
    # The reservation counts every choice's max_tokens.
    _, _, limited = make_tenant(tokens_per_minute=100)
    assert post(client, limited, {**body, "max_tokens": 40}).status_code == 200
    refused = post(client, limited, {**body, "max_tokens": 40, "n": 3})
    assert refused.status_code == 429, refused.content
    # Omitting max_tokens fits each choice's default into the limit.
    _, _, small = make_tenant(tokens_per_minute=100)
    fitted = post(client, small, {"model": MODEL, "messages": [USER], "n": 3})
    assert fitted.status_code == 200, fitted.content
    assert fitted.json()["usage"]["total_tokens"] <= 100
