"""Log-probabilities through the REST API (in-process worker, reference backend), read with the
``openai`` client: chat ``logprobs``/``top_logprobs`` and completions ``logprobs``/``echo``,
streaming or not, with OpenAI's shapes and bounds, and the values of a direct pass."""

from __future__ import annotations

import math

import openai
import pytest
import torch

from inference.engine.backends.reference import ByteTokenizer, ReferenceBackend
from tests.api.test_api import MODEL, chat, error_of, post
from tests.api.test_nullable_fields import in_process

pytestmark = pytest.mark.django_db

TEXT = "/v1/completions"
MESSAGES = [{"role": "user", "content": "Hello"}]
PROMPT = "Once upon a time, é"  # a character split over two byte tokens
REFERENCE = ReferenceBackend()


def direct(ids: list[int]) -> torch.Tensor:
    """``[vocab]`` log-probabilities of the next token after ``ids`` (a direct pass)."""
    return torch.log_softmax(REFERENCE.logits_after(ids), dim=-1)


def token_id(raw: list[int]) -> int:
    """The reference tokenizer's id of a token's bytes (one byte a token, or EOS or BOS)."""
    named = {b"<eos>": ByteTokenizer.eos_token_id, b"<bos>": ByteTokenizer.bos_token_id}
    return named.get(bytes(raw), raw[0])


def check_chat_entries(entries, prompt_ids: list[int], top_k: int) -> list[int]:
    out: list[int] = []
    for entry in entries:
        want = direct(prompt_ids + out)
        token = token_id(entry.bytes)
        assert entry.token == bytes(entry.bytes).decode("utf-8", "replace") or \
            entry.token.startswith("bytes:")
        assert entry.logprob == pytest.approx(want[token].item(), abs=1e-5)
        tops = entry.top_logprobs
        assert [t.logprob for t in tops] == pytest.approx(want.topk(top_k).values.tolist(),
                                                          abs=1e-5)
        assert [token_id(t.bytes) for t in tops] == want.topk(top_k).indices.tolist()
        out.append(token)
    return out


def test_chat_logprobs_streamed_or_not(tenant_key, inproc_worker):
    async def calls(client: openai.AsyncOpenAI):
        reply = await client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True,
            top_logprobs=3)
        chunks = [c async for c in await client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True,
            top_logprobs=3, stream=True)]
        plain = await client.chat.completions.create(model=MODEL, messages=MESSAGES,
                                                     max_tokens=2)
        return reply, chunks, plain

    reply, chunks, plain = in_process(tenant_key[2], calls)
    choice = reply.choices[0]
    entries = choice.logprobs.content
    assert len(entries) == 5
    prompt_ids = ByteTokenizer().apply_chat_template(MESSAGES)
    output = check_chat_entries(entries, prompt_ids, 3)
    assert bytes(output).decode() == choice.message.content
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in entries]
    assert plain.choices[0].logprobs is None


def test_completion_echo_scores_the_prompt_streamed_or_not(tenant_key, inproc_worker):
    async def calls(client: openai.AsyncOpenAI):
        reply = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3,
                                                temperature=0, logprobs=2, echo=True)
        chunks = [c async for c in await client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2, echo=True,
            stream=True)]
        echo_only = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2,
                                                    echo=True)
        return reply, chunks, echo_only

    reply, chunks, echo_only = in_process(tenant_key[2], calls)
    choice = reply.choices[0]
    assert choice.text.startswith(PROMPT)
    lp = choice.logprobs
    ids = list(PROMPT.encode())
    n = len(ids) + 3
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
    # Nothing predicts the first token; every other one is scored against what precedes it.
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    sequence = ids + list(choice.text[len(PROMPT):].encode())
    for p in range(1, n):
        want = direct(sequence[:p])
        assert lp.token_logprobs[p] == pytest.approx(want[sequence[p]].item(), abs=1e-5)
        top = lp.top_logprobs[p]
        assert lp.tokens[p] in top and len(top) in (2, 3)  # the chosen token, and the top 2
        values = list(top.values())
        assert values[:2] == pytest.approx(want.topk(2).values.tolist(), abs=1e-5)
    assert lp.tokens[len(PROMPT) - 1] == "bytes:\\xc3"  # é's first byte
    # Where each token starts in the text: a split character counts once, at its last byte.
    assert lp.text_offset[:3] == [0, 1, 2] and lp.text_offset[len(ids)] == len(PROMPT)
    assert all(math.isfinite(v) for v in lp.token_logprobs[1:])
    # The stream: the prompt and its logprobs first, then each token; the same lists joined.
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert texts[0] == PROMPT and "".join(texts) == choice.text
    joined = {key: [v for c in chunks if c.choices and c.choices[0].logprobs
                    for v in getattr(c.choices[0].logprobs, key)]
              for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    assert joined == {key: getattr(lp, key) for key in joined}
    assert echo_only.choices[0].text.startswith(PROMPT) and echo_only.choices[0].logprobs is None


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    ("/v1/chat/completions", chat(top_logprobs=2), "top_logprobs"),
    ("/v1/chat/completions", chat(logprobs=1), "logprobs"),
    (TEXT, {"model": MODEL, "prompt": "Hi", "logprobs": 6}, "logprobs"),
    (TEXT, {"model": MODEL, "prompt": "Hi", "logprobs": True}, "logprobs"),
    (TEXT, {"model": MODEL, "prompt": "Hi", "echo": 1}, "echo"),
])
def test_out_of_bounds_logprobs_get_400_naming_the_field(client, tenant_key, path, body, param):
    response = post(client, tenant_key[2], body, path=path)
    assert response.status_code == 400
    assert error_of(response)["param"] == param


def offsets_of(tokens: list[str]) -> list[int]:
    """Where each token starts in their joined text (characters)."""
    starts, at = [], 0
    for token in tokens:
        starts.append(at)
        at += len(token)
    return starts


def test_logprobs_cover_exactly_the_text_a_stop_string_cuts(tenant_key, inproc_worker):
    """With ``stop``, the entries are those of the returned text, streamed or not, on both
    endpoints: their tokens join to the text, and ``text_offset`` places them in it."""
    prompt = "Once upon a time"

    async def calls(client: openai.AsyncOpenAI):
        free_text = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                                    temperature=0)
        free_chat = await client.chat.completions.create(model=MODEL, messages=MESSAGES,
                                                         max_tokens=12, temperature=0)
        text_stop = free_text.choices[0].text[6:8]
        chat_stop = free_chat.choices[0].message.content[6:8]
        text_args = dict(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, logprobs=2,
                         stop=[text_stop])
        chat_args = dict(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0,
                         logprobs=True, top_logprobs=2, stop=[chat_stop])
        return {
            "free": (free_text.choices[0].text, free_chat.choices[0].message.content),
            "stops": (text_stop, chat_stop),
            "text": await client.completions.create(**text_args),
            "text_stream": [c async for c in await client.completions.create(
                **text_args, stream=True)],
            "chat": await client.chat.completions.create(**chat_args),
            "chat_stream": [c async for c in await client.chat.completions.create(
                **chat_args, stream=True)],
        }

    got = in_process(tenant_key[2], calls)
    (free_text, free_chat), (text_stop, chat_stop) = got["free"], got["stops"]
    want_text = free_text[:free_text.index(text_stop)]
    want_chat = free_chat[:free_chat.index(chat_stop)]
    assert want_text and want_chat  # the stop strings cut inside the answers

    choice = got["text"].choices[0]
    lp = choice.logprobs
    assert choice.text == want_text and choice.finish_reason == "stop"
    assert "".join(lp.tokens) == want_text
    assert len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.tokens)
    assert lp.text_offset == offsets_of(lp.tokens)
    chunks = [c.choices[0] for c in got["text_stream"] if c.choices]
    assert "".join(c.text for c in chunks) == want_text
    streamed = {key: [v for c in chunks if c.logprobs for v in getattr(c.logprobs, key)]
                for key in ("tokens", "token_logprobs", "text_offset")}
    assert streamed == {key: getattr(lp, key) for key in streamed}

    choice = got["chat"].choices[0]
    assert choice.message.content == want_chat and choice.finish_reason == "stop"
    entries = choice.logprobs.content
    assert "".join(e.token for e in entries) == want_chat
    assert b"".join(bytes(e.bytes) for e in entries).decode() == want_chat
    chunks = [c.choices[0] for c in got["chat_stream"] if c.choices]
    assert "".join(c.delta.content or "" for c in chunks) == want_chat
    streamed = [e for c in chunks if c.logprobs for e in c.logprobs.content]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in entries]
