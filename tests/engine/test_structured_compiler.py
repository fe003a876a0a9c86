"""The compile side of structured outputs on the reference backend: per-tenant compile caps, a
request aborted while its grammar compiles, the bounded cache, a grammar refused by its fuel,
and constrained rows beside unconstrained ones."""

from __future__ import annotations

import json
import re
import threading

import pytest

from inference.engine.config import EngineConfig
from inference.engine.llm_engine import GrammarBusyError, LLMEngine
from inference.engine.request import FinalEvent, SamplingParams
from inference.engine.structured.compiler import ENTRY_OVERHEAD_BYTES
from inference.protocol.structured import StructuredOutput


def regex(pattern: str, **params) -> SamplingParams:
    params.setdefault("max_tokens", 40)
    return SamplingParams(structured=StructuredOutput(kind="regex", spec=pattern,
                                                      param="structured_outputs.regex"), **params)


def engine_with(**settings) -> LLMEngine:
    return LLMEngine(EngineConfig(backend="reference", max_model_len=512, **settings))


def finish(engine: LLMEngine, handles) -> list[tuple[str, FinalEvent]]:
    while engine.has_work():
        engine.step()
    return [(text, final) for text, _, final in (h.result(timeout=5) for h in handles)]


@pytest.fixture
def blocked():
    """Hold every compile thread of an engine until the test lets go."""
    gate = threading.Event()
    yield gate
    gate.set()


def test_a_tenant_over_its_compile_cap_is_refused_and_the_others_go_on(blocked):
    engine = engine_with(structured_compiles_per_tenant=2)
    engine.grammars._compile_pool().submit(blocked.wait)  # compiles queue behind this
    first = [engine.submit(prompt="a", tenant="noisy", sampling=regex(f"[0-9]{{{n}}}"))
             for n in (2, 3)]
    with pytest.raises(GrammarBusyError) as busy:
        engine.submit(prompt="a", tenant="noisy", sampling=regex("[0-9]{4}"))
    assert busy.value.error.code == "grammar_busy" and busy.value.error.retryable
    assert busy.value.error.details["param"] == "structured_outputs.regex"
    # The same grammar again waits for its compile; another tenant has its own cap.
    again = engine.submit(prompt="b", tenant="noisy", sampling=regex("[0-9]{2}"))
    other = engine.submit(prompt="c", tenant="quiet", sampling=regex("[a-z]{5}"))
    plain = engine.submit(prompt="d", tenant="quiet", sampling=SamplingParams(max_tokens=5))
    assert engine.num_queued() == 5
    blocked.set()
    results = finish(engine, [*first, again, other, plain])
    patterns = ["[0-9]{2}", "[0-9]{3}", "[0-9]{2}", "[a-z]{5}"]
    for (text, final), pattern in zip(results, patterns, strict=False):
        assert final.finish_reason == "stop" and re.fullmatch(pattern, text), (text, final)
    assert results[-1][1].finish_reason == "length"
    stats = engine.stats()["structured"]
    assert stats["compile_refusals_by_reason"] == {"busy": 1}
    assert stats["compile_cache_hits"] == 1 and stats["compile_cache_misses"] == 3
    assert engine.num_queued() == 0


def test_a_request_aborted_while_its_grammar_compiles_ends_once_as_aborted(blocked):
    engine = engine_with()
    engine.grammars._compile_pool().submit(blocked.wait)
    handle = engine.submit(prompt="a", sampling=regex("[0-9]{3}"))
    assert engine.has_work()
    engine.abort(handle.request_id)
    engine.step()
    blocked.set()
    (text, final), = finish(engine, [handle])
    assert final.finish_reason == "abort" and text == ""
    assert final.usage.completion_tokens == 0
    assert engine.num_queued() == 0 and not engine.has_work()


def test_a_grammar_over_its_compile_fuel_ends_its_request_with_the_field_named():
    engine = engine_with(structured_compile_fuel=2_000)
    enum = json.dumps({"enum": [f"value-{i}" for i in range(400)]})
    big = engine.submit(prompt="a", sampling=SamplingParams(
        max_tokens=20, structured=StructuredOutput(kind="json_schema", spec=enum)))
    small = engine.submit(prompt="a", sampling=regex("ok"))
    (_, refused), (text, served) = finish(engine, [big, small])
    assert refused.finish_reason == "error" and refused.error.code == "invalid_request"
    assert refused.error.details["param"] == "response_format"
    assert "limit" in refused.error.message
    assert served.finish_reason == "stop" and text == "ok"
    assert engine.stats()["structured"]["compile_refusals_by_reason"] == {"limit": 1}


def test_the_compiled_grammar_cache_stays_within_its_bytes_least_recently_used_first():
    engine = engine_with(structured_cache_bytes=3 * ENTRY_OVERHEAD_BYTES)
    for n in range(1, 6):
        finish(engine, [engine.submit(prompt="a", sampling=regex(f"x{{{n}}}"))])
    stats = engine.stats()["structured"]
    assert stats["cache_entries"] == 2 and stats["cache_bytes"] <= 3 * ENTRY_OVERHEAD_BYTES
    finish(engine, [engine.submit(prompt="a", sampling=regex("x{5}"))])  # the newest: kept
    finish(engine, [engine.submit(prompt="a", sampling=regex("x{1}"))])  # the oldest: gone
    stats = engine.stats()["structured"]
    assert stats["compile_cache_hits"] == 1 and stats["compile_cache_misses"] == 6


def test_constrained_and_unconstrained_rows_share_the_batch_unchanged():
    alone = engine_with()
    reference = finish(alone, [alone.submit(prompt=p, sampling=SamplingParams(max_tokens=12))
                               for p in ("one", "two")])
    engine = engine_with()
    handles = [engine.submit(prompt=p, sampling=SamplingParams(max_tokens=12))
               for p in ("one", "two")]
    constrained = [engine.submit(prompt="one", sampling=regex("[0-9]{4}-[a-z]{3}")),
                   engine.submit(prompt="two", sampling=SamplingParams(
                       max_tokens=30, temperature=1.0, seed=5, structured=StructuredOutput(
                           kind="choice", spec='["alpha", "beta", "gamma"]')))]
    results = finish(engine, handles + constrained)
    assert [t for t, _ in results[:2]] == [t for t, _ in reference]
    assert re.fullmatch("[0-9]{4}-[a-z]{3}", results[2][0])
    assert results[3][0] in ("alpha", "beta", "gamma")
    assert engine.stats()["structured"]["forced_tokens"] > 0


def test_a_limit_the_grammar_meets_on_its_first_token_ends_the_request_naming_its_field():
    """llguidance meets some limits only as it goes (a choice of more alternatives than a grammar
    row may hold, at its first token): the request ends with its field named and the library's
    words, the token not sent."""
    engine = engine_with()
    many = SamplingParams(max_tokens=10, structured=StructuredOutput(
        kind="choice", spec=json.dumps([f"c{i}" for i in range(2500)]),
        param="structured_outputs.choice"))
    (text, final), = finish(engine, [engine.submit(prompt="a", sampling=many)])
    assert final.finish_reason == "error" and text == "" and final.usage.completion_tokens == 0
    assert final.error.code == "invalid_request"
    assert final.error.details["param"] == "structured_outputs.choice"
    assert "max is 2000" in final.error.message and "<non-verbose/>" not in final.error.message
    assert engine.stats()["structured"]["grammar_errors"] == 1


def test_a_grammar_too_costly_for_one_token_ends_its_row_alone():
    """An ambiguous grammar's cost per token grows with the answer: over
    ``STRUCTURED_MAX_STEP_MS`` of CPU for one token, its row ends, naming its field; the
    unconstrained row beside it goes on as alone."""
    alone = engine_with()
    (reference, _), = finish(alone, [alone.submit(prompt="x", sampling=SamplingParams(
        max_tokens=30))])
    engine = engine_with(structured_max_step_ms=0.5)
    hostile = engine.submit(prompt="a", sampling=SamplingParams(
        max_tokens=200, structured=StructuredOutput(
            kind="grammar", spec='start: x\nx: x x x | x x | "a" | "aa" | "b" | ""',
            param="structured_outputs.grammar")))
    victim = engine.submit(prompt="x", sampling=SamplingParams(max_tokens=30))
    (_, ended), (text, served) = finish(engine, [hostile, victim])
    assert ended.finish_reason == "error" and ended.error.details["reason"] == "grammar_too_slow"
    assert ended.error.details["param"] == "structured_outputs.grammar"
    assert "structured_outputs.grammar" in ended.error.message
    assert text == reference and served.finish_reason == "length"
    assert engine.stats()["structured"]["grammar_errors"] == 1
