"""Batching, chunked prefill and prefix caching never change a greedy answer (real model).

Each case compares a prompt's greedy tokens against the prompt run alone with monolithic prefill,
token for token, with the tie rule of :mod:`tests.support.greedy`.
"""

from __future__ import annotations

import pytest

from inference.engine.backends.hf.batch import (
    MAX_ATTENTION_GROUPS,
    _attention_groups,
    _prefill_parts,
)
from inference.engine.request import SamplingParams
from tests.support.greedy import Run, assert_same_greedy, make_engine, run_alone, run_requests

pytestmark = [pytest.mark.model, pytest.mark.slow]

GREEDY = SamplingParams(max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def alone(backend, chat_prompt):
    return run_alone(backend, chat_prompt, GREEDY)


@pytest.mark.parametrize("neighbour_len", [1, 50, 300, 1000])
def test_a_prompt_batched_with_a_neighbour_equals_it_alone(
        backend, corpus_ids, chat_prompt, alone, neighbour_len):
    # The neighbour starts first, so the prompt joins while it is prefilling or decoding.
    engine, recorder = make_engine(backend, prefill_chunk_size=128)
    prompts = {"neighbour": corpus_ids[:neighbour_len], "prompt": chat_prompt}
    runs = run_requests(engine, recorder, prompts, GREEDY, ticks_between=2)
    assert_same_greedy(alone, runs["prompt"].tokens, f"neighbour of {neighbour_len} tokens")


def test_a_prompt_batched_with_seven_copies_of_itself_equals_it_alone(
        backend, chat_prompt, alone):
    # A cap that holds all eight prompts: one pass in either chunking mode.
    engine, recorder = make_engine(backend, enable_prefix_caching=False, prefill_chunk_size=1024)
    prompts = {f"copy{i}": chat_prompt for i in range(8)}
    runs = run_requests(engine, recorder, prompts, GREEDY)
    assert max(len(call) for call in recorder.prefill_calls) == 8  # one batched prefill
    for rid, run in runs.items():
        assert_same_greedy(alone, run.tokens, rid)


@pytest.mark.parametrize("mode", ["chunked", "mixed_batch"])
@pytest.mark.parametrize("chunk, lengths", [
    (64, [64, 65, 128, 48, 49]),   # multiples of the chunk, chunk + 1, 3 blocks, 3 blocks + 1
    (16, [16, 17, 32, 33, 40]),
    (1, [1, 2, 16, 17]),
])
def test_chunked_prefill_equals_monolithic_while_another_row_decodes(
        backend, corpus_ids, chunk, lengths, mode):
    sampling = SamplingParams(max_tokens=12, ignore_eos=True)
    prompts = {f"len{n}": corpus_ids[200:200 + n] for n in lengths}
    references = {rid: run_alone(backend, p, sampling) for rid, p in prompts.items()}

    engine, recorder = make_engine(backend, prefill_mode=mode, prefill_chunk_size=chunk,
                                   enable_prefix_caching=False)
    # A long-running row decodes throughout; the prompts arrive staggered.
    background = {"background": corpus_ids[:30]}
    engine.submit(prompt_token_ids=background["background"], request_id="background",
                  sampling=SamplingParams(max_tokens=120, ignore_eos=True))
    engine.step()
    runs = run_requests(engine, recorder, prompts, sampling, ticks_between=3)
    for rid, reference in references.items():
        chunk_sizes = {n for call in recorder.prefill_calls for r, _, n in call if r == rid}
        assert max(chunk_sizes) <= chunk
        assert_same_greedy(reference, runs[rid].tokens, f"{mode} {chunk}, {rid}")
    if mode == "mixed_batch":  # decode rows rode in the prompt chunks' passes
        assert any(chunks and rows for chunks, rows in recorder.mixed_calls)


def test_a_prefix_hit_equals_a_miss_and_survives_eviction(backend, corpus_ids):
    sampling = SamplingParams(max_tokens=16, ignore_eos=True)
    shared = corpus_ids[:100]  # 6 full blocks of 16 are cacheable
    first, second = shared + corpus_ids[500:520], shared + corpus_ids[700:730]
    miss = run_alone(backend, second, sampling, enable_prefix_caching=False)

    # A small pool: 48 blocks of 16 tokens.
    engine, recorder = make_engine(backend, kv_num_blocks=48, max_batch_size=4,
                                   prefill_mode="monolithic")
    run_requests(engine, recorder, {"first": first}, sampling)
    hit = run_requests(engine, recorder, {"hit": second}, sampling)["hit"]
    assert hit.final.usage.cached_prompt_tokens == 96
    assert recorder.prefill_calls[-1] == [("hit", 96, len(second) - 96)]
    assert_same_greedy(miss, hit.tokens, "prefix hit")

    # Other traffic caches about twice the pool (distinct prompts), so the least recently used
    # blocks, the shared prefix's among them, are evicted and their slots rewritten.
    others = {f"other{i}": corpus_ids[300 + 50 * i: 300 + 50 * i + 250] for i in range(6)}
    run_requests(engine, recorder, others, SamplingParams(max_tokens=8, ignore_eos=True))
    again = run_requests(engine, recorder, {"again": second}, sampling)["again"]
    assert again.final.usage.cached_prompt_tokens == 0
    assert_same_greedy(miss, again.tokens, "after eviction")


@pytest.mark.parametrize("native_attention", [True, False], ids=["native", "gather"])
def test_a_prompt_decoding_among_rows_of_very_different_lengths_equals_it_alone(
        backend, corpus_ids, chat_prompt, alone, native_attention):
    # The native kernel reads each row's K/V in place; the gather path runs decode attention
    # over groups of rows of similar length, so rows of 1 to 1,000 tokens decoding together are
    # split into several groups. Either way the answer must not change.
    # Every prompt prefilled in the first pass, so that all six rows decode together.
    engine, recorder = make_engine(backend, max_batch_size=8, prefill_chunk_size=2048,
                                   target_itl_ms=0)
    prompts = {f"n{n}": corpus_ids[:n] for n in (1, 30, 250, 600, 1000)}
    prompts["prompt"] = chat_prompt
    before = backend.native_attention
    backend.native_attention = native_attention and before
    try:
        runs = run_requests(engine, recorder, prompts, GREEDY)
    finally:
        backend.native_attention = before
    assert_same_greedy(alone, runs["prompt"].tokens, "rows of 1 to 1,000 tokens")
    block = engine.config.kv_block_size
    widest = max(recorder.decode_calls, key=len)
    blocks = sorted(-(-(pos + 1) // block) for pos, _ in widest)
    assert len(widest) == 6 and len(_attention_groups(blocks, block)) > 1


def test_attention_groups_split_rows_by_length_only_when_it_pays():
    assert _attention_groups([4, 4, 5, 5], 16) == [(0, 4)]
    # a few short rows beside long ones: gathering the short ones to the long length is waste
    groups = _attention_groups([1, 1, 2, 60, 62, 63], 16)
    assert groups == [(0, 3), (3, 6)]
    many = _attention_groups(list(range(1, 200, 3)), 16)
    assert len(many) == MAX_ATTENTION_GROUPS
    assert [s for s, _ in many][0] == 0 and many[-1][1] == len(range(1, 200, 3))
    assert all(a[1] == b[0] for a, b in zip(many, many[1:], strict=False))  # in order


def test_prefill_rows_share_an_attention_run_only_when_it_pays():
    # a deep chunk (40 new tokens over 1,952 keys) and a new 100-token prompt: apart
    assert _prefill_parts([40, 100], [1952, 112]) == [(0, 1), (1, 2)]
    # prompts of similar shape, or many tiny ones: one run (a run per row costs more calls)
    assert _prefill_parts([64, 70, 66], [64, 80, 80]) == [(0, 3)]
    assert _prefill_parts([8] * 32, [16] * 32) == [(0, 32)]
    # two similar new prompts around a deep chunk: the order is kept, so three runs
    assert _prefill_parts([100, 30, 96], [112, 2048, 96]) == [(0, 1), (1, 2), (2, 3)]
    runs = _prefill_parts([5, 300, 6, 7, 250, 4], [16, 3000, 16, 16, 256, 2000])
    assert runs[0][0] == 0 and runs[-1][1] == 6
    assert all(a[1] == b[0] for a, b in zip(runs, runs[1:], strict=False))


def test_batch_passes_that_give_way_at_random_layers_answer_as_if_they_never_had(
        backend, corpus_ids):
    # Batch rows whose passes stop between layers for interactive arrivals (here: a seeded coin
    # at each layer), while they prefill in chunks and decode, and while a second wave hits the
    # first wave's cached system prompt: every answer is its answer in a pass never stopped,
    # and the second wave's prefix hits are as many (a stopped pass's K/V writes, redone by the
    # next pass, never reach the prefix cache as another content).
    import random

    from inference.engine.request import TokenEvent

    system = corpus_ids[:70]  # 4 full blocks of 16 shared by every prompt
    prompts = {f"w{wave}q{i}": system + corpus_ids[300 + 40 * i + 7 * wave:][:20 + 3 * i]
               for wave in range(2) for i in range(4)}
    sampling = SamplingParams(max_tokens=10, ignore_eos=True)

    def answers(give_way: float) -> tuple[dict[str, Run], int, int]:
        engine, recorder = make_engine(backend, max_batch_size=4, prefill_chunk_size=32,
                                batch_yield_s=0)
        coin = random.Random(7)
        engine.scheduler.mixed._interactive_arrived = lambda: coin.random() < give_way
        tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
        for wave in range(2):
            for rid, prompt in prompts.items():
                if rid.startswith(f"w{wave}"):
                    engine.submit(prompt_token_ids=prompt, sampling=sampling, request_id=rid,
                                  tenant="t", fairness_key="t", batch=True)
            while engine.has_work():
                for event in engine.step():
                    if isinstance(event, TokenEvent):
                        tokens[event.request_id].append(event.token_id)
        stats = engine.stats()
        runs = {rid: Run(t, list(recorder.gaps[rid]), "", None) for rid, t in tokens.items()}
        return runs, stats["batch_passes_yielded"], stats["prefix_hit_tokens"]

    whole, never, hits = answers(0.0)
    stopped, yielded, stopped_hits = answers(0.25)
    assert never == 0 and yielded > 10
    assert stopped_hits == hits > 0
    for rid, run in whole.items():
        assert len(run.tokens) == 10
        assert_same_greedy(run, stopped[rid].tokens, rid)
