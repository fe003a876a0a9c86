"""No field is accepted and ignored when it would change the answer.

Every top-level field of both endpoints is in one of four classes (``docs/platform.md``, "Request
fields, by what the server does with them"): (a) honoured, (b) OpenAI fields that do not change
the answer, accepted, (c) OpenAI fields (and vLLM's old guided decoding) that would change the
answer and are not served, a 400 ``unsupported_parameter``, (d) unknown fields, a 400
``unknown_parameter``. The classes are written out here, one list each, so that a field moved
from one class to another fails a test; OpenAI's own list (the ``openai`` package's typed request
parameters) must be covered by them. Messages: every field of OpenAI's message schema is
accepted for its role; tool calls, tool messages, image and audio parts are refused, naming the
field's path.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import openai
import pytest
from asgiref.sync import async_to_sync
from django.test import AsyncClient
from openai.types import completion_create_params as text_params
from openai.types.chat import ChatCompletionMessage
from openai.types.chat import completion_create_params as chat_params

from api.schemas import ChatCompletionRequest, CompletionRequest, validate
from tests.api.test_api import CHAT, MODEL, error_of, post
from tests.api.test_nullable_fields import in_process

pytestmark = pytest.mark.django_db

TEXT = "/v1/completions"
DOCS = Path(__file__).resolve().parents[2] / "docs" / "platform.md"
USER = {"role": "user", "content": "Hello"}
BASE = {CHAT: {"model": MODEL, "messages": [USER]}, TEXT: {"model": MODEL, "prompt": "Once upon"}}
SCHEMA = {CHAT: ChatCompletionRequest, TEXT: CompletionRequest}

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
# (a) honoured: a value that is not the default, with the fields it needs beside it.
HONOURED = {
    CHAT: {"max_tokens": (3, {}), "max_completion_tokens": (3, {"max_tokens": None}),
           "temperature": (0.5, {}),
           "top_p": (0.5, {}), "seed": (7, {}), "stop": (["x"], {}), "stream": (True, {}),
           "stream_options": ({"include_usage": True}, {"stream": True}), "logprobs": (True, {}),
           "top_logprobs": (2, {"logprobs": True}), "user": ("u1", {}), "top_k": (5, {}),
           "min_tokens": (1, {}), "ignore_eos": (True, {}), "n": (2, {}), "tools": ([TOOL], {}),
           "tool_choice": ("required", {"tools": [TOOL]}),
           "parallel_tool_calls": (False, {"tools": [TOOL]})},
    TEXT: {"max_tokens": (3, {}), "temperature": (0.5, {}), "top_p": (0.5, {}), "seed": (7, {}),
           "stop": (["x"], {}), "stream": (True, {}),
           "stream_options": ({"include_usage": True}, {"stream": True}), "logprobs": (2, {}),
           "echo": (True, {}), "user": ("u1", {}), "top_k": (5, {}), "min_tokens": (1, {}),
           "ignore_eos": (True, {}), "n": (2, {})},
}
# Honoured too, but with no value that differs from leaving them out: the request's own.
HONOURED_AS_IS = {CHAT: ["model", "messages"], TEXT: ["model", "prompt"]}
# Honoured: structured outputs, on both endpoints (tests/api/test_structured_fields.py has their
# shapes; here, only that each changes what the worker is asked).
STRUCTURED = {"response_format": {"type": "json_object"},
              "structured_outputs": {"choice": ["yes", "no"]}}
# (b) accepted, and the answer is the same.
COMMON_ACCEPTED = {
    "store": True, "metadata": {"project": "alpha", "run": "7"}, "service_tier": "flex",
    "prompt_cache_key": "conversation-1", "prompt_cache_retention": "24h",
    "prompt_cache_options": {"mode": "implicit", "ttl": "30m"}, "safety_identifier": "user-hash",
}
ACCEPTED = {CHAT: COMMON_ACCEPTED, TEXT: COMMON_ACCEPTED}
# (c) not served: a value that asks for something, and the values that ask for nothing.
GUIDED = {"guided_json": {"type": "object"}, "guided_regex": "[a-z]+",
          "guided_choice": ["yes", "no"], "guided_grammar": "root ::= 'a'",
          "guided_decoding_backend": "xgrammar", "guided_whitespace_pattern": " "}
COMMON_UNSERVED = {
    "logit_bias": ({"42": 5}, [{}]), "presence_penalty": (0.5, [0, 0.0]),
    "frequency_penalty": (-0.5, [0, 0.0]),
}
UNSERVED = {
    CHAT: {**COMMON_UNSERVED, "functions": ([TOOL["function"]], [[]]),
           "function_call": ("auto", ["none"]),
           "audio": ({"voice": "alloy", "format": "wav"}, []),
           "modalities": (["text", "audio"], [["text"]]),
           "prediction": ({"type": "content", "content": "Hello"}, []),
           "reasoning_effort": ("high", ["none"]), "verbosity": ("low", []),
           "web_search_options": ({}, []),
           "moderation": ({"model": "omni-moderation-latest"}, [])},
    TEXT: {**COMMON_UNSERVED, "suffix": (" the end.", [""]), "best_of": (3, [1])},
}
# (d) unknown: vLLM's other extensions, misspellings, the other endpoint's fields.
UNKNOWN = {
    CHAT: ["repetition_penalty", "min_p", "use_beam_search", "skip_special_tokens",
           "chat_template", "add_generation_prompt", "echo", "prompt", "suffix", "best_of",
           "max_token", "Temperature", "some_future_field", "str", "a b"],
    TEXT: ["repetition_penalty", "min_p", "messages", "tools", "tool_choice",
           "max_completion_tokens", "top_logprobs", "parallel_tool_calls", "modalities",
           "some_future_field"],
}
OPENAI_FIELDS = {
    CHAT: set(chat_params.CompletionCreateParamsStreaming.__annotations__)
    | set(chat_params.CompletionCreateParamsNonStreaming.__annotations__),
    TEXT: set(text_params.CompletionCreateParamsStreaming.__annotations__)
    | set(text_params.CompletionCreateParamsNonStreaming.__annotations__),
}


def case(path, fields):
    return [pytest.param(path, name, id=f"{path.rsplit('/', 1)[1]}-{name}") for name in fields]


def asked(path: str, body: dict) -> dict:
    """What the worker is asked for (as ``api.views`` builds it) for ``body``."""
    req = validate(SCHEMA[path], body)
    return {"sampling": req.sampling(req.requested_max_tokens), "model": req.model,
            "input": [m.as_dict() for m in req.messages] if path == CHAT else req.prompt,
            "stream": req.stream, "include_usage": req.include_usage,
            "logprobs": req.token_logprobs, "echo": req.echoed_prompt, "user": req.user,
            "tools": req.prompt_tools if path == CHAT else None}


def answer(raw_key: str, path: str, body: dict):
    """(status, the answer's text or the error): streamed or not, read to the end."""

    async def go():
        response = await AsyncClient().post(path, json.dumps(body),
                                            content_type="application/json",
                                            headers={"Authorization": f"Bearer {raw_key}"})
        if not response.streaming:
            return response.status_code, response.json()
        content = b"".join([part async for part in response.streaming_content])
        return response.status_code, content.decode()

    status, content = async_to_sync(go)()
    if status != 200 or isinstance(content, str):
        return status, content
    choice = content["choices"][0]
    return status, choice["message"]["content"] if path == CHAT else choice["text"]


def sent(path: str, **fields) -> dict:
    """A request of ``path`` with a short greedy answer, and ``fields``."""
    return {**BASE[path], "max_tokens": 2, "temperature": 0, **fields}


# -- the classes cover OpenAI's request schema, and the documentation says the same -------------

@pytest.mark.parametrize("path", [CHAT, TEXT])
def test_every_openai_field_is_in_one_class(path):
    classes = [set(HONOURED[path]) | set(HONOURED_AS_IS[path]) | set(STRUCTURED),
               set(ACCEPTED[path]), set(UNSERVED[path]) - {"n"}]
    assert OPENAI_FIELDS[path] - set().union(*classes) == set()
    assert not set(UNKNOWN[path]) & OPENAI_FIELDS[path]
    for i, one in enumerate(classes):
        for other in classes[i + 1:]:
            assert one & other == set()


def _documented() -> dict[str, list[str]]:
    """The rows of the documentation's table of classes: their cells, by class letter."""
    section = DOCS.read_text().split("### Request fields, by what the server does with them")[1]
    rows = {}
    [table] = [chunk for chunk in section.split("\n\n") if chunk.startswith("| class |")]
    for line in table.splitlines():
        if match := re.match(r"\| \(([abcd])\) [a-z ]+\| (.*)", line):
            rows[match[1]] = match[2].split(" | ")
    return rows


@pytest.mark.parametrize(("path", "column"), [(CHAT, 0), (TEXT, 1)])
def test_the_documented_classes_are_the_served_ones(path, column):
    docs = {letter: cells[column] for letter, cells in _documented().items()}
    named = {letter: set(re.findall(r"`([a-z_]+)`", cell)) for letter, cell in docs.items()}
    if path == TEXT:  # "the same but ..." and "vLLM's guided fields, as for chat"
        chat_docs = {letter: cells[0] for letter, cells in _documented().items()}
        named["b"] = set(re.findall(r"`([a-z_]+)`", chat_docs["b"])) - {"parallel_tool_calls"}
        named["c"] |= set(GUIDED)
    assert set(HONOURED[path]) | set(HONOURED_AS_IS[path]) | set(STRUCTURED) <= named["a"]
    assert set(ACCEPTED[path]) <= named["b"]
    assert set(UNSERVED[path]) | set(GUIDED) <= named["c"]


# -- (a) honoured -----------------------------------------------------------------------------

@pytest.mark.parametrize(("path", "name"), case(CHAT, HONOURED[CHAT]) + case(TEXT, HONOURED[TEXT]))
def test_an_honoured_field_changes_what_the_worker_is_asked(client, tenant_key, request, path,
                                                            name):
    # A prompt offering tools is longer than the small context of the plain fixture.
    request.getfixturevalue("inproc_worker_long" if "tool" in name else "inproc_worker")
    value, companions = HONOURED[path][name]
    without = {**BASE[path], **companions}
    assert asked(path, {**without, name: value}) != asked(path, without)
    body = {**sent(path, **companions), name: value}
    status, content = answer(tenant_key[2], path, body)
    assert status == 200, content


@pytest.mark.parametrize(("path", "name"), case(CHAT, STRUCTURED) + case(TEXT, STRUCTURED))
def test_a_structured_output_field_changes_what_the_worker_is_asked(path, name):
    assert asked(path, {**BASE[path], name: STRUCTURED[name]}) != asked(path, BASE[path])
    assert asked(path, {**BASE[path], name: None}) == asked(path, BASE[path])


# -- (b) accepted, the answer unchanged ---------------------------------------------------------

@pytest.mark.parametrize(("path", "name"), case(CHAT, ACCEPTED[CHAT]) + case(TEXT, ACCEPTED[TEXT]))
def test_an_accepted_field_leaves_the_answer_as_it_is(client, tenant_key, inproc_worker, path,
                                                      name):
    value = ACCEPTED[path][name]
    assert asked(path, {**BASE[path], name: value}) == asked(path, BASE[path])
    plain = answer(tenant_key[2], path, sent(path))
    with_field = answer(tenant_key[2], path, sent(path, **{name: value}))
    assert with_field == plain and plain[0] == 200


@pytest.mark.parametrize("path", [CHAT, TEXT])
def test_stream_options_take_include_obfuscation_false(client, tenant_key, inproc_worker, path):
    options = {"include_usage": True, "include_obfuscation": False}
    status, content = answer(tenant_key[2], path, sent(path, stream=True, stream_options=options))
    assert status == 200 and '"usage":{' in content and "obfuscation" not in content


@pytest.mark.parametrize(("path", "body", "param", "words"), [
    (CHAT, sent(CHAT, store="yes"), "store", "a boolean"),
    (CHAT, sent(CHAT, parallel_tool_calls=1), "parallel_tool_calls", "a boolean"),
    (TEXT, sent(TEXT, metadata={"run": 7}), "metadata.run", "a string"),
    (CHAT, sent(CHAT, metadata={f"k{i}": "v" for i in range(17)}), "metadata",
     "at most 16 key-value pairs"),
    (CHAT, sent(CHAT, metadata={"k" * 65: "v"}), "metadata", "longer than 64 characters"),
    (CHAT, sent(CHAT, metadata={"k": "v" * 513}), "metadata", "longer than 512 characters"),
    (CHAT, sent(CHAT, service_tier=["flex"]), "service_tier", "'auto'"),
    (TEXT, sent(TEXT, service_tier="bogus"), "service_tier", "'priority'"),
    (CHAT, sent(CHAT, prompt_cache_options={"mode": "always"}), "prompt_cache_options.mode",
     "'implicit'"),
])
def test_an_accepted_field_of_the_wrong_shape_gets_400(client, tenant_key, path, body, param,
                                                       words):
    response = post(client, tenant_key[2], body, path=path)
    assert response.status_code == 400
    error = error_of(response)
    assert (error["code"], error["param"]) == ("invalid_value", param)
    assert words in error["message"]


# -- (c) not served -----------------------------------------------------------------------------

@pytest.mark.parametrize(("path", "name"), case(CHAT, UNSERVED[CHAT]) + case(TEXT, UNSERVED[TEXT]))
def test_a_field_not_served_gets_400_naming_it(client, tenant_key, path, name):
    value, _ = UNSERVED[path][name]
    response = post(client, tenant_key[2], sent(path, **{name: value}), path=path)
    assert response.status_code == 400
    error = error_of(response)
    assert (error["code"], error["param"], error["type"]) == (
        "unsupported_parameter", name, "invalid_request_error")
    assert f"'{name}'" in error["message"]


@pytest.mark.parametrize(("path", "name"), case(CHAT, UNSERVED[CHAT]) + case(TEXT, UNSERVED[TEXT]))
def test_a_field_not_served_is_accepted_when_it_asks_for_nothing(path, name):
    _, neutral = UNSERVED[path][name]
    for value in [None, *neutral]:
        assert asked(path, {**BASE[path], name: value}) == asked(path, BASE[path]), value


@pytest.mark.parametrize(("path", "name"), case(CHAT, GUIDED) + case(TEXT, GUIDED))
def test_guided_decoding_gets_400_pointing_to_response_format(client, tenant_key, path, name):
    response = post(client, tenant_key[2], sent(path, **{name: GUIDED[name]}), path=path)
    assert response.status_code == 400
    error = error_of(response)
    assert (error["code"], error["param"]) == ("unsupported_parameter", name)
    assert "'response_format'" in error["message"] and "guided decoding" in error["message"]
    assert "'structured_outputs'" in error["message"]
    assert asked(path, {**BASE[path], name: None}) == asked(path, BASE[path])


@pytest.mark.parametrize("path", [CHAT, TEXT])
@pytest.mark.parametrize("stream", [False, None])
def test_stream_options_without_stream_is_a_400_naming_it(client, tenant_key, inproc_worker,
                                                           path, stream):
    # As OpenAI answers it: the options would be silently ignored.
    body = sent(path, stream_options={"include_usage": True})
    if stream is not None:
        body["stream"] = stream
    status, content = answer(tenant_key[2], path, body)
    assert status == 400, content
    error = content["error"]
    assert (error["param"], error["code"]) == ("stream_options", "invalid_value")
    assert "only allowed when 'stream' is enabled" in error["message"]
    assert answer(tenant_key[2], path, sent(path, stream_options=None))[0] == 200


def test_stream_options_include_obfuscation_true_is_not_served(client, tenant_key):
    body = sent(CHAT, stream=True, stream_options={"include_obfuscation": True})
    error = error_of(post(client, tenant_key[2], body))
    assert (error["code"], error["param"]) == (
        "unsupported_parameter", "stream_options.include_obfuscation")


# -- (d) unknown --------------------------------------------------------------------------------

@pytest.mark.parametrize(("path", "name"), case(CHAT, UNKNOWN[CHAT]) + case(TEXT, UNKNOWN[TEXT]))
@pytest.mark.parametrize("value", [1, None])
def test_an_unknown_field_gets_400_naming_it(client, tenant_key, path, name, value):
    response = post(client, tenant_key[2], sent(path, **{name: value}), path=path)
    assert response.status_code == 400
    error = error_of(response)
    assert (error["code"], error["param"], error["type"]) == (
        "unknown_parameter", name, "invalid_request_error")
    assert error["message"] == f"Unrecognized request argument supplied: {name}."


@pytest.mark.parametrize(("body", "param"), [
    (sent(CHAT, stream=True, stream_options={"include_usage": True, "chunk_size": 4}),
     "stream_options.chunk_size"),
    (sent(TEXT, prompt_cache_options={"mode": "explicit", "scope": "org"}),
     "prompt_cache_options.scope"),
    (sent(CHAT, **{"\ud800": 1}), "\\ud800"),
    (sent(CHAT, **{"x" * 1000: 1}), "x" * 64 + "..."),
])
def test_an_unknown_field_inside_an_object_or_of_an_odd_name_is_named(client, tenant_key, body,
                                                                      param):
    path = TEXT if "prompt" in body else CHAT
    error = error_of(post(client, tenant_key[2], body, path=path))
    assert (error["code"], error["param"]) == ("unknown_parameter", param)


# -- messages -----------------------------------------------------------------------------------

REPLY = {"role": "assistant", "content": "Hi there."}
# Fields frameworks send back, one message at a time, and the turn's text the model is given.
ECHOED = [
    ({**USER, "name": "ada"}, "Hello"),
    ({"role": "system", "content": "Be brief.", "name": "setup"}, "Be brief."),
    ({"role": "developer", "content": [{"type": "text", "text": "Be brief."}]}, "Be brief."),
    ({"role": "user", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo",
                                                                   "prompt_cache_breakpoint": {
                                                                       "mode": "explicit"}}]},
     "Hello"),
    ({**REPLY, "refusal": None}, "Hi there."),
    ({**REPLY, "annotations": []}, "Hi there."),
    ({**REPLY, "annotations": [{"type": "url_citation", "url_citation": {
        "url": "https://example.com", "title": "x", "start_index": 0, "end_index": 2}}]},
     "Hi there."),
    ({**REPLY, "audio": None}, "Hi there."),
    ({**REPLY, "function_call": None}, "Hi there."),
    ({**REPLY, "tool_calls": None}, "Hi there."),
    ({**REPLY, "tool_calls": []}, "Hi there."),
    ({**REPLY, "name": "bot"}, "Hi there."),
    ({"role": "assistant", "content": None}, ""),
    ({"role": "assistant"}, ""),
    ({"role": "assistant", "content": None, "refusal": "I cannot help with that."},
     "I cannot help with that."),
    ({"role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot."}]},
     "I cannot."),
    (ChatCompletionMessage(role="assistant", content="Hi there.").model_dump(), "Hi there."),
]


@pytest.mark.parametrize(("message", "text"), ECHOED,
                         ids=[f"{m['role']}-{'-'.join(sorted(set(m) - {'role'}))}"
                              for m, _ in ECHOED])
def test_every_field_of_an_openai_message_is_accepted(client, tenant_key, inproc_worker, message,
                                                      text):
    messages = [message, USER] if message["role"] != "user" else [message]
    [turn, *_] = asked(CHAT, {**BASE[CHAT], "messages": messages})["input"]
    assert turn["content"] == text
    status, _ = answer(tenant_key[2], CHAT, sent(CHAT, messages=messages))
    assert status == 200


def test_an_assistant_refusal_is_part_of_the_history():
    def history(reply):
        return asked(CHAT, {**BASE[CHAT], "messages": [USER, reply, USER]})["input"]

    refused = history({"role": "assistant", "content": None, "refusal": "No."})
    assert refused != history({"role": "assistant", "content": None})
    assert refused == history({"role": "assistant", "content": "No."})


CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize(("message", "param", "words"), [
    ({"role": "assistant", "content": None, "function_call": CALL["function"]},
     "messages[1].function_call", "function calling"),
    ({"role": "assistant", "content": None, "audio": {"id": "audio_1"}}, "messages[1].audio",
     "audio"),
    ({"role": "function", "content": "42", "name": "f"}, "messages[1].role",
     "'function' message"),
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]},
     "messages[1].content", "'messages[1].content[0]' is a content part of type 'image_url'"),
    ({"role": "user", "content": [{"type": "text", "text": "Hear this:"}, {
        "type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]},
     "messages[1].content", "'messages[1].content[1]' is a content part of type 'input_audio'"),
    ({"role": "user", "content": [{"type": "file", "file": {"file_id": "file-1"}}]},
     "messages[1].content", "type 'file'"),
])
def test_a_message_field_not_served_gets_400_naming_its_path(client, tenant_key, message, param,
                                                             words):
    response = post(client, tenant_key[2], sent(CHAT, messages=[USER, message, USER]))
    assert response.status_code == 400
    error = error_of(response)
    assert (error["code"], error["param"]) == ("unsupported_parameter", param)
    assert words in error["message"]


@pytest.mark.parametrize(("message", "param", "words"), [
    ({**USER, "refusal": "x"}, "messages[1].refusal",
     "a message of role 'user' has no such field"),
    ({**USER, "tool_call_id": None}, "messages[1].tool_call_id", "no such field"),
    ({**REPLY, "reasoning_content": "Let me think."}, "messages[1].reasoning_content",
     "a message of role 'assistant'"),
    ({"role": "system", "content": "Be brief.", "annotations": []}, "messages[1].annotations",
     "a message of role 'system'"),
    ({"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": {}}]},
     "messages[1].content", "messages[1].content[0].cache_control"),
])
def test_a_message_field_of_no_role_gets_400_naming_its_path(client, tenant_key, message, param,
                                                             words):
    response = post(client, tenant_key[2], sent(CHAT, messages=[USER, message, USER]))
    assert response.status_code == 400
    error = error_of(response)
    assert (error["code"], error["param"]) == ("unknown_parameter", param)
    assert "Unrecognized request argument supplied" in error["message"] and words in \
        error["message"]


@pytest.mark.parametrize(("message", "param"), [
    ({**REPLY, "refusal": 5}, "messages[1].refusal"),
    ({**REPLY, "annotations": "none"}, "messages[1].annotations"),
    ({"role": "user", "content": [{"type": "refusal", "refusal": "No."}]}, "messages[1].content"),
    ({"role": "user", "content": [{"type": "text", "text": "Hi",
                                   "prompt_cache_breakpoint": "yes"}]}, "messages[1].content"),
])
def test_a_message_field_of_the_wrong_shape_gets_400(client, tenant_key, message, param):
    response = post(client, tenant_key[2], sent(CHAT, messages=[USER, message, USER]))
    error = error_of(response)
    assert response.status_code == 400 and (error["code"], error["param"]) == (
        "invalid_value", param)


# -- the real openai client ---------------------------------------------------------------------

def test_the_openai_client_default_calls_and_its_replies_sent_back(tenant_key, inproc_worker):
    async def calls(client: openai.AsyncOpenAI):
        reply = await client.chat.completions.create(model=MODEL, messages=[USER], max_tokens=2)
        history = [USER, reply.choices[0].message.model_dump(), {**USER, "content": "Again"}]
        again = await client.chat.completions.create(model=MODEL, messages=history,
                                                     max_tokens=2)
        chunks = [chunk async for chunk in await client.chat.completions.create(
            model=MODEL, messages=history, max_tokens=2, stream=True,
            stream_options={"include_usage": True})]
        text = await client.completions.create(model=MODEL, prompt="Once upon", max_tokens=2,
                                               extra_body={"ignore_eos": True, "top_k": 5})
        return reply, again, chunks, text

    reply, again, chunks, text = in_process(tenant_key[2], calls)
    assert reply.usage.completion_tokens == again.usage.completion_tokens == 2
    assert again.usage.prompt_tokens > reply.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == 2
    assert text.usage.completion_tokens == 2


@pytest.mark.parametrize(("endpoint", "fields", "code", "param"), [
    ("chat", {"extra_body": {"guided_json": {"type": "object"}}}, "unsupported_parameter",
     "guided_json"),
    ("text", {"extra_body": {"guided_choice": ["yes", "no"]}}, "unsupported_parameter",
     "guided_choice"),
    ("chat", {"extra_body": {"repetition_penalty": 1.2}}, "unknown_parameter",
     "repetition_penalty"),
    ("chat", {"functions": [TOOL["function"]]}, "unsupported_parameter", "functions"),
    ("chat", {"tool_choice": "required"}, "invalid_value", "tool_choice"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "if": {}, "then": {}}}}},
     "invalid_json_schema", "response_format.json_schema.schema"),
    ("text", {"extra_body": {"structured_outputs": {"regex": "[a-z"}}},
     "invalid_structured_output", "structured_outputs.regex"),
    ("chat", {"messages": [USER, {"role": "assistant", "tool_calls": [CALL]},
                           {"role": "tool", "content": "{}", "tool_call_id": "call_2"}]},
     "invalid_value", "messages[2].tool_call_id"),
])
def test_the_openai_client_gets_a_400_naming_the_field(tenant_key, endpoint, fields, code, param):
    async def call(client: openai.AsyncOpenAI):
        try:
            if endpoint == "chat":
                await client.chat.completions.create(**{
                    "model": MODEL, "messages": [USER], "max_tokens": 2, **fields})
            else:
                await client.completions.create(model=MODEL, prompt="Once", max_tokens=2,
                                                **fields)
        except openai.BadRequestError as exc:
            return exc
        return None

    exc = in_process(tenant_key[2], call)
    assert exc is not None and exc.status_code == 400
    assert (exc.code, exc.param) == (code, param)
    if param.startswith("guided_"):
        assert "'response_format'" in exc.message and "'structured_outputs'" in exc.message
