"""A noisy neighbour: tenant B streams while tenant A sends every hostile input it can.

The whole platform runs as separate processes (daphne, one worker on the reference backend at a
model-like pace, Celery). B's answer, streamed while A's inputs arrive, must be the answer B gets
alone; each of A's inputs gets its own clear answer, never a 5xx.
"""

from __future__ import annotations

import threading

import httpx
import pytest

from tests.support.e2e import MODEL, client, start_stack

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STEP_S = 0.02


@pytest.fixture(scope="module")
def stack(request, django_db_setup, django_db_blocker, tmp_path_factory):
    return start_stack(request, django_db_blocker, tmp_path_factory, workers=1,
                       REFERENCE_STEP_DELAY_S=STEP_S, MAX_BATCH_SIZE=8)


def chat(content: str, **fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **fields}


# What tenant A sends: (name, the raw body) and the status each must get (< 500 in any case).
HOSTILE = [
    ("tiny temperature", chat("hi", temperature=1e-40, max_tokens=8), {200}),
    ("tiny top_p", chat("hi", top_p=1e-300, temperature=1.0, max_tokens=8), {200}),
    ("both, one token", chat("hi", temperature=1e-40, top_p=1e-300, max_tokens=1), {200}),
    ("huge temperature", chat("hi", temperature=2, top_k=10**9, max_tokens=8), {200}),
    ("null fields", chat("hi", temperature=None, top_p=None, n=None, stream=None,
                         max_tokens=4), {200}),
    ("huge prompt", chat("word " * 480_000, max_tokens=4), {400}),
    ("over the context", chat("x" * 9_000, max_tokens=4), {400}),
    ("a seed out of range", chat("hi", seed=2**70, max_tokens=4), {400}),
    ("bad stop", chat("hi", stop=["a"] * 9, max_tokens=4), {400}),
]
RAW_HOSTILE = [
    ("deep nesting", "[" * 100_000 + "]" * 100_000, {400}),
    ("not JSON", b"\xff\xfe not json", {400}),
    ("NaN", '{"model": "' + MODEL + '", "messages": [], "temperature": NaN}', {400}),
]


def test_a_tenants_stream_is_untouched_by_its_neighbours_hostile_inputs(stack, make_tenant,
                                                                         transactional_db):
    b = client(stack, make_tenant()[2])
    a_key = make_tenant()[2]
    question = "Tell me about the lighthouse keeper and his lamp."

    def ask_b() -> str:
        chunks = b.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=150,
            temperature=0, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    alone = ask_b()
    streamed: list[str] = []
    b_thread = threading.Thread(target=lambda: streamed.append(ask_b()))
    b_thread.start()
    answers = {}
    with httpx.Client(base_url=stack.url, timeout=60,
                      headers={"Authorization": f"Bearer {a_key}"}) as http:
        for name, body, _ in HOSTILE:
            answers[name] = http.post("/v1/chat/completions", json=body)
        for name, raw, _ in RAW_HOSTILE:
            answers[name] = http.post("/v1/chat/completions", content=raw,
                                      headers={"Content-Type": "application/json"})
    b_thread.join(120)

    for name, _, expected in HOSTILE + RAW_HOSTILE:
        response = answers[name]
        assert response.status_code in expected, (name, response.status_code, response.text)
        if response.status_code != 200:
            assert "error" in response.json(), name
    assert streamed == [alone], "B's answer changed while A was hostile"
    assert alone
