"""``n`` > 1 choices on the real model: the prompt is prefilled once and forked; with a seed,
each choice is the same each time the request runs and is the one-choice request of its seed
(choice 0: the request's own seed), which also checks the copied partial prompt block (a wrong
copy would change every later logit); every choice of a JSON-schema request validates.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from inference.engine.request import SamplingParams, TokenEvent
from inference.engine.sched.choices import choice_seed
from inference.protocol.structured import StructuredOutput, canonical_json
from tests.engine.sched.test_choices import split_choices
from tests.support.greedy import make_engine

pytestmark = [pytest.mark.model, pytest.mark.slow]

PROMPT_LEN = 37  # not a multiple of the block size (16): the last prompt block is copied
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20},
    "colour": {"enum": ["red", "green", "blue"]},
    "count": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "colour", "count"], "additionalProperties": False}


def run(backend, prompt: list[int], sampling: SamplingParams, **settings):
    """Each choice's tokens and text, the final event, the engine's stats and debug counts."""
    engine, _ = make_engine(backend, **settings)
    engine.submit(prompt_token_ids=prompt, sampling=sampling, request_id="x")
    events = []
    while engine.has_work():
        events += engine.step()
    assert [e.seq for e in events] == list(range(len(events)))
    tokens, texts, final = split_choices(events)
    return tokens, texts, final, {**engine.stats(), **engine.debug_snapshot()}


@pytest.mark.parametrize("mode", ["chunked", "mixed_batch"])
def test_seeded_choices_repeat_and_match_the_one_choice_requests(backend, corpus_ids, mode):
    prompt = corpus_ids[:PROMPT_LEN]
    sampling = SamplingParams(max_tokens=10, temperature=1.0, seed=1234, n=3, ignore_eos=True)
    tokens, texts, final, stats = run(backend, prompt, sampling, prefill_mode=mode)
    assert stats["prompt_tokens_computed"] == PROMPT_LEN  # once, for every choice
    assert stats["forked_choices"] == 3
    assert final.usage.prompt_tokens == PROMPT_LEN
    assert final.usage.completion_tokens == 30
    again = run(backend, prompt, sampling, prefill_mode=mode)
    assert (tokens, texts) == again[:2], "each choice equals itself when the request runs again"
    for i in range(3):
        alone = SamplingParams(max_tokens=10, temperature=1.0, seed=choice_seed(1234, i),
                               ignore_eos=True)
        single = run(backend, prompt, alone, prefill_mode=mode)
        assert tokens[i] == single[0][0], i
    assert len({tuple(t) for t in tokens}) > 1, "the choices draw independently"


def test_every_choice_of_a_json_schema_request_validates(backend):
    prompt = backend.tokenizer.apply_chat_template([{"role": "user", "content": (
        "Answer with a JSON object naming a fruit, a colour and a count.")}])
    sampling = SamplingParams(max_tokens=80, temperature=0.9, seed=5, n=3,
                              structured=StructuredOutput(kind="json_schema",
                                                          spec=canonical_json(SCHEMA)))
    _, texts, final, stats = run(backend, prompt, sampling)
    validator = jsonschema.Draft202012Validator(SCHEMA)
    stopped = [i for i, c in enumerate(final.choices) if c.finish_reason == "stop"]
    assert len(stopped) >= 2, final.choices
    for i in stopped:
        validator.validate(json.loads(texts[i]))
    assert all(c.error is None for c in final.choices)
    assert stats["prompt_tokens_computed"] == len(prompt)
    assert stats["structured"]["constrained_requests"] == 1


def test_a_preempted_request_of_n_choices_goes_on_as_alone(backend, corpus_ids):
    """Preempted as a whole after a few tokens of each choice, resumed (its prompt once, each
    choice's tokens recomputed over the shared, copied prompt KV), every seeded choice draws on
    as if never interrupted."""
    prompt = corpus_ids[:PROMPT_LEN]
    sampling = SamplingParams(max_tokens=12, temperature=1.0, seed=77, n=3, ignore_eos=True)
    tokens, texts, alone, _ = run(backend, prompt, sampling, max_batch_size=3)
    engine, _ = make_engine(backend, max_batch_size=3, preemption=True)
    engine.submit(prompt_token_ids=prompt, sampling=sampling, request_id="x")
    events = []
    while sum(isinstance(e, TokenEvent) for e in events) < 9:
        events += engine.step()
    engine.submit(prompt_token_ids=corpus_ids[100:110], request_id="vip", priority=5,
                  sampling=SamplingParams(max_tokens=3))
    while engine.has_work():
        events += engine.step()
    assert engine.stats()["preemptions"] == 1
    mine = [e for e in events if e.request_id == "x"]
    assert [e.seq for e in mine] == list(range(len(mine)))
    after: list[list[int]] = [[] for _ in range(3)]
    for event in mine[:-1]:
        after[event.index].append(event.token_id)
    assert after == tokens
    assert mine[-1].choices == alone.choices and mine[-1].usage == alone.usage
