"""Prompt tokens are counted off the web tier's event loop, and a prompt far over the context is
refused from its size in bytes, before anything tokenizes it (gateway.tokens, gateway.lifecycle).

Mechanisms only, never timings: the count runs in another process (its pid), the web process's
own tokenizer is never called, a refused prompt reaches no worker, a dead counting process is
replaced. The byte bounds are checked against the real tokenizer (hypothesis).
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal

import pytest
from asgiref.sync import async_to_sync
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway import lifecycle, tokens
from inference.protocol.models import model_folder
from inference.tokenization import Tokenizer

pytestmark = [pytest.mark.django_db, pytest.mark.model]

MODEL = "SmolLM2-135M-Instruct"
CHAT = "/v1/chat/completions"
# A chat prompt under the REST API's 2.5 MB body limit, far over any context.
HUGE = "hello world " * 200_000


@pytest.fixture
def never_queued(monkeypatch):
    """This process must neither tokenize (only a counting process may) nor queue a request."""
    from gateway import admission

    def refuse(*args, **kwargs):
        raise AssertionError("tokenized in the web process, or queued")

    monkeypatch.setattr(Tokenizer, "encode", refuse)
    monkeypatch.setattr(admission, "admit", refuse)


def post(client, raw_key: str, body: dict, path: str = CHAT):
    return client.post(path, json.dumps(body), content_type="application/json",
                       HTTP_AUTHORIZATION=f"Bearer {raw_key}")


@functools.cache
def longest_token_bytes(folder) -> int:
    """The longest token of the vocabulary in bytes, by GPT-2's byte-to-character table."""
    visible = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
               *range(ord("®"), ord("ÿ") + 1)]
    chars = {chr(b): 1 for b in visible}
    chars.update({chr(256 + n): 1 for n in range(256 - len(visible))})
    spec = json.loads((folder / "tokenizer.json").read_text())
    vocab = max(sum(chars[c] for c in token) for token in spec["model"]["vocab"])
    return max(vocab, *(len(t["content"].encode()) for t in spec["added_tokens"]))


def test_counts_run_in_another_process_and_match_the_tokenizer(real_tokenizer, monkeypatch):
    messages = [{"role": "user", "content": "Hi"}]
    expected = len(real_tokenizer.apply_chat_template(messages)), len(
        real_tokenizer.encode("Hello there"))

    def refuse(*args, **kwargs):
        raise AssertionError("tokenized in the web process")

    monkeypatch.setattr(Tokenizer, "encode", refuse)
    chat = async_to_sync(tokens.count_chat_tokens)(messages)
    text = async_to_sync(tokens.count_text_tokens)("Hello there")
    assert chat.pid != os.getpid() and text.pid != os.getpid()
    assert chat.exact and text.exact and (chat.tokens, text.tokens) == expected


def test_byte_bounds_are_derived_from_the_vocabulary(real_tokenizer):
    folder = model_folder()
    bounds = tokens.byte_bounds(json.loads((folder / "tokenizer.json").read_text()))
    # The bytes the tokenizer drops: a text of one of them alone has no token.
    dropped = {b for b in range(128) if not real_tokenizer.encode(chr(b))}
    assert dropped and 0x16 in dropped
    assert bounds.max_token_bytes == longest_token_bytes(folder) and bounds.prefix_bytes == 0
    assert {b for b in bounds.unencoded if b < 128} == dropped
    # The others: bytes UTF-8 never writes (0xC0, 0xC1, 0xF5-0xFF) and leading bytes of
    # characters from U+40000 on, which this vocabulary has no token for either.
    assert all(b in (0xC0, 0xC1) or b >= 0xF1 for b in bounds.unencoded if b >= 128)
    assert len(real_tokenizer.encode(chr(0x40000))) == 3  # F1 80 80 80: the F1 is dropped
    assert bounds.at_least(2_400_000) == -(-2_400_000 // bounds.max_token_bytes)


def test_a_prompt_of_bytes_the_vocabulary_lacks_is_tokenized_not_refused(real_tokenizer,
                                                                        monkeypatch):
    # 40,000 bytes the tokenizer drops: no token at all, so a bound by bytes alone would
    # refuse as "at least 2,000 tokens" a prompt that fits any context.
    monkeypatch.setattr(tokens, "_process_folder", str(model_folder()))
    text = "\x16" * 20_000 + "\x04\x13" * 10_000
    count = tokens.measure_here(None, text, most=100)
    assert count.exact and count.tokens == len(real_tokenizer.encode(text)) == 0
    fewest, most = tokens.bounds_here(None, text + "ab")
    assert fewest == 1 and most == 40_002


def test_tokenizers_that_can_change_a_texts_length_get_no_bounds():
    spec = {"model": {"type": "BPE", "vocab": {"ab": 0}}, "added_tokens": [],
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False}}
    every_byte = frozenset(range(256))  # "ab" is the only token: a lone byte has none
    assert tokens.byte_bounds(spec) == tokens.ByteBounds(2, unencoded=every_byte)
    assert tokens.byte_bounds({**spec, "normalizer": {"type": "NFC"}}) is None
    assert tokens.byte_bounds({**spec, "pre_tokenizer": {"type": "Metaspace"}}) is None
    assert tokens.byte_bounds({**spec, "model": {"type": "Unigram", "vocab": []}}) is None
    swallowing = [{"content": "<mask>", "lstrip": True, "rstrip": False}]
    assert tokens.byte_bounds({**spec, "added_tokens": swallowing}) is None
    spaced = {"type": "Sequence", "pretokenizers": [
        {"type": "Split"}, {"type": "ByteLevel", "add_prefix_space": True}]}
    assert tokens.byte_bounds({**spec, "pre_tokenizer": spaced}) == tokens.ByteBounds(
        2, 1, every_byte)


pieces = st.one_of(
    st.text(st.characters(exclude_categories=("Cs",)), max_size=20),
    st.sampled_from([" ", "\n", "\t", "#", "-", "=", "<|im_start|>", "<|im_end|>", "é", "中",
                     "\x16", "\x04", chr(0x40000)]),  # bytes the vocabulary lacks
)
texts = st.lists(pieces, max_size=40).map("".join)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=texts, run=st.integers(0, 300))
def test_byte_bounds_hold_for_any_text(real_tokenizer, text, run):
    bounds = tokens.byte_bounds(json.loads((model_folder() / "tokenizer.json").read_text()))
    for sample in (text, text + " " * run, "\n" + " " * run + text, "#" * run + text):
        n = len(real_tokenizer.encode(sample))
        data = sample.encode()
        assert bounds.at_least(bounds.countable_bytes(data)) <= n <= bounds.at_most(len(data))


def test_a_prompt_far_over_the_context_is_not_tokenized(real_tokenizer, monkeypatch):
    # In this process, so that the tokenizer can be watched: it must not be called.
    monkeypatch.setattr(tokens, "_process_folder", str(model_folder()))
    calls = []
    monkeypatch.setattr(Tokenizer, "encode", lambda self, text: calls.append(text) or [])
    count = tokens.measure_here([{"role": "user", "content": HUGE}], None, most=8191)
    assert not count.exact and count.tokens > 8191 and calls == []
    assert count.prompt_bytes > len(HUGE)
    assert count.tokens == -(-count.prompt_bytes // longest_token_bytes(model_folder()))
    tokens.measure_here([{"role": "user", "content": "Hi"}], None, most=8191)
    assert len(calls) == 1  # a prompt that may fit is tokenized


def test_a_far_over_prompt_is_refused_with_the_workers_error_and_never_queued(
        client, tenant_key, inproc_worker, rclient, keys, never_queued):
    body = {"model": MODEL, "messages": [{"role": "user", "content": HUGE}]}
    response = post(client, tenant_key[2], body)
    assert response.status_code == 400 and response["x-should-retry"] == "false"
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
    lower = error["details"]["prompt_tokens"]
    assert error["message"] == (f"prompt of at least {lower} tokens leaves no room in the "
                                "model's context of 256 tokens")
    assert error["details"]["max_model_len"] == 256
    assert error["details"]["prompt_bytes"] > len(HUGE)
    # With max_tokens too the prompt is at fault: it fills the context on its own.
    streamed = post(client, tenant_key[2], {**body, "max_tokens": 5, "stream": True})
    assert streamed.status_code == 400 and not streamed.streaming
    error = streamed.json()["error"]
    assert error["param"] == "messages" and f"+ max_tokens 5 = at least {lower + 5}" in (
        error["message"])
    # Neither was queued (never_queued); both are counted as refused by the web tier.
    refused = rclient.hgetall(f"{keys.prefix}:metrics:refused")
    assert refused == {b"context_length_exceeded": b"2"}


def test_a_prompt_just_over_the_context_gets_the_exact_count(client, tenant_key, inproc_worker,
                                                             real_tokenizer, monkeypatch):
    content = "word " * 300  # 1.5 KB: under the byte bound, so it is tokenized (elsewhere)
    n = len(real_tokenizer.apply_chat_template([{"role": "user", "content": content}]))
    monkeypatch.setattr(lifecycle.admission, "admit", None)  # never queued
    response = post(client, tenant_key[2], {"model": MODEL,
                                            "messages": [{"role": "user", "content": content}]})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == (
        f"prompt of {n} tokens leaves no room in the model's context of 256 tokens")


def test_a_dead_counting_process_is_replaced(real_tokenizer):
    async def go():
        before = await tokens.warm_up()
        for pid in before:
            os.kill(pid, signal.SIGKILL)
        count = await tokens.count_text_tokens("Hello there")
        return before, count

    before, count = async_to_sync(go)()
    assert count.exact and count.tokens == 2 and count.pid not in before


def test_counting_processes_that_keep_dying_give_a_retryable_503(monkeypatch):
    from gateway.errors import APIError

    async def go():
        return await tokens.run(os._exit, 3)  # the counting process exits at once

    with pytest.raises(APIError) as info:
        async_to_sync(go)()
    assert info.value.status == 503 and info.value.retry_after_s
    assert asyncio.run(tokens.count_text_tokens("Hello there")).exact  # a fresh pool works


def worker_refusal(tokenizer: Tokenizer, messages: list[dict], max_tokens: int | None,
                   context: int):
    """The worker's own error for a chat it cannot fit: preparation, then its engine."""
    from inference.engine.config import EngineConfig
    from inference.engine.llm_engine import InvalidRequestError, LLMEngine
    from inference.protocol.messages import ChatTurn, RequestMessage, Sampling
    from inference.worker.preparation import submit_args

    message = RequestMessage(request_id="r", tenant="t", fairness_key="t", priority=0,
                             fairness_weight=1.0, default_max_tokens=16,
                             messages=tuple(ChatTurn(**m) for m in messages),
                             sampling=Sampling(max_tokens=max_tokens))
    engine = LLMEngine(EngineConfig(backend="reference", max_model_len=context))
    with pytest.raises(InvalidRequestError) as info:
        engine.submit(**submit_args(message, tokenizer, context))
    return info.value.error


@pytest.mark.parametrize("max_tokens", [None, 50])
def test_the_web_refusal_is_the_workers_error(real_tokenizer, max_tokens):
    messages = [{"role": "user", "content": "word " * 300}]
    count = tokens.PromptCount(len(real_tokenizer.apply_chat_template(messages)), True, 0, 0)
    assert lifecycle.context_refusal(count, max_tokens, 256, "messages") == worker_refusal(
        real_tokenizer, messages, max_tokens, 256)
    fits = tokens.PromptCount(200, True, 0, 0)
    assert lifecycle.context_refusal(fits, max_tokens and 56, 256, "messages") is None


def test_an_estimate_without_the_models_tokenizer_refuses_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(tokens, "_process_folder", str(tmp_path))  # no tokenizer.json there
    count = tokens.measure_here([{"role": "user", "content": "word " * 300}], None, most=10)
    assert count.estimated and count.tokens > 256
    assert lifecycle.context_refusal(count, None, 256, "messages") is None


def test_a_prompt_of_only_dropped_characters_is_refused_as_having_no_tokens(real_tokenizer):
    # Not refused as too long (above), but it has no token to start from: a clear 400 that
    # says why, where the text itself is not empty.
    from inference.engine.llm_engine import InvalidRequestError
    from inference.engine.submission import build_request

    with pytest.raises(InvalidRequestError) as refused:
        build_request(real_tokenizer, [], 8192, prompt_token_ids=None, prompt="\x16\x04" * 500,
                      messages=None, sampling=None, tenant="t", fairness_key="t", priority=0,
                      fairness_weight=1.0, request_id=None, queue_wait_s=None)
    error = refused.value.error
    assert error.details == {"param": "prompt"} and "no tokens" in error.message
    assert error.code == "invalid_request"
