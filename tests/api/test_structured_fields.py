"""Structured outputs in the REST API: OpenAI's ``response_format`` and vLLM's
``structured_outputs`` reach the worker as a :class:`StructuredOutput` in the request's sampling
settings, and what the grammar library cannot apply is a 400 naming the field
(``docs/platform.md``, "Structured outputs"). No model and no worker needed: what the worker
would be sent is caught at admission, and every refusal comes before it.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from api.schemas import ChatCompletionRequest, CompletionRequest, validate
from gateway.errors import APIError
from inference.protocol.messages import RequestMessage, Sampling
from inference.protocol.settings import PlatformSettings
from inference.protocol.structured import DEFAULT_MAX_SPEC_BYTES, StructuredOutput
from tests.api.test_api import CHAT, MODEL, error_of, post

pytestmark = pytest.mark.django_db

TEXT = "/v1/completions"
BASE = {CHAT: {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}],
               "max_tokens": 2},
        TEXT: {"model": MODEL, "prompt": "Once upon", "max_tokens": 2}}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer", "minimum": 0}},
          "required": ["name"], "additionalProperties": False}
COMPACT = json.dumps(SCHEMA, separators=(",", ":"))


def json_schema(schema=None, **fields) -> dict:
    inner = {"name": "person", **({"schema": schema} if schema is not None else {}), **fields}
    return {"type": "json_schema", "json_schema": inner}


# Each shape accepted, and what the worker is asked: (kind, spec, param).
ACCEPTED = [
    ({"response_format": {"type": "json_object"}}, ("json_object", "", "response_format")),
    ({"response_format": json_schema(SCHEMA)},
     ("json_schema", COMPACT, "response_format.json_schema.schema")),
    ({"response_format": json_schema(SCHEMA, description="A person.", strict=True)},
     ("json_schema", COMPACT, "response_format.json_schema.schema")),
    ({"response_format": json_schema(SCHEMA, strict=None, description=None)},
     ("json_schema", COMPACT, "response_format.json_schema.schema")),
    # No schema: any JSON object (api.structured_fields says why).
    ({"response_format": json_schema()}, ("json_object", "", "response_format.json_schema")),
    ({"structured_outputs": {"json": SCHEMA}}, ("json_schema", COMPACT, "structured_outputs.json")),
    ({"structured_outputs": {"json": json.dumps(SCHEMA, indent=2)}},
     ("json_schema", COMPACT, "structured_outputs.json")),
    ({"structured_outputs": {"regex": r"\d{3}-[a-z]+"}},
     ("regex", r"\d{3}-[a-z]+", "structured_outputs.regex")),
    ({"structured_outputs": {"choice": ["yes", "no", "maybe"]}},
     ("choice", '["yes","no","maybe"]', "structured_outputs.choice")),
    ({"structured_outputs": {"grammar": 'start: "yes" | "no"'}},
     ("grammar", 'start: "yes" | "no"', "structured_outputs.grammar")),
    ({"structured_outputs": {"grammar": 'root ::= "yes" | "no"'}},
     ("grammar", 'root ::= "yes" | "no"', "structured_outputs.grammar")),
    # vLLM's other keys, where they ask for nothing; a text response format beside.
    ({"structured_outputs": {"regex": "a+", "whitespace_pattern": None, "json_object": False,
                             "disable_fallback": True, "disable_any_whitespace": False,
                             "disable_additional_properties": False, "structural_tag": None}},
     ("regex", "a+", "structured_outputs.regex")),
    ({"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "text"}},
     ("choice", '["a"]', "structured_outputs.choice")),
]
UNCONSTRAINED = [{}, {"response_format": {"type": "text"}}, {"response_format": None},
                 {"structured_outputs": None},
                 {"response_format": None, "structured_outputs": None}]


def sampling(path: str, fields: dict) -> Sampling:
    """The sampling settings sent to the worker for ``fields`` (as ``api.views`` builds them)."""
    req = validate(ChatCompletionRequest if path == CHAT else CompletionRequest,
                   {**BASE[path], **fields})
    return Sampling(**req.sampling(req.requested_max_tokens))


@pytest.mark.parametrize("path", [CHAT, TEXT])
@pytest.mark.parametrize(("fields", "expected"), ACCEPTED,
                         ids=[json.dumps(f)[:60] for f, _ in ACCEPTED])
def test_each_shape_asks_the_worker_for_its_structured_output(path, fields, expected):
    kind, spec, param = expected
    assert sampling(path, fields).structured == StructuredOutput(kind=kind, spec=spec,
                                                                 param=param)


@pytest.mark.parametrize("path", [CHAT, TEXT])
@pytest.mark.parametrize("fields", UNCONSTRAINED, ids=[json.dumps(f) for f in UNCONSTRAINED])
def test_no_structured_output_asked_is_an_unconstrained_answer(path, fields):
    assert sampling(path, fields) == sampling(path, {})
    assert sampling(path, fields).structured is None


@pytest.fixture
def dispatched(monkeypatch, live_worker, settings) -> list[RequestMessage]:
    """The request messages admitted for the workers, as they cross Redis (nobody answers: each
    request ends with a 504 after 0.3 s)."""
    from gateway import admission

    settings.LLM_PLATFORM = {**settings.LLM_PLATFORM, "REQUEST_IDLE_TIMEOUT_S": 0.3}
    messages: list[RequestMessage] = []
    real_admit = admission.admit

    async def admit(*args, **kwargs):
        message = await real_admit(*args, **kwargs)
        messages.append(RequestMessage.from_json(message.to_json()))
        return message

    monkeypatch.setattr(admission, "admit", admit)
    return messages


@pytest.mark.parametrize(("path", "fields", "expected"), [
    (CHAT, {"response_format": json_schema(SCHEMA)},
     ("json_schema", COMPACT, "response_format.json_schema.schema")),
    (TEXT, {"response_format": {"type": "json_object"}}, ("json_object", "", "response_format")),
    (CHAT, {"structured_outputs": {"choice": ["yes", "no"]}, "stream": True},
     ("choice", '["yes","no"]', "structured_outputs.choice")),
    (TEXT, {"structured_outputs": {"regex": "[0-9]+"}},
     ("regex", "[0-9]+", "structured_outputs.regex")),
])
def test_the_request_message_carries_the_structured_output(client, tenant_key, dispatched, path,
                                                           fields, expected):
    client.raise_request_exception = False
    post(client, tenant_key[2], {**BASE[path], **fields}, path=path)
    [message] = dispatched
    kind, spec, param = expected
    assert message.sampling.structured == StructuredOutput(kind=kind, spec=spec, param=param)


# -- refused: a 400 naming the field, before the request is queued ------------------------------

IF_THEN = {"type": "object", "if": {"properties": {"a": {"const": 1}}},
           "then": {"required": ["b"]}}
REFUSED = [
    # The grammar library cannot apply the spec.
    (CHAT, {"response_format": json_schema(IF_THEN)}, "invalid_json_schema",
     "response_format.json_schema.schema", ["'if'", "'then'"]),
    (TEXT, {"structured_outputs": {"json": IF_THEN}}, "invalid_json_schema",
     "structured_outputs.json", ["'if'", "'then'"]),
    (CHAT, {"response_format": json_schema({"type": "string", "format": "ipv5-address"})},
     "invalid_json_schema", "response_format.json_schema.schema", ["format", "ipv5-address"]),
    (CHAT, {"structured_outputs": {"regex": "[a-z"}}, "invalid_structured_output",
     "structured_outputs.regex", ["regular expression", "unclosed character class"]),
    (TEXT, {"structured_outputs": {"regex": "(?=a)b"}}, "invalid_structured_output",
     "structured_outputs.regex", ["look-around"]),
    (CHAT, {"structured_outputs": {"grammar": "start: undefined_rule"}},
     "invalid_structured_output", "structured_outputs.grammar", ["undefined_rule"]),
    (TEXT, {"structured_outputs": {"grammar": "this is no grammar ::: at all"}},
     "invalid_structured_output", "structured_outputs.grammar", ["neither a Lark grammar"]),
    (CHAT, {"structured_outputs": {"json": "{not json"}}, "invalid_json_schema",
     "structured_outputs.json", ["not JSON text"]),
    (CHAT, {"structured_outputs": {"json": "[1, 2]"}}, "invalid_json_schema",
     "structured_outputs.json", ["JSON Schema object"]),
    (CHAT, {"structured_outputs": {"json": {"enum": ["\ud800"]}}}, "invalid_json_schema",
     "structured_outputs.json", ["not valid Unicode text"]),
    # llguidance 1.9.1 panics on this one (its error message cut inside the 'é').
    (CHAT, {"response_format": json_schema({"type": "string", "pattern": ["x" * 97 + "é"]})},
     "invalid_json_schema", "response_format.json_schema.schema", ["grammar library failed"]),
    # Shapes.
    (CHAT, {"structured_outputs": {"choice": ["yes", 1]}}, "invalid_value",
     "structured_outputs.choice[1]", ["expected a string"]),
    (CHAT, {"structured_outputs": {"choice": []}}, "invalid_value", "structured_outputs.choice",
     ["at least 1 item"]),
    (CHAT, {"structured_outputs": {"choice": ["yes", ""]}}, "invalid_value",
     "structured_outputs.choice[1]", []),
    (CHAT, {"structured_outputs": {}}, "invalid_value", "structured_outputs",
     ["exactly one of 'json', 'regex', 'choice', 'grammar'", "got none"]),
    (TEXT, {"structured_outputs": {"regex": None}}, "invalid_value", "structured_outputs",
     ["got none"]),
    (CHAT, {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "invalid_value",
     "structured_outputs", ["got 'regex', 'choice'"]),
    (TEXT, {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
     "invalid_value", "structured_outputs", ["'response_format'", "give one"]),
    (CHAT, {"structured_outputs": {"json": SCHEMA}, "response_format": json_schema(SCHEMA)},
     "invalid_value", "structured_outputs", ["give one"]),
    (CHAT, {"structured_outputs": {"json": 5}}, "invalid_value", "structured_outputs.json",
     ["an object (a JSON Schema) or a string"]),
    (CHAT, {"structured_outputs": ["regex"]}, "invalid_value", "structured_outputs",
     ["expected an object"]),
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
     "invalid_value", "response_format.json_schema.name", ["is required"]),
    (TEXT, {"response_format": json_schema(SCHEMA, name="a person")}, "invalid_value",
     "response_format.json_schema.name", ["1 to 64 characters"]),
    (CHAT, {"response_format": json_schema(SCHEMA, name="x" * 65)}, "invalid_value",
     "response_format.json_schema.name", ["1 to 64 characters"]),
    (CHAT, {"response_format": {"type": "json_schema"}}, "invalid_value",
     "response_format.json_schema", ["is required"]),
    (CHAT, {"response_format": json_schema([SCHEMA])}, "invalid_value",
     "response_format.json_schema.schema", ["expected an object"]),
    (CHAT, {"response_format": json_schema(SCHEMA, strict="yes")}, "invalid_value",
     "response_format.json_schema.strict", ["a boolean"]),
    (CHAT, {"response_format": {"type": "xml"}}, "invalid_value", "response_format.type",
     ["'json_schema'"]),
    # Unknown keys inside.
    (CHAT, {"response_format": json_schema(SCHEMA, examples=[])}, "unknown_parameter",
     "response_format.json_schema.examples", ["Unrecognized request argument"]),
    (TEXT, {"response_format": {"type": "json_object", "schema": SCHEMA}}, "unknown_parameter",
     "response_format.schema", []),
    (CHAT, {"response_format": {"type": "text", "json_schema": {"name": "x"}}},
     "unknown_parameter", "response_format.json_schema", []),
    (CHAT, {"structured_outputs": {"regex": "a", "pattern": "b"}}, "unknown_parameter",
     "structured_outputs.pattern", []),
    # vLLM's keys not served.
    (CHAT, {"structured_outputs": {"json": SCHEMA, "whitespace_pattern": " "}},
     "unsupported_parameter", "structured_outputs.whitespace_pattern", []),
    (TEXT, {"structured_outputs": {"json_object": True}}, "unsupported_parameter",
     "structured_outputs.json_object", ['"json_object"']),
    (CHAT, {"structured_outputs": {"json": SCHEMA, "disable_additional_properties": True}},
     "unsupported_parameter", "structured_outputs.disable_additional_properties",
     ["additionalProperties"]),
    (CHAT, {"structured_outputs": {"structural_tag": "{}"}}, "unsupported_parameter",
     "structured_outputs.structural_tag", []),
]


@pytest.mark.parametrize(("path", "fields", "code", "param", "words"), REFUSED,
                         ids=[f"{code}-{param}-{i}" for i, (_, _, code, param, _)
                              in enumerate(REFUSED)])
def test_a_structured_output_the_server_cannot_apply_gets_400_naming_the_field(
        client, tenant_key, path, fields, code, param, words):
    response = post(client, tenant_key[2], {**BASE[path], **fields}, path=path)
    assert response.status_code == 400
    error = error_of(response)
    assert (error["code"], error["param"], error["type"]) == (code, param,
                                                              "invalid_request_error")
    for word in words:
        assert word in error["message"], (word, error["message"])


@pytest.mark.parametrize("name", ["guided_json", "guided_regex", "guided_choice",
                                  "guided_grammar", "guided_decoding_backend",
                                  "guided_whitespace_pattern"])
def test_vllms_old_guided_fields_point_to_the_new_ones(client, tenant_key, name):
    response = post(client, tenant_key[2], {**BASE[CHAT], name: "x"})
    error = error_of(response)
    assert (response.status_code, error["code"], error["param"]) == (
        400, "unsupported_parameter", name)
    assert "'response_format'" in error["message"]
    assert "'structured_outputs'" in error["message"]


# -- the size limit: STRUCTURED_MAX_SPEC_BYTES ---------------------------------------------------

def test_the_size_limit_is_a_shared_setting_with_the_protocols_default(settings, monkeypatch):
    assert settings.LLM_PLATFORM["STRUCTURED_MAX_SPEC_BYTES"] == DEFAULT_MAX_SPEC_BYTES
    monkeypatch.setenv("STRUCTURED_MAX_SPEC_BYTES", "1000")
    assert PlatformSettings(_env_file=None).structured_max_spec_bytes == 1000


@pytest.mark.parametrize(("path", "fields", "code", "param"), [
    (CHAT, {"response_format": json_schema(SCHEMA)}, "invalid_json_schema",
     "response_format.json_schema.schema"),
    (TEXT, {"structured_outputs": {"json": SCHEMA}}, "invalid_json_schema",
     "structured_outputs.json"),
    (CHAT, {"structured_outputs": {"regex": "a" * 200}}, "invalid_structured_output",
     "structured_outputs.regex"),
    (TEXT, {"structured_outputs": {"choice": [f"choice {i}" for i in range(30)]}},
     "invalid_structured_output", "structured_outputs.choice"),
])
def test_a_spec_over_the_size_limit_gets_400(client, tenant_key, settings, path, fields, code,
                                             param):
    settings.LLM_PLATFORM = {**settings.LLM_PLATFORM, "STRUCTURED_MAX_SPEC_BYTES": 100}
    response = post(client, tenant_key[2], {**BASE[path], **fields}, path=path)
    error = error_of(response)
    assert (response.status_code, error["code"], error["param"]) == (400, code, param)
    assert "limit of 100 bytes" in error["message"]


def test_a_spec_within_the_limit_counts_the_schema_as_compact_json(settings):
    settings.LLM_PLATFORM = {**settings.LLM_PLATFORM, "STRUCTURED_MAX_SPEC_BYTES": len(COMPACT)}
    spaced = {"structured_outputs": {"json": json.dumps(SCHEMA, indent=4)}}
    assert sampling(CHAT, spaced).structured.spec == COMPACT
    settings.LLM_PLATFORM = {**settings.LLM_PLATFORM,
                             "STRUCTURED_MAX_SPEC_BYTES": len(COMPACT) - 1}
    with pytest.raises(APIError) as refused:
        sampling(CHAT, spaced)
    assert refused.value.code == "invalid_json_schema"


def test_a_schema_nested_too_deeply_gets_400_not_500(client, tenant_key):
    schema: dict = {"type": "object"}
    for _ in range(300):
        schema = {"type": "object", "properties": {"a": schema}}
    response = post(client, tenant_key[2],
                    {**BASE[CHAT], "response_format": json_schema(schema)})
    assert response.status_code == 400
    assert error_of(response)["code"] in ("invalid_json_schema", "invalid_json")


# -- any value: a request or a 400 naming the field, never another error ------------------------

KEYS = st.sampled_from(["type", "json_schema", "name", "schema", "strict", "description", "json",
                        "regex", "choice", "grammar", "whitespace_pattern", "json_object",
                        "properties", "items", "format", "pattern", "enum", "x"])
LEAVES = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.floats(allow_nan=False),
                   st.text(max_size=8), st.sampled_from([
                       "\ud800", "text", "json_object", "json_schema", "object", "string",
                       "[a-z", "a+", 'start: "a"', "root ::= x", "{}", '{"type": "object"}']))
VALUES = st.recursive(LEAVES, lambda children: st.lists(children, max_size=3)
                      | st.dictionaries(KEYS, children, max_size=4), max_leaves=12)


@hypothesis_settings(max_examples=300, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow,
                                            HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(["response_format", "structured_outputs"]), value=VALUES,
       path=st.sampled_from([CHAT, TEXT]))
def test_any_value_is_served_or_refused_naming_its_field(field, value, path):
    try:
        structured = sampling(path, {field: value}).structured
    except APIError as exc:
        assert exc.status == 400 and exc.param is not None, exc.message
        assert exc.param == field or exc.param.startswith((f"{field}.", f"{field}[")), exc.param
        return
    assert structured is None or structured.param.startswith(field)


PATTERN_TEXT = st.text(alphabet=st.sampled_from(list("ab()[]{}|*+?.^$\\-/dws0,:=!<>#\"' \né")),
                       max_size=16)
SCHEMA_KEYS = st.sampled_from(["type", "properties", "items", "required", "enum", "const",
                               "pattern", "format", "minimum", "maxLength", "anyOf", "$ref",
                               "$defs", "additionalProperties", "if", "x"])
SCHEMA_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-5, 5), PATTERN_TEXT,
              st.sampled_from(["object", "string", "integer", "array", "date-time", "#/$defs/a"])),
    lambda children: st.lists(children, max_size=3)
    | st.dictionaries(SCHEMA_KEYS, children, max_size=4), max_leaves=12)
CONSTRAINTS = st.one_of(
    st.builds(lambda v: {"json": v}, st.dictionaries(SCHEMA_KEYS, SCHEMA_VALUES, max_size=4)),
    st.builds(lambda v: {"regex": v}, PATTERN_TEXT),
    st.builds(lambda v: {"grammar": v}, st.one_of(PATTERN_TEXT, PATTERN_TEXT.map("start: ".__add__),
                                                  PATTERN_TEXT.map("root ::= ".__add__))),
    st.builds(lambda v: {"choice": v}, st.lists(PATTERN_TEXT, max_size=4)),
)


@hypothesis_settings(max_examples=300, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow,
                                            HealthCheck.function_scoped_fixture])
@given(value=CONSTRAINTS)
def test_any_spec_is_served_or_refused_by_the_checks_naming_its_field(value):
    [key] = value
    try:
        structured = sampling(CHAT, {"structured_outputs": value}).structured
    except APIError as exc:
        assert exc.status == 400
        assert exc.param == "structured_outputs" or exc.param.startswith(
            f"structured_outputs.{key}"), exc.param
        return
    assert structured.param == f"structured_outputs.{key}"
