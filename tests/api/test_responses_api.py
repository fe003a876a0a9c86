"""The Responses API served end to end on the reference backend (fast lane): the real ``openai``
client against the REST API and an in-process worker; shapes read back with the SDK's own types.
"""

from __future__ import annotations

import json
import time

import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseItemList, ResponseStreamEvent
from pydantic import TypeAdapter

from api.models import StoredResponse
from api.response_store import purge
from gateway import usage
from tenants.models import UsageRecord
from tests.api.test_api import MODEL, error_of, post
from tests.api.test_nullable_fields import in_process

pytestmark = pytest.mark.django_db

RESPONSES = "/v1/responses"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 12}}, "required": ["city"],
               "additionalProperties": False}}
EVENTS = TypeAdapter(ResponseStreamEvent)


def create(client: openai.AsyncOpenAI, **fields):
    return client.responses.create(**{"model": MODEL, "max_output_tokens": 8, **fields})


async def stream_events(client: openai.AsyncOpenAI, **fields) -> list:
    return [event async for event in await create(client, stream=True, **fields)]


def billed(response_id: str) -> UsageRecord:
    """The usage record of a response's request, as the usage task writes it (what its client
    got)."""
    request_id = response_id.removeprefix("resp_")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        usage.record(request_id)
        record = UsageRecord.objects.filter(request_id=request_id).first()
        if record is not None:
            return record
        time.sleep(0.05)
    raise AssertionError(f"no usage record for {response_id}")


def test_a_response_is_created_stored_and_read_back(tenant_key, inproc_worker):
    async def calls(client):
        made = await create(client, input="Hello there", metadata={"k": "v"})
        got = await client.responses.retrieve(made.id)
        raw = await client.responses.with_raw_response.retrieve(made.id)
        return made, got, json.loads(raw.content)

    made, got, raw = in_process(tenant_key[2], calls)
    Response.model_validate(raw, strict=False)  # the SDK's own type, as the server wrote it
    assert made.id.startswith("resp_") and made.object == "response"
    assert made.status == "incomplete" and made.incomplete_details.reason == "max_output_tokens"
    assert made.output_text and made.output[0].type == "message"
    assert got.output_text == made.output_text and got.status == made.status
    assert got.metadata == {"k": "v"} and got.store is True
    record = billed(made.id)
    assert made.usage.output_tokens == record.completion_tokens == 8
    assert made.usage.input_tokens == record.prompt_tokens > 0
    assert made.usage.total_tokens == made.usage.input_tokens + made.usage.output_tokens


def test_a_streamed_response_sends_the_typed_events_in_order(tenant_key, inproc_worker):
    async def calls(client):
        events = await stream_events(client, input="Stream me a story", max_output_tokens=6)
        stored = await client.responses.retrieve(events[0].response.id)
        return events, stored

    events, stored = in_process(tenant_key[2], calls)
    types = [e.type for e in events]
    deltas = types.count("response.output_text.delta")
    assert types == (["response.created", "response.in_progress", "response.output_item.added",
                      "response.content_part.added"] + ["response.output_text.delta"] * deltas
                     + ["response.output_text.done", "response.content_part.done",
                        "response.output_item.done", "response.incomplete"])
    assert [e.sequence_number for e in events] == list(range(len(events)))
    for event in events:
        EVENTS.validate_python(event.model_dump(mode="json"))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    final = events[-1].response
    assert text and text == done.text == final.output_text == stored.output_text
    assert events[0].response.status == "in_progress" and final.status == "incomplete"
    assert final.usage.output_tokens == billed(final.id).completion_tokens == 6
    assert stored.usage.output_tokens == 6


def test_a_stream_that_completes_ends_with_response_completed(tenant_key, inproc_worker):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}

    async def calls(client):  # the schema's grammar ends the answer: it completes
        return await stream_events(client, input="Hi", max_output_tokens=40, text={"format": {
            "type": "json_schema", "name": "done", "schema": schema}})

    events = in_process(tenant_key[2], calls)
    assert events[-1].type == "response.completed"
    assert events[-1].response.status == "completed"
    assert sum(e.type.startswith("response.") and e.type in (
        "response.completed", "response.incomplete", "response.failed") for e in events) == 1


def test_a_chain_of_three_turns_carries_function_calls_and_their_outputs(tenant_key,
                                                                        inproc_worker_long):
    async def calls(client):
        first = await create(client, input="What is the weather in Paris?", tools=[WEATHER],
                             tool_choice="required", max_output_tokens=200, temperature=0,
                             parallel_tool_calls=False)
        call = next(item for item in first.output if item.type == "function_call")
        second = await create(client, previous_response_id=first.id, tools=[WEATHER],
                              input=[{"type": "function_call_output", "call_id": call.call_id,
                                      "output": '{"celsius": 21}'}], temperature=0)
        third = await create(client, previous_response_id=second.id, input="And tomorrow?",
                             tools=[WEATHER], temperature=0)
        # The same conversation, sent whole as a chat completion.
        history = [{"role": "user", "content": "What is the weather in Paris?"},
                   {"role": "assistant", "content": None, "tool_calls": [{
                       "id": call.call_id, "type": "function",
                       "function": {"name": call.name, "arguments": call.arguments}}]},
                   {"role": "tool", "tool_call_id": call.call_id, "content": '{"celsius": 21}'}]
        chat_tools = [{"type": "function", "function": {
            k: v for k, v in WEATHER.items() if k != "type"}}]
        as_chat = await client.chat.completions.create(
            model=MODEL, messages=history, tools=chat_tools, max_tokens=8, temperature=0)
        items = await client.responses.input_items.list(second.id)
        return first, call, second, third, as_chat, items

    first, call, second, third, as_chat, items = in_process(tenant_key[2], calls)
    assert first.status == "completed" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    # The second turn's prompt is the whole conversation: the call and its output included.
    assert second.usage.input_tokens == as_chat.usage.prompt_tokens
    assert second.output_text == as_chat.choices[0].message.content
    assert second.previous_response_id == first.id
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens
    assert [i.type for i in items.data] == ["function_call_output"]
    assert items.data[0].call_id == call.call_id


def test_store_false_writes_nothing(tenant_key, inproc_worker):
    async def calls(client):
        made = await create(client, input="Hello", store=False)
        try:
            await client.responses.retrieve(made.id)
        except openai.NotFoundError as exc:
            missing = exc
        try:
            await create(client, input="Again", previous_response_id=made.id)
        except openai.NotFoundError as exc:
            unchained = exc
        return made, missing, unchained

    made, missing, unchained = in_process(tenant_key[2], calls)
    assert made.store is False and made.output_text
    assert missing.status_code == 404
    assert unchained.body["param"] == "previous_response_id"
    assert not StoredResponse.objects.exists()


def test_another_tenants_response_is_a_404_everywhere(make_tenant, tenant_key, inproc_worker):
    made = in_process(tenant_key[2], lambda c: create(c, input="Mine"))
    other = make_tenant()[2]

    async def calls(client):
        errors = []
        for call in (lambda: client.responses.retrieve(made.id),
                     lambda: client.responses.delete(made.id),
                     lambda: client.responses.input_items.list(made.id),
                     lambda: create(client, input="x", previous_response_id=made.id)):
            try:
                await call()
            except openai.NotFoundError as exc:
                errors.append(exc.status_code)
        return errors

    assert in_process(other, calls) == [404] * 4
    assert StoredResponse.objects.filter(pk=made.id).exists()


def test_input_items_list_in_pages_and_delete(tenant_key, inproc_worker):
    items = [{"role": "user", "content": f"message {i}"} for i in range(5)]

    async def calls(client):
        made = await create(client, input=items)
        newest = await client.responses.input_items.list(made.id, limit=2)
        rest = await client.responses.input_items.list(made.id, limit=10, after=newest.last_id)
        oldest = await client.responses.input_items.list(made.id, order="asc")
        raw = await client.responses.input_items.with_raw_response.list(made.id)
        await client.responses.delete(made.id)
        try:
            await client.responses.retrieve(made.id)
        except openai.NotFoundError:
            gone = True
        return newest, rest, oldest, json.loads(raw.content), gone

    newest, rest, oldest, raw, gone = in_process(tenant_key[2], calls)
    ResponseItemList.model_validate(raw)
    text = [i.content[0].text for i in oldest.data]
    assert text == [f"message {i}" for i in range(5)] and not oldest.has_more
    assert [i.content[0].text for i in newest.data] == text[::-1][:2] and newest.has_more
    assert [i.content[0].text for i in rest.data] == text[::-1][2:] and not rest.has_more
    assert gone and not StoredResponse.objects.exists()


def test_json_schema_text_format_constrains_the_output(tenant_key, inproc_worker_long):
    # Bounded answers only (an integer may run past any max_output_tokens).
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                               "ok": {"type": "boolean"}},
              "required": ["colour", "ok"], "additionalProperties": False}

    async def calls(client):
        return await create(client, input="An id", max_output_tokens=60, text={"format": {
            "type": "json_schema", "name": "thing", "schema": schema, "strict": True}})

    made = in_process(tenant_key[2], calls)
    assert made.status == "completed"
    jsonschema.validate(json.loads(made.output_text), schema)
    assert made.text.format.type == "json_schema"


def test_a_chain_longer_than_the_limit_is_refused(settings, tenant_key, inproc_worker):
    settings.LLM_PLATFORM = {**settings.LLM_PLATFORM, "MAX_RESPONSE_CHAIN": 2}

    async def calls(client):
        first = await create(client, input="one")
        second = await create(client, input="two", previous_response_id=first.id)
        try:
            await create(client, input="three", previous_response_id=second.id)
        except openai.BadRequestError as exc:
            return exc

    refused = in_process(tenant_key[2], calls)
    assert refused.body["param"] == "previous_response_id"
    assert "MAX_RESPONSE_CHAIN" in refused.body["message"]


def test_responses_past_the_retention_period_are_purged(settings, tenant_key, inproc_worker):
    made = in_process(tenant_key[2], lambda c: create(c, input="keep me a while"))
    assert purge() == 0
    retention = settings.LLM_PLATFORM["RESPONSES_RETENTION_S"]
    assert purge(now=time.time() + retention + 5) == 1
    assert not StoredResponse.objects.filter(pk=made.id).exists()
    schedule = {entry["task"] for entry in settings.CELERY_BEAT_SCHEDULE.values()}
    assert "api.tasks.purge_responses" in schedule


@pytest.mark.parametrize(("fields", "param", "code"), [
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type",
     "unsupported_parameter"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input[0].content[0].type", "unsupported_parameter"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role", "invalid_value"),
    ({"input": [{"role": "user", "content": "x", "colour": 1}]}, "input[0].colour",
     "unknown_parameter"),
    ({"input": []}, "input", "invalid_value"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]},
     "input[0].call_id", "invalid_value"),
    ({"input": [{"role": "user", "content": "x"}, {"type": "function_call", "call_id": "c",
                                                    "name": "f", "arguments": "{}"},
                {"role": "user", "content": "y"}]}, "input[1].call_id", "invalid_value"),
    ({"input": [{"role": "user", "content": "x"}, {"type": "function_call", "call_id": "c",
                                                    "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c", "output": "1"},
                {"type": "function_call_output", "call_id": "c", "output": "2"}]},
     "input[3].call_id", "invalid_value"),
    ({"input": [{"type": "function_call_output", "call_id": "c" * 300, "output": "1"}]},
     "input[0].call_id", "invalid_value"),
    ({"input": [{"content": "no type, no role"}]}, "input[0].type", "invalid_value"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": [
        {"type": "input_image"}]}]}, "input[0].output[0].type", "unsupported_parameter"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice.name", "invalid_value"),
    ({"tools": [{**WEATHER, "colour": 1}]}, "tools[0].colour", "unknown_parameter"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema",
     "missing_required_parameter"),
    ({"previous_response_id": ""}, "previous_response_id", "invalid_value"),
    ({"stream_options": {"include_obfuscation": True}}, "stream_options.include_obfuscation",
     "unsupported_parameter"),
    ({"stream_options": {"include_usage": True}}, "stream_options.include_usage",
     "unknown_parameter"),
    ({"stream_options": {"include_obfuscation": False}}, "stream_options", "invalid_value"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", "unsupported_parameter"),
    ({"tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name", "invalid_value"),
    ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools"}}, "tool_choice",
     "invalid_value"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}},
     "text.format.schema", "invalid_json_schema"),
    ({"max_output_tokens": 0}, "max_output_tokens", "invalid_value"),
    ({"reasoning": {"effort": "high"}}, "reasoning", "unsupported_parameter"),
    ({"background": True}, "background", "unsupported_parameter"),
    ({"truncation": "auto"}, "truncation", "unsupported_parameter"),
    ({"previous_response_id": "resp_nope"}, "previous_response_id", "not_found"),
    ({"seed": 3}, "seed", "unknown_parameter"),
    ({"model": "gpt-4o"}, "model", "model_not_found"),
])
def test_what_is_not_served_gets_an_error_naming_the_field(client, tenant_key, fields, param,
                                                          code):
    body = {"model": MODEL, "input": "Hello", "max_output_tokens": 4, **fields}
    response = post(client, tenant_key[2], body, RESPONSES)
    assert response.status_code in (400, 404)
    error = error_of(response)
    assert (error["param"], error["code"]) == (param, code)
    assert not StoredResponse.objects.exists()


def test_a_prompt_over_the_context_is_a_400_and_stores_nothing(client, tenant_key,
                                                               inproc_worker):
    body = {"model": MODEL, "input": "word " * 5000, "max_output_tokens": 4}
    response = post(client, tenant_key[2], body, RESPONSES)
    assert response.status_code == 400
    assert error_of(response)["param"] == "input"
    assert not StoredResponse.objects.exists()


def test_input_items_takes_any_query(client, tenant_key, inproc_worker):
    from hypothesis import HealthCheck, given
    from hypothesis import settings as hypothesis_settings
    from hypothesis import strategies as st

    made = post(client, tenant_key[2], {"model": MODEL, "input": "Hi", "max_output_tokens": 2},
                RESPONSES).json()
    values = st.one_of(st.sampled_from(["", "0", "1", "100", "101", "-1", "asc", "desc", "1e3",
                                        made["id"], "msg_x", "\x00"]), st.text(max_size=12))
    query = st.dictionaries(st.sampled_from(["limit", "order", "after", "include", "x"]),
                            values, max_size=3)

    @hypothesis_settings(max_examples=60, deadline=None,
                         suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(params=query)
    def run(params):
        response = client.get(f"{RESPONSES}/{made['id']}/input_items", params,
                              headers={"Authorization": f"Bearer {tenant_key[2]}"})
        assert response.status_code in (200, 400, 404), response.content[:300]
        if response.status_code != 200:
            assert response.json()["error"]["param"] in ("limit", "order", "after")

    run()


def test_the_tenants_limits_and_budget_hold_and_a_refusal_stores_nothing(client, make_tenant,
                                                                          inproc_worker):
    from tests.api.test_ratelimit_headers import NAMES

    _, _, raw = make_tenant(requests_per_minute=1, tokens_per_minute=100_000)
    body = {"model": MODEL, "input": "Hello", "max_output_tokens": 3}
    first = post(client, raw, body, RESPONSES)
    assert first.status_code == 200
    assert all(name in first.headers for name in NAMES)
    refused = post(client, raw, body, RESPONSES)
    assert refused.status_code == 429 and "Retry-After" in refused.headers
    assert error_of(refused)["code"] == "rate_limit_exceeded"
    assert StoredResponse.objects.count() == 1
    _, _, broke = make_tenant(token_budget=5, budget_period="day")
    over = post(client, broke, {**body, "max_output_tokens": 50}, RESPONSES)
    assert over.status_code == 429 and StoredResponse.objects.count() == 1
