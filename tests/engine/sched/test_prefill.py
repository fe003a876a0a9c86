"""Chunked and monolithic prefill, the first token, and prefix caching on the reference backend.

The reference backend derives each next token from every token it reads back through the row's
block table, so equal outputs mean the KV writes and block tables were right.
"""

from __future__ import annotations

import pytest

from inference.engine.request import FinishReason, SamplingParams, TokenEvent
from tests.support.engine import EventLog, make_engine, run_until_idle

PROMPT = [(i * 13) % 251 + 1 for i in range(203)]


def generate(engine, prompt, max_tokens=12, tenant="t", rid="x"):
    log = EventLog()
    engine.submit(prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=max_tokens),
                  tenant=tenant, request_id=rid)
    run_until_idle(engine, log)
    return log.tokens(rid), log.final(rid)


@pytest.mark.parametrize("mode", ["monolithic", "chunked"])
def test_a_row_promoted_in_a_tick_streams_its_first_token_in_that_tick(mode):
    engine = make_engine(prefill_mode=mode, prefill_chunk_size=64)
    engine.submit(prompt_token_ids=[1, 2, 3, 4, 5], request_id="one",
                  sampling=SamplingParams(max_tokens=1))
    events = engine.step()
    assert [type(e).__name__ for e in events] == ["TokenEvent", "FinalEvent"]
    assert events[1].usage.completion_tokens == 1
    assert events[1].finish_reason is FinishReason.LENGTH

    engine.submit(prompt_token_ids=[1, 2, 3, 4, 5], request_id="two",
                  sampling=SamplingParams(max_tokens=5))
    events = engine.step()
    # Admitted, prefilled, promoted: the first token, then the same tick's decode step's token.
    assert [e.seq for e in events if isinstance(e, TokenEvent)] == [0, 1]


@pytest.mark.parametrize("mode", ["chunked", "mixed_batch"])
@pytest.mark.parametrize("chunk", [1, 7, 16, 64, 203, 204])
def test_chunked_prefill_equals_monolithic(chunk, mode):
    expected, _ = generate(make_engine(prefill_mode="monolithic"), PROMPT)
    got, final = generate(make_engine(prefill_chunk_size=chunk, prefill_mode=mode), PROMPT)
    assert got == expected
    assert final.usage.prompt_tokens == len(PROMPT)


def test_every_active_row_gets_one_token_per_tick_while_a_long_prompt_is_prefilled():
    engine = make_engine(prefill_chunk_size=8, max_batch_size=8, kv_num_blocks=1024,
                         prefill_mode="chunked")
    log = EventLog()
    for i in range(3):
        engine.submit(prompt_token_ids=[i + 1] * 5, request_id=f"short{i}",
                      sampling=SamplingParams(max_tokens=200))
    log.add(engine.step())
    engine.submit(prompt_token_ids=PROMPT * 2, request_id="long",
                  sampling=SamplingParams(max_tokens=4))
    chunk_ticks = 0
    while True:
        events = engine.step()
        log.add(events)
        snap = engine.debug_snapshot()
        if any(r["request_id"] == "long" for r in snap["prefilling"]) or any(
                e.request_id == "long" for e in events):
            chunk_ticks += 1
            per_row = [sum(1 for e in events if e.request_id == f"short{i}") for i in range(3)]
            assert per_row == [1, 1, 1]
        if any(e.request_id == "long" for e in events):
            break
    assert chunk_ticks == -(-len(PROMPT * 2) // 8)


def test_a_prefix_hit_skips_computed_tokens_and_gives_the_same_output():
    engine = make_engine(kv_block_size=4)
    miss, miss_final = generate(engine, PROMPT, rid="a")
    computed_before = engine.stats()["prompt_tokens_computed"]
    hit, hit_final = generate(engine, PROMPT, rid="b")
    assert hit == miss
    assert miss_final.usage.cached_prompt_tokens == 0
    # Full blocks only, and never the last prompt token (its logits give the first token).
    assert hit_final.usage.cached_prompt_tokens == (len(PROMPT) - 1) // 4 * 4
    assert (engine.stats()["prompt_tokens_computed"] - computed_before
            == len(PROMPT) - hit_final.usage.cached_prompt_tokens)


def test_one_tenants_prompts_are_never_a_cache_hit_for_another():
    engine = make_engine()
    generate(engine, PROMPT, tenant="alpha", rid="a")
    _, other = generate(engine, PROMPT, tenant="beta", rid="b")
    _, same = generate(engine, PROMPT, tenant="alpha", rid="c")
    assert other.usage.cached_prompt_tokens == 0
    assert same.usage.cached_prompt_tokens > 0


def test_evicted_blocks_are_recomputed_and_give_the_same_output():
    engine = make_engine(kv_num_blocks=80, kv_block_size=4, max_batch_size=2)
    first, _ = generate(engine, PROMPT, rid="a")
    for i in range(6):  # other traffic needs the blocks: the cached prompt gets evicted
        generate(engine, [(i * 17 + j) % 250 + 1 for j in range(250)], rid=f"o{i}")
    assert engine.stats()["kv_block_evictions"] > 0
    again, final = generate(engine, PROMPT, rid="b")
    assert again == first
    assert final.usage.cached_prompt_tokens < (len(PROMPT) - 1) // 4 * 4


def test_blocks_of_a_generated_answer_are_reused_by_the_next_turn():
    engine = make_engine(kv_block_size=4)
    answer, _ = generate(engine, PROMPT[:40], max_tokens=24, rid="turn1")
    _, final = generate(engine, PROMPT[:40] + answer + [9, 9, 9], max_tokens=4, rid="turn2")
    assert final.usage.cached_prompt_tokens >= 56
