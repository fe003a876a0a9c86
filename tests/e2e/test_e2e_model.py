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
