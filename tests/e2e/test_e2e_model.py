"""End to end on the real default model (one worker), driven by the ``openai`` client."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.support.e2e import MODEL, client, start_stack

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.model]


@pytest.fixture(scope="module")
def stack(request, django_db_setup, django_db_blocker, tmp_path_factory):
    from inference.protocol.settings import PlatformSettings

    if not (PlatformSettings().model_folder / "config.json").is_file():
        pytest.skip("the default model is not prepared: python -m inference.worker.prepare_model")
    return start_stack(request, django_db_blocker, tmp_path_factory, workers=1,
                       BACKEND="transformers", MAX_BATCH_SIZE=4)


def test_chat_on_the_real_model(stack, make_tenant, transactional_db):
    c = client(stack, make_tenant()[2])
    reply = c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=16, temperature=0)
    assert reply.choices[0].message.content.strip()
    assert reply.usage.prompt_tokens > 5 and 0 < reply.usage.completion_tokens <= 16


def test_concurrent_streams_on_the_real_model(stack, make_tenant, transactional_db):
    c = client(stack, make_tenant()[2])

    def stream(prompt: str):
        chunks = list(c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=12,
            temperature=0, stream=True, stream_options={"include_usage": True}))
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        return text, chunks

    prompts = ["Name a colour.", "Name an animal.", "Say hello."]
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(stream, prompts))
    ids = [{ch.id for ch in chunks} for _, chunks in results]
    assert all(len(s) == 1 for s in ids) and len(set.union(*ids)) == 3
    for text, chunks in results:
        assert text.strip()
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens <= 12


def test_structured_outputs_through_the_unmodified_openai_client(stack, make_tenant,
                                                                 transactional_db):
    """``chat.completions.parse`` with a pydantic model, a streamed JSON schema answer, a choice
    through vLLM's ``structured_outputs``, and a schema keyword the server does not support."""
    import json

    import jsonschema
    import openai
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=40)
        country: str = Field(max_length=40)
        population_millions: int = Field(ge=0, le=1000)

    c = client(stack, make_tenant()[2])
    messages = [{"role": "user", "content": "Describe the capital of France as JSON."}]
    parsed = c.chat.completions.parse(model=MODEL, messages=messages, response_format=City,
                                      max_tokens=200, temperature=0)
    choice = parsed.choices[0]
    assert choice.finish_reason == "stop", choice
    assert isinstance(choice.message.parsed, City) and choice.message.parsed.name

    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                               "why": {"type": "string", "maxLength": 60}},
              "required": ["answer", "why"], "additionalProperties": False}
    chunks = list(c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Is water wet? Answer in JSON."}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": "verdict", "schema": schema, "strict": True}},
        max_tokens=100, temperature=0, stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1]
    if finish == "stop":
        jsonschema.validate(json.loads(text), schema)
    assert chunks[-1].usage.completion_tokens >= len(text) // 8 > 0

    picked = c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Pick a colour."}], max_tokens=10,
        extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})
    assert picked.choices[0].message.content in ("red", "green", "blue")

    with pytest.raises(openai.BadRequestError) as refused:
        c.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=10,
            response_format={"type": "json_schema", "json_schema": {
                "name": "x", "schema": {"type": "object", "if": {"required": ["a"]},
                                        "then": {"required": ["b"]}}}})
    error = refused.value.body
    assert error["param"] == "response_format.json_schema.schema"
    assert "'if'" in error["message"] and "'then'" in error["message"]


def test_tool_calling_through_the_unmodified_openai_client(stack, make_tenant, transactional_db):
    """A named and a required tool choice on the real model give calls whose arguments validate
    (``chat.completions.parse`` reads them into the pydantic model), streamed exactly as not
    streamed; the tool's result then gets a text answer."""
    import json

    import jsonschema
    import openai
    from pydantic import BaseModel, Field

    class GetWeather(BaseModel):
        city: str = Field(max_length=30)
        unit: str = Field(pattern="^(celsius|fahrenheit)$")

    c = client(stack, make_tenant()[2])
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    tool = openai.pydantic_function_tool(GetWeather)
    parsed = c.chat.completions.parse(
        model=MODEL, messages=messages, tools=[tool], max_tokens=120, temperature=0,
        tool_choice={"type": "function", "function": {"name": "GetWeather"}})
    choice = parsed.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    assert isinstance(call.function.parsed_arguments, GetWeather)

    now = {"type": "function", "function": {"name": "current_time",
                                            "description": "The current time."}}
    asked = {"model": MODEL, "messages": messages, "tools": [tool, now],
             "tool_choice": "required", "max_tokens": 120, "temperature": 0}
    whole = c.chat.completions.create(**asked)
    calls = whole.choices[0].message.tool_calls
    assert whole.choices[0].finish_reason == "tool_calls" and calls
    schemas = {"GetWeather": tool["function"]["parameters"],
               "current_time": {"type": "object", "properties": {},
                                "additionalProperties": False}}
    for made in calls:
        jsonschema.validate(json.loads(made.function.arguments), schemas[made.function.name])
    streamed: dict[int, list[str]] = {}
    for chunk in c.chat.completions.create(**asked, stream=True):
        for delta in chunk.choices[0].delta.tool_calls or []:
            entry = streamed.setdefault(delta.index, ["", ""])
            entry[0] += delta.function.name or ""
            entry[1] += delta.function.arguments or ""
    assert [tuple(streamed[i]) for i in sorted(streamed)] == [
        (m.function.name, m.function.arguments) for m in calls]

    history = [*messages, choice.message.model_dump(exclude_none=True, exclude={"parsed"}),
               {"role": "tool", "tool_call_id": call.id, "content": "21 degrees, sunny"}]
    for turn in history:
        for made in turn.get("tool_calls", []):
            made.get("function", {}).pop("parsed_arguments", None)
    answer = c.chat.completions.create(model=MODEL, messages=history, tools=[tool],
                                       max_tokens=30, temperature=0)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert answer.usage.prompt_tokens > parsed.usage.prompt_tokens


def test_the_responses_api_on_the_real_model(stack, make_tenant, transactional_db):
    """``responses.parse`` into a pydantic model, a streamed answer whose deltas are the stored
    text, and a chain through a function call and its output, on the real model."""
    import json

    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=30)

    c = client(stack, make_tenant()[2])
    parsed = c.responses.parse(model=MODEL, input="Name a city in France.", text_format=City,
                               max_output_tokens=60, temperature=0)
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, City)

    # The stream ends with response.completed, or response.incomplete where the answer reached
    # max_output_tokens (the SDK's get_final_response() takes the first only).
    text, final = "", None
    with c.responses.stream(model=MODEL, input="Say hello.", max_output_tokens=30,
                            temperature=0) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                text += event.delta
            elif event.type in ("response.completed", "response.incomplete"):
                final = event.response
    assert final is not None and final.status in ("completed", "incomplete")
    assert text and final.output_text == text == c.responses.retrieve(final.id).output_text

    weather = {"type": "function", "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
        "required": ["city"], "additionalProperties": False}}
    asked = c.responses.create(model=MODEL, input="What is the weather in Paris?",
                               tools=[weather], tool_choice="required", max_output_tokens=80,
                               temperature=0, parallel_tool_calls=False)
    [call] = [item for item in asked.output if item.type == "function_call"]
    assert json.loads(call.arguments)["city"]
    answered = c.responses.create(
        model=MODEL, previous_response_id=asked.id, tools=[weather], max_output_tokens=40,
        temperature=0, input=[{"type": "function_call_output", "call_id": call.call_id,
                               "output": json.dumps({"celsius": 21})}])
    assert answered.status in ("completed", "incomplete") and answered.output_text
    assert answered.usage.input_tokens > asked.usage.input_tokens
