"""Streamed text on the real tokenizer: UTF-8-safe deltas, stop strings, seeded sampling."""

from __future__ import annotations

import pytest

from inference.engine.detokenizer import IncrementalDetokenizer
from inference.engine.request import FinishReason, SamplingParams
from tests.support.greedy import make_engine, run_alone, run_requests

pytestmark = [pytest.mark.model, pytest.mark.slow]

NON_ASCII = "Привет, 世界! Ça va? Café, naïve, 😀 déjà vu. 東京タワー 🎉🚀 Ελληνικά"
REPEAT = f"Repeat exactly: {NON_ASCII}"


def test_detokenizer_deltas_are_whole_characters_on_the_real_tokenizer(backend):
    tok = backend.tokenizer
    ids = tok.encode(NON_ASCII)
    assert len(ids) > len(NON_ASCII.split())  # characters do span several tokens
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add_token(t) for t in ids]
    deltas.append(detok.flush())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == NON_ASCII == tok.decode(ids)


def test_streamed_deltas_equal_the_full_text_for_a_non_ascii_answer(backend):
    tok = backend.tokenizer
    prompts = {
        "repeat": tok.apply_chat_template([{"role": "user", "content": REPEAT}]),
        "russian": tok.apply_chat_template(
            [{"role": "user", "content": "Write a short sentence in Russian."}]),
    }
    engine, recorder = make_engine(backend)
    runs = run_requests(engine, recorder, prompts, SamplingParams(max_tokens=48))
    for rid, run in runs.items():
        full = tok.decode(run.tokens)
        assert any(ord(c) > 127 for c in full), f"{rid}: answer has no non-ASCII text: {full!r}"
        assert run.text == full, rid


def test_a_stop_string_spanning_tokens_is_never_streamed(backend):
    tok = backend.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": REPEAT}])
    free = run_alone(backend, prompt, SamplingParams(max_tokens=24))
    stop = "世界"
    assert stop in free.text and len(tok.encode(stop)) > 1
    engine, recorder = make_engine(backend)
    run = run_requests(engine, recorder, {"s": prompt},
                       SamplingParams(max_tokens=24, stop=(stop,)))["s"]
    assert run.final.finish_reason is FinishReason.STOP
    assert run.text == free.text[:free.text.index(stop)]


def test_a_seeded_sample_does_not_depend_on_its_batch(backend, chat_prompt, corpus_ids):
    sampling = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, top_k=40, seed=1234)
    alone = run_alone(backend, chat_prompt, sampling)
    engine, recorder = make_engine(backend)
    prompts = {"n1": corpus_ids[:90], "seeded": chat_prompt, "n2": corpus_ids[400:420]}
    engine.submit(prompt_token_ids=corpus_ids[50:80], request_id="other-seed",
                  sampling=SamplingParams(max_tokens=30, temperature=1.0, seed=7))
    runs = run_requests(engine, recorder, prompts, sampling, ticks_between=1)
    assert runs["seeded"].tokens == alone.tokens
    unseeded = run_alone(backend, chat_prompt, SamplingParams(max_tokens=24, temperature=0.8,
                                                              seed=99))
    assert unseeded.tokens != alone.tokens


def test_an_answer_ending_inside_a_character_still_streams_its_whole_decoded_text(backend):
    tok = backend.tokenizer
    ids = tok.encode("ok 😀")
    cut = ids[:-1]  # the emoji's last byte-token is missing
    assert tok.decode(cut).endswith("\ufffd")
    detok = IncrementalDetokenizer(tok)
    streamed = "".join(detok.add_token(t) for t in cut) + detok.flush()
    assert streamed == tok.decode(cut)
