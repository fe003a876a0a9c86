"""Structured outputs on the real model: every constrained answer that ends with ``stop`` matches
its grammar, inside a batch whose unconstrained rows answer as they would alone; forced tokens
jump ahead without changing an answer; hostile grammars are refused or bounded while another
tenant's stream goes on intact."""

from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest

from inference.engine.request import FinalEvent, ResumeState, SamplingParams, TokenEvent
from inference.protocol.structured import StructuredOutput, canonical_json
from tests.support.greedy import assert_same_greedy, make_engine, run_alone

pytestmark = [pytest.mark.model, pytest.mark.slow]

SCHEMAS = {
    "flat": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "member": {"type": "boolean"}},
        "required": ["name", "age", "member"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 30},
        "address": {"type": "object", "properties": {
            "street": {"type": "string", "maxLength": 40},
            "city": {"type": "string", "maxLength": 30}},
            "required": ["street", "city"], "additionalProperties": False}},
        "required": ["name", "address"], "additionalProperties": False},
    "array": {"type": "object", "properties": {
        "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "object", "properties": {"sku": {"type": "string", "maxLength": 12},
                                             "qty": {"type": "integer", "minimum": 1}},
            "required": ["sku", "qty"], "additionalProperties": False}}},
        "required": ["items"], "additionalProperties": False},
    "enum_optional": {"type": "object", "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "note": {"type": "string", "maxLength": 40}},
        "required": ["colour"], "additionalProperties": False},
    "any_of": {"type": "object", "properties": {
        "id": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 10}]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}},
        "required": ["id", "tags"], "additionalProperties": False},
    "formats": {"type": "object", "properties": {
        "day": {"type": "string", "format": "date"},
        "email": {"type": "string", "format": "email"}},
        "required": ["day", "email"], "additionalProperties": False},
}
ASK = "Answer with a JSON object for: {}."


def constrained(kind: str, spec: str, **params) -> SamplingParams:
    params.setdefault("max_tokens", 160)
    return SamplingParams(structured=StructuredOutput(kind=kind, spec=spec), **params)


def for_schema(name: str, **params) -> SamplingParams:
    return constrained("json_schema", canonical_json(SCHEMAS[name]), **params)


def chat(backend, text: str) -> list[int]:
    return backend.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def run(engine, requests: dict[str, tuple[list[int], SamplingParams]], max_s: float = 600):
    """Submit every request, tick until idle; each one's (text, tokens, final event)."""
    texts: dict[str, list[str]] = {rid: [] for rid in requests}
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    finals: dict[str, FinalEvent] = {}
    for rid, (prompt, sampling) in requests.items():
        engine.submit(prompt_token_ids=prompt, sampling=sampling, request_id=rid, tenant=rid)
    deadline = time.monotonic() + max_s
    while engine.has_work() and time.monotonic() < deadline:
        for event in engine.step():
            texts[event.request_id].append(event.text)
            if isinstance(event, TokenEvent):
                tokens[event.request_id].append(event.token_id)
            else:
                finals[event.request_id] = event
    assert not engine.has_work(), "the engine did not finish"
    return {rid: ("".join(texts[rid]), tokens[rid], finals[rid]) for rid in requests}


def assert_valid(name: str, text: str) -> None:
    schema = SCHEMAS[name]
    validator = jsonschema.Draft202012Validator(
        schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    validator.validate(json.loads(text))


@pytest.mark.parametrize("params", [{}, {"temperature": 0.8, "seed": 7}],
                         ids=["greedy", "sampled"])
def test_every_schema_answer_that_stops_validates(backend, params):
    engine, _ = make_engine(backend)
    requests = {name: (chat(backend, ASK.format(name.replace("_", " "))),
                       for_schema(name, **params)) for name in SCHEMAS}
    results = run(engine, requests)
    stopped = [name for name, (_, _, final) in results.items() if final.finish_reason == "stop"]
    for name in stopped:
        assert_valid(name, results[name][0])
    assert len(stopped) >= len(SCHEMAS) - 1, {n: r[2].finish_reason for n, r in results.items()}
    for name, (_, tokens, final) in results.items():
        assert final.error is None, (name, final.error)
        # The usage counts every token the client got, forced ones included (EOS is not sent).
        assert final.usage.completion_tokens in (len(tokens), len(tokens) + 1)


def test_regex_choice_and_grammar_are_matched(backend):
    engine, _ = make_engine(backend)
    prompt = chat(backend, "Describe the weather in one short sentence.")
    requests = {
        "regex": (prompt, constrained("regex", r"(Sunny|Rainy|Cloudy), [0-9]{1,2} degrees")),
        "choice": (prompt, constrained("choice", json.dumps(["sunny", "rainy", "cloudy"]))),
        "lark": (prompt, constrained("grammar", 'start: "It is " WORD "."\nWORD: /[a-z]{2,12}/')),
        "gbnf": (prompt, constrained("grammar", 'root ::= "Temp: " [0-9] [0-9]? "C"')),
    }
    results = run(engine, requests)
    assert all(r[2].finish_reason == "stop" for r in results.values()), results
    assert re.fullmatch(r"(Sunny|Rainy|Cloudy), [0-9]{1,2} degrees", results["regex"][0])
    assert results["choice"][0] in ("sunny", "rainy", "cloudy")
    assert re.fullmatch(r"It is [a-z]{2,12}\.", results["lark"][0])
    assert re.fullmatch(r"Temp: [0-9][0-9]?C", results["gbnf"][0])


def test_unconstrained_neighbours_answer_as_they_would_alone(backend, chat_prompt):
    greedy = SamplingParams(max_tokens=20, ignore_eos=True)
    alone = run_alone(backend, chat_prompt, greedy)
    engine, recorder = make_engine(backend)
    requests = {f"free{i}": (chat_prompt, greedy) for i in range(3)}
    requests |= {name: (chat(backend, ASK.format(name)), for_schema(name))
                 for name in ("flat", "array", "nested")}
    results = run(engine, requests)
    for i in range(3):
        assert_same_greedy(alone, results[f"free{i}"][1], f"free{i} beside constrained rows")
    for name in ("flat", "array", "nested"):
        if results[name][2].finish_reason == "stop":
            assert_valid(name, results[name][0])


def test_forced_tokens_jump_ahead_without_changing_the_answer(backend):
    requests = {name: (chat(backend, ASK.format(name)), for_schema(name, max_tokens=100))
                for name in ("flat", "nested")}
    runs, passes, forced = {}, {}, {}
    for jump in (True, False):
        engine, recorder = make_engine(backend, structured_jump_forward=jump)
        runs[jump] = run(engine, requests)
        passes[jump] = len(recorder.mixed_calls)
        forced[jump] = engine.stats()["structured"]["forced_tokens"]
    for name in requests:
        assert runs[True][name][0] == runs[False][name][0], name
        assert runs[True][name][2].usage == runs[False][name][2].usage, name
    assert forced[False] == 0 and forced[True] > 5
    assert passes[True] < passes[False], "forced tokens take no pass of their own"


def test_a_constrained_row_reports_raw_logprobs_for_every_token(backend):
    engine, _ = make_engine(backend)
    results = run(engine, {"lp": (chat(backend, ASK.format("a colour")),
                                  for_schema("enum_optional", logprobs=2))})
    text, tokens, final = results["lp"]
    assert final.finish_reason == "stop"
    assert_valid("enum_optional", text)
    assert engine.stats()["structured"]["forced_tokens"] == 0, "a logprobs row samples each token"


def test_a_resumed_request_goes_on_from_its_grammar_state(backend):
    """A request preempted on another engine arrives with the tokens it generated: its grammar is
    compiled again and fed them, and the answer goes on from there."""
    prompt = chat(backend, ASK.format("a person"))
    prefix = backend.tokenizer.encode('{"name":"Ada')
    state = ResumeState(request_id="resumed", prompt_len=len(prompt),
                        sampling=for_schema("flat"), generated=tuple(prefix), next_seq=len(prefix),
                        preemptions=1, cached_prompt_tokens=0, arrived_at=time.time())
    engine, _ = make_engine(backend)
    engine.submit(prompt_token_ids=prompt, resume=state)
    texts, final = [], None
    while engine.has_work():
        for event in engine.step():
            texts.append(event.text)
            final = event if isinstance(event, FinalEvent) else final
    assert final is not None and final.finish_reason == "stop", final
    assert_valid("flat", '{"name":"Ada' + "".join(texts))


def test_hostile_grammars_are_refused_or_bounded_while_another_tenant_streams(backend, chat_prompt):
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    alone = run_alone(backend, chat_prompt, greedy)
    deep: dict = {"type": "string"}
    for _ in range(60):
        deep = {"type": "object", "properties": {"a": deep}, "required": ["a"]}
    hostile = {
        "deep": constrained("json_schema", canonical_json(deep), max_tokens=40),
        "enum": constrained("json_schema", canonical_json(
            {"enum": [f"value-{i}-{'x' * (i % 17)}" for i in range(6000)]}), max_tokens=40),
        "regex": constrained("regex", "(a|aa|aaa)*(b+b+)+c{1,900}", max_tokens=40),
        "repeat": constrained("regex", "[a-z]{1,60000}", max_tokens=40),
        # Ambiguous: its cost per token grows with the answer until STRUCTURED_MAX_STEP_MS.
        "ambiguous": constrained("grammar", 'start: x\nx: x x x | x x | "a" | "aa" | "b" | ""',
                                 max_tokens=200),
    }
    engine, recorder = make_engine(backend)
    prompt = chat(backend, "Say something.")
    requests = {"victim": (chat_prompt, greedy)} | {k: (prompt, v) for k, v in hostile.items()}
    started = time.monotonic()
    results = run(engine, requests, max_s=300)
    assert time.monotonic() - started < 300
    assert_same_greedy(alone, results["victim"][1], "beside hostile grammars")
    assert results["victim"][2].finish_reason == "length"
    for name in hostile:
        final = results[name][2]
        if final.error is not None:
            assert final.error.code == "invalid_request", (name, final.error)
        else:
            assert final.finish_reason in ("stop", "length"), name
    stats = engine.stats()["structured"]
    assert stats["constrained_requests"] == len(hostile)


def test_special_token_text_a_grammar_forces_is_written_as_text(backend):
    """A ``const`` of a special token's text is written as those characters (several tokens),
    never as the control token, which would end the answer."""
    engine, _ = make_engine(backend)
    schema = {"type": "object", "properties": {"end": {"const": "<|im_end|>"},
                                               "n": {"enum": ["<|endoftext|>"]}},
              "required": ["end", "n"], "additionalProperties": False}
    [(text, tokens, final)] = run(engine, {"s": (chat(backend, "JSON please."), constrained(
        "json_schema", canonical_json(schema)))}).values()
    assert final.finish_reason.value == "stop", final
    assert json.loads(text) == {"end": "<|im_end|>", "n": "<|endoftext|>"}
    special = set(backend.tokenizer.special_token_ids().values())
    assert not special & set(tokens[:-1])
