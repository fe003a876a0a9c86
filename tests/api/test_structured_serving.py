"""Structured outputs served end to end on the reference backend (fast lane): the REST API, an
in-process worker compiling and applying the grammar, the answer matching it, the refusals, and
the counts in ``/scheduler/stats`` and ``/metrics``."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tests.api.test_api import MODEL, error_of, post, post_stream, read_sse

pytestmark = pytest.mark.django_db

SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 1},
    "colour": {"enum": ["red", "green", "blue"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 2}},
    "required": ["id", "colour", "tags"], "additionalProperties": False}


def body(max_tokens: int = 120, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "give JSON"}],
            "max_tokens": max_tokens, **extra}


def json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema,
                                                   "strict": True}}


def test_each_kind_is_answered_within_its_grammar(client, tenant_key, inproc_worker):
    raw = tenant_key[2]
    answer = post(client, raw, body(response_format=json_schema_format(SCHEMA), seed=2)).json()
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "stop", answer
    jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
    assert answer["usage"]["completion_tokens"] >= len(choice["message"]["content"]) // 8

    any_object = post(client, raw, body(response_format={"type": "json_object"})).json()
    if any_object["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(any_object["choices"][0]["message"]["content"]), dict)

    regex = post(client, raw, body(structured_outputs={"regex": "[0-9]{3}-[a-z]{2}"})).json()
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", regex["choices"][0]["message"]["content"])
    choice = post(client, raw, body(structured_outputs={"choice": ["yes", "no"]})).json()
    assert choice["choices"][0]["message"]["content"] in ("yes", "no")
    lark = post(client, raw, body(structured_outputs={
        "grammar": 'start: "n=" /[0-9]{2}/'})).json()
    assert re.fullmatch("n=[0-9]{2}", lark["choices"][0]["message"]["content"])

    # Room for the longest answer the schema allows but for its integer, which the seed keeps short.
    completion = post(client, raw, {"model": MODEL, "prompt": "x", "max_tokens": 200, "seed": 1,
                                    "response_format": json_schema_format(SCHEMA)},
                      path="/v1/completions").json()
    assert completion["choices"][0]["finish_reason"] == "stop", completion
    jsonschema.validate(json.loads(completion["choices"][0]["text"]), SCHEMA)


def test_a_streamed_constrained_answer_is_the_same_text(client, tenant_key, inproc_worker):
    raw = tenant_key[2]
    request = body(response_format=json_schema_format(SCHEMA), seed=3, temperature=0.9)
    whole = post(client, raw, request).json()["choices"][0]["message"]["content"]
    _, content = post_stream(raw, {**request, "stream": True})
    chunks = [json.loads(frame) for frame in read_sse(content) if frame != "[DONE]"]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == whole
    jsonschema.validate(json.loads(text), SCHEMA)


def test_a_grammar_the_worker_cannot_compile_is_a_400_and_counted(client, tenant_key,
                                                                   inproc_worker, settings):
    # Passes the web tier's check (which builds no lexer), fails the worker's compile fuel.
    inproc_worker.engine.grammars._limits = __import__("llguidance").LLParserLimits(
        initial_lexer_fuel=2_000)
    enum = {"enum": [f"value-{i}" for i in range(400)]}
    refused = post(client, tenant_key[2], body(response_format=json_schema_format(enum)))
    assert refused.status_code == 400, refused.content
    error = error_of(refused)
    assert error["param"] == "response_format.json_schema.schema"
    assert "limit" in error["message"]
    ok = post(client, tenant_key[2], body(max_tokens=8))
    assert ok.status_code == 200
    stats = inproc_worker.engine.stats()["structured"]
    assert stats["compile_refusals_by_reason"] == {"limit": 1}


def test_structured_counts_reach_the_stats_and_the_metrics(client, admin_client, tenant_key,
                                                          inproc_worker):
    from prometheus_client.parser import text_string_to_metric_families

    raw = tenant_key[2]
    for _ in range(2):  # the second finds the grammar compiled
        assert post(client, raw, body(response_format=json_schema_format(SCHEMA))).status_code \
            == 200
    inproc_worker.bridge.publish_stats(60)
    stats = admin_client.get("/scheduler/stats").json()
    structured = stats["total"]["structured"]
    assert structured["constrained_requests"] == 2 and structured["compile_cache_hits"] == 1
    assert structured["forced_tokens"] > 0
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(
                   admin_client.get("/metrics").content.decode())
               for s in family.samples}
    assert samples[("llm_structured_requests_total", (("worker", "inproc"),))] == 2
    assert samples[("llm_grammar_cache_hits_total", (("worker", "inproc"),))] == 1
    page = admin_client.get("/admin/scheduler/")
    assert b"m-constrained_requests" in page.content


@pytest.mark.parametrize("field, value", [("stop", ["}"]), ("stop", "x"), ("min_tokens", 5),
                                          ("ignore_eos", True)])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_fields_a_grammar_cannot_honour_are_refused_beside_it(client, tenant_key, field, value,
                                                              path):
    request = body(response_format=json_schema_format(SCHEMA), **{field: value})
    if path == "/v1/completions":
        request = {"model": MODEL, "prompt": "x", "max_tokens": 20,
                   "structured_outputs": {"regex": "[0-9]+"}, field: value}
    refused = post(client, tenant_key[2], request, path=path)
    assert refused.status_code == 400, refused.content
    error = error_of(refused)
    assert error["param"] == field and error["code"] == "unsupported_parameter"


@pytest.mark.parametrize("schema, param", [
    ({"type": "object", "properties": {"a": {"type": "number", "maximum": float("inf")}}},
     "response_format.json_schema.schema"),
    ({"type": "object", "x-guidance": {"lenient": True}, "if": {"required": ["a"]}},
     "response_format.json_schema.schema"),
])
def test_schemas_the_server_cannot_write_or_would_apply_in_part_get_400(client, tenant_key,
                                                                        schema, param):
    raw = json.dumps(body(response_format=json_schema_format(schema))).replace(
        "Infinity", "1e400")
    refused = post(client, tenant_key[2], raw)
    assert refused.status_code == 400, refused.content
    error = error_of(refused)
    assert error["param"] == param and error["code"] == "invalid_json_schema"


def test_an_answer_that_completes_its_grammar_on_its_last_token_stops(client, tenant_key,
                                                                      inproc_worker):
    """A choice whose last allowed token completes it ends ``stop``, not ``length``."""
    for word in ("yes", "maybe"):
        answer = post(client, tenant_key[2], body(max_tokens=len(word),
                                                  structured_outputs={"choice": [word]})).json()
        choice = answer["choices"][0]
        assert (choice["message"]["content"], choice["finish_reason"]) == (word, "stop")
        assert answer["usage"]["completion_tokens"] == len(word)  # bytes: the backend's tokens
