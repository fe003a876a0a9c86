"""Tool calling served end to end on the reference backend (fast lane): the real ``openai``
client, the REST API, an in-process worker applying the tool-call grammar, and the calls read
back from the answer, streamed and not."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.api.test_api import MODEL, error_of, post
from tests.api.test_nullable_fields import in_process

pytestmark = pytest.mark.django_db

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "unit", "days"], "additionalProperties": False}}}
NOW = {"type": "function", "function": {"name": "now", "description": "The time."}}
TOOLS = [WEATHER, NOW]
SCHEMAS = {"get_weather": WEATHER["function"]["parameters"],
           "now": {"type": "object", "properties": {}, "additionalProperties": False}}
USER = {"role": "user", "content": "What is the weather in Paris?"}


def ask(client: openai.AsyncOpenAI, **fields):
    return client.chat.completions.create(**{"model": MODEL, "messages": [USER],
                                             "max_tokens": 200, "tools": TOOLS, **fields})


async def streamed(client: openai.AsyncOpenAI, **fields) -> dict:
    """The streamed answer joined: content, calls (by index), finish reason, chunk count."""
    stream = await ask(client, stream=True, **fields)
    content, calls, finish, chunks = "", {}, None, 0
    async for chunk in stream:
        chunks += 1
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for call in choice.delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"id": None, "name": None, "arguments": ""})
            if call.id:
                assert entry["id"] is None, "a call's id comes once"
                entry["id"] = call.id
            if call.function and call.function.name:
                entry["name"] = call.function.name
            if call.function and call.function.arguments:
                entry["arguments"] += call.function.arguments
        finish = choice.finish_reason or finish
    return {"content": content, "calls": [calls[i] for i in sorted(calls)], "finish": finish,
            "chunks": chunks}


def whole_calls(reply) -> list[dict]:
    message = reply.choices[0].message
    return [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
            for c in message.tool_calls or []]


def valid(call: dict) -> None:
    jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    assert call["id"].startswith("call_")


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_named_choice_always_gives_that_call_with_valid_arguments(tenant_key,
                                                                    inproc_worker_long, seed):
    choice = {"type": "function", "function": {"name": "get_weather"}}

    async def calls(client):
        reply = await ask(client, tool_choice=choice, seed=seed, temperature=1.0)
        return reply, await streamed(client, tool_choice=choice, seed=seed, temperature=1.0)

    reply, stream = in_process(tenant_key[2], calls)
    assert reply.choices[0].finish_reason == "tool_calls"
    assert reply.choices[0].message.content is None
    [call] = whole_calls(reply)
    assert call["name"] == "get_weather"
    valid(call)
    # The same seed: the streamed answer is the same call, its arguments joined from fragments.
    assert stream["finish"] == "tool_calls" and stream["content"] == ""
    assert [(c["name"], c["arguments"]) for c in stream["calls"]] == [
        (call["name"], call["arguments"])]
    assert stream["chunks"] > 3


def test_required_calls_are_valid_and_a_parameterless_tool_gives_exactly_braces(
        tenant_key, inproc_worker_long):
    async def calls(client):
        replies = [await ask(client, tool_choice="required", seed=s, temperature=1.0)
                   for s in range(6)]
        now = await ask(client, tools=[NOW], tool_choice="required", seed=9)
        now_stream = await streamed(client, tools=[NOW], tool_choice="required", seed=9)
        single = await ask(client, tool_choice="required", parallel_tool_calls=False, seed=4)
        return replies, now, now_stream, single

    replies, now, now_stream, single = in_process(tenant_key[2], calls)
    for reply in replies:
        assert reply.choices[0].finish_reason in ("tool_calls", "length")
        made = whole_calls(reply)
        assert made and all(c["name"] in SCHEMAS for c in made)
        for call in made if reply.choices[0].finish_reason == "tool_calls" else made[:-1]:
            valid(call)
        assert len({c["id"] for c in made}) == len(made)
    assert [c["arguments"] for c in whole_calls(now)] == ["{}"] * len(whole_calls(now))
    assert [c["arguments"] for c in now_stream["calls"]] == ["{}"] * len(now_stream["calls"])
    assert len(whole_calls(single)) == 1


def test_tool_choice_none_never_returns_a_call(tenant_key, inproc_worker_long):
    async def calls(client):
        return [await ask(client, tool_choice="none", seed=s, temperature=1.0, max_tokens=40)
                for s in range(3)]

    for reply in in_process(tenant_key[2], calls):
        assert reply.choices[0].message.tool_calls is None
        assert reply.choices[0].finish_reason in ("stop", "length")
        assert isinstance(reply.choices[0].message.content, str)


def test_auto_answers_in_text_or_in_valid_calls(tenant_key, inproc_worker_long):
    async def calls(client):
        return [await ask(client, seed=s, temperature=1.0, max_tokens=120) for s in range(4)]

    for reply in in_process(tenant_key[2], calls):
        choice = reply.choices[0]
        if choice.finish_reason == "tool_calls":
            for call in whole_calls(reply):
                valid(call)
        else:
            assert choice.message.tool_calls is None or choice.finish_reason == "length"


def test_a_history_with_tool_results_renders_and_answers(tenant_key, inproc_worker_long):
    history = [USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_a", "type": "function",
         "function": {"name": "get_weather",
                      "arguments": '{"city":"Paris","unit":"celsius","days":1}'}},
        {"id": "call_b", "type": "function", "function": {"name": "now", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_a", "content": '{"temperature": 21}'},
        {"role": "tool", "tool_call_id": "call_b", "content": "12:00"}]

    async def calls(client):
        return (await ask(client, messages=history, max_tokens=8),
                await ask(client, messages=[USER], max_tokens=8))

    reply, plain = in_process(tenant_key[2], calls)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # Both calls and both results are in the prompt (the reference backend's tokens are bytes).
    rendered = sum(len(json.dumps(c["function"])) for c in history[1]["tool_calls"]) + len(
        history[2]["content"] + history[3]["content"])
    assert reply.usage.prompt_tokens >= plain.usage.prompt_tokens + rendered


CALL_A = {"id": "a", "type": "function", "function": {"name": "now", "arguments": "{}"}}
CALL_B = {"id": "b", "type": "function", "function": {"name": "now", "arguments": "{}"}}


def test_the_refusals_name_the_field(client, tenant_key):
    raw = tenant_key[2]
    body = {"model": MODEL, "messages": [USER], "max_tokens": 4, "tools": TOOLS}
    cases = [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name"),
        ({"stop": ["x"]}, "stop"),
        ({"logprobs": True}, "logprobs"),
        ({"structured_outputs": {"regex": "a+"}}, "structured_outputs"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}},
         "response_format"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
        ({"tool_choice": {"type": "function", "name": "now"}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "if": {}, "then": {}}}}]},
         "tools[0].function.parameters"),
        ({"tools": [{"type": "custom", "custom": {"name": "f"}}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "string"}}}]}, "tools[0].function.parameters"),
        ({"messages": [USER, {"role": "tool", "tool_call_id": "call_x", "content": "1"}]},
         "messages[1].role"),
        ({"messages": [USER, {"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "now", "arguments": "{}"}},
            {"id": "c", "type": "function", "function": {"name": "now", "arguments": "{}"}}]}]},
         "messages[1].tool_calls[1].id"),
        # Each call gets exactly one result before the next message (OpenAI's check).
        ({"messages": [USER, {"role": "assistant", "tool_calls": [CALL_A, CALL_B]},
                       {"role": "tool", "tool_call_id": "a", "content": "1"}, USER]},
         "messages[1].tool_calls[1].id"),
        ({"messages": [USER, {"role": "assistant", "tool_calls": [CALL_A]}]},
         "messages[1].tool_calls[0].id"),
        ({"messages": [USER, {"role": "assistant", "tool_calls": [CALL_A]},
                       {"role": "tool", "tool_call_id": "a", "content": "1"},
                       {"role": "tool", "tool_call_id": "a", "content": "2"}]},
         "messages[3].tool_call_id"),
    ]
    for extra, param in cases:
        response = post(client, raw, {**body, **extra})
        assert response.status_code == 400, (extra, response.content)
        assert error_of(response)["param"] == param, extra


def test_the_limits_on_tools_are_settings(client, tenant_key, settings):
    raw = tenant_key[2]
    settings.LLM_PLATFORM = {**settings.LLM_PLATFORM, "MAX_TOOLS": 1}
    response = post(client, raw, {"model": MODEL, "messages": [USER], "tools": TOOLS})
    assert response.status_code == 400
    error = error_of(response)
    assert error["param"] == "tools" and "at most 1 tools (MAX_TOOLS)" in error["message"]
    settings.LLM_PLATFORM = {**settings.LLM_PLATFORM, "MAX_TOOLS": 128, "MAX_TOOLS_BYTES": 100}
    response = post(client, raw, {"model": MODEL, "messages": [USER], "tools": TOOLS})
    assert response.status_code == 400
    assert "MAX_TOOLS_BYTES" in error_of(response)["message"]


def test_an_answer_sent_back_as_received_continues_the_chat(tenant_key, inproc_worker_long):
    """A framework sends the assistant message back as it got it (the call's ``index`` too, when
    it kept the streamed entries), with the tool's result."""
    async def calls(client):
        reply = await ask(client, tool_choice="required", parallel_tool_calls=False, seed=5)
        message = reply.choices[0].message.model_dump(exclude_none=True)
        [call] = message["tool_calls"]
        assert "index" not in call
        result = {"role": "tool", "tool_call_id": call["id"], "content": "done"}
        again = await ask(client, messages=[USER, message, result], max_tokens=8)
        call["index"] = 0
        streamed_back = await ask(client, messages=[USER, message, result], max_tokens=8)
        return again, streamed_back

    again, streamed_back = in_process(tenant_key[2], calls)
    assert again.usage.prompt_tokens == streamed_back.usage.prompt_tokens
    assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_schema_edge_cases_are_answered_or_refused_never_a_500(client, tenant_key,
                                                                inproc_worker_long):
    raw = tenant_key[2]
    # A number JSON cannot write: the same 400 as in a response_format schema.
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "number", "maximum": 0}}}}}
    huge = json.dumps({"model": MODEL, "messages": [USER], "tools": [tool]}).replace(
        '"maximum": 0', '"maximum": 1e400')
    response = post(client, raw, huge)
    assert response.status_code == 400
    assert error_of(response)["param"] == "tools[0].function.parameters"
    # Arguments in the history nested deeper than the JSON parser goes: text in the prompt.
    deep = "[" * 1500 + "]" * 1500  # past Python's recursion limit, within the context
    history = [USER, {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
                                                           "function": {"name": "now",
                                                                        "arguments": deep}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    response = post(client, raw, {"model": MODEL, "messages": history, "tools": TOOLS,
                                  "tool_choice": "none", "max_tokens": 2})
    assert response.status_code == 200, response.content


def test_refs_in_parameters_and_a_response_format_beside_auto(tenant_key, inproc_worker_long):
    nested = {"type": "object", "properties": {
        "home": {"$ref": "#/$defs/Address"}, "work": {"$ref": "#/properties/home"}},
        "required": ["home", "work"], "additionalProperties": False,
        "$defs": {"Address": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 8}}, "required": ["city"],
            "additionalProperties": False}}}
    person = {"type": "function", "function": {"name": "person", "parameters": nested}}
    answer = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}

    async def calls(client):
        made = await ask(client, tools=[person], tool_choice="required",
                         parallel_tool_calls=False, seed=2)
        formatted = [await ask(client, seed=s, temperature=1.0, max_tokens=120,
                               response_format={"type": "json_schema", "json_schema": {
                                   "name": "a", "schema": answer}}) for s in range(3)]
        return made, formatted

    made, formatted = in_process(tenant_key[2], calls)
    [call] = whole_calls(made)
    jsonschema.validate(json.loads(call["arguments"]), nested)
    for reply in formatted:  # the formatted JSON, or calls with no text before them
        choice = reply.choices[0]
        if choice.message.tool_calls:
            assert not choice.message.content
        elif choice.finish_reason == "stop":
            jsonschema.validate(json.loads(choice.message.content), answer)


def test_a_call_cut_inside_its_marker_leaves_no_markup(tenant_key, inproc_worker_long):
    async def calls(client):
        return [await ask(client, tool_choice="required", max_tokens=m) for m in range(1, 14)]

    for reply in in_process(tenant_key[2], calls):
        message = reply.choices[0].message
        assert "<" not in (message.content or ""), message
        assert reply.choices[0].finish_reason == "length"
