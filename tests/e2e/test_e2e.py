"""End to end on the real processes (daphne, two workers on the reference backend, Celery,
Redis, the database), driven by the ``openai`` client."""

from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tenants.models import UsageRecord
from tests.support.e2e import MODEL, client, start_stack, stats, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MAX_QUEUE_SIZE = 4


@pytest.fixture(scope="module")
def stack(request, django_db_setup, django_db_blocker, tmp_path_factory):
    return start_stack(request, django_db_blocker, tmp_path_factory, workers=2,
                       MAX_QUEUE_SIZE=MAX_QUEUE_SIZE, MAX_BATCH_SIZE=2, WORKER_PREFETCH=1)


@pytest.fixture
def operator(make_tenant, transactional_db) -> str:
    return make_tenant(operator_key=True)[2]


def ask(c: openai.OpenAI, prompt: str, max_tokens: int = 12) -> str:
    reply = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                      max_tokens=max_tokens, temperature=0)
    return reply.choices[0].message.content


def ask_stream(c: openai.OpenAI, prompt: str, max_tokens: int = 12) -> tuple[str, list]:
    chunks = list(c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
        temperature=0, stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    return text, chunks


def test_streaming_and_not_give_the_same_answer(stack, make_tenant, transactional_db):
    c = client(stack, make_tenant()[2])
    plain = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                      max_tokens=10, temperature=0)
    assert plain.usage.completion_tokens == 10
    assert plain.usage.prompt_tokens_details.cached_tokens >= 0
    text, chunks = ask_stream(c, "Hi", 10)
    assert text == plain.choices[0].message.content
    assert len({ch.id for ch in chunks}) == 1
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    completion = c.completions.create(model=MODEL, prompt="Once upon", max_tokens=5)
    assert completion.usage.completion_tokens == 5


def test_concurrent_streams_each_receive_exactly_their_own_tokens(stack, make_tenant, operator,
                                                                  transactional_db):
    c = client(stack, make_tenant()[2])
    prompts = [f"question number {i}" for i in range(MAX_QUEUE_SIZE)]
    expected = [ask(c, p, 24) for p in prompts]
    # The worker releases its gate-1 share on its next poll (within 50 ms), which can come
    # after a short answer has already reached the client; the burst below fills the queue.
    deadline = time.monotonic() + 5
    while stats(stack, operator)["gate1"]["queued"] and time.monotonic() < deadline:
        time.sleep(0.02)
    with ThreadPoolExecutor(len(prompts)) as pool:
        streamed = list(pool.map(lambda p: ask_stream(c, p, 24)[0], prompts))
    assert streamed == expected
    assert len(set(expected)) == len(expected)


def test_burst_over_max_queue_size_gets_429_and_the_queue_never_exceeds_it(
        stack, make_tenant, operator, transactional_db):
    c = client(stack, make_tenant()[2])
    peak = [0]
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], stats(stack, operator)["gate1"]["queued"])

    def one(i: int) -> str:
        try:
            ask(c, f"burst {i}", 64)
            return "ok"
        except openai.RateLimitError as exc:
            assert exc.response.headers.get("retry-after")
            # The status line as daphne wrote it (twisted's table lacks 429).
            assert exc.response.reason_phrase == "Too Many Requests"
            return exc.code or exc.body["code"]

    watcher = threading.Thread(target=watch)
    watcher.start()
    with ThreadPoolExecutor(24) as pool:
        outcomes = list(pool.map(one, range(24)))
    done.set()
    watcher.join()
    assert "queue_full" in outcomes and "ok" in outcomes
    assert set(outcomes) <= {"ok", "queue_full"}
    assert peak[0] <= MAX_QUEUE_SIZE
    assert wait_for(lambda: stats(stack, operator)["gate1"]["queued"] == 0)


def test_disconnect_mid_stream_frees_the_reservation(stack, make_tenant, operator,
                                                     transactional_db):
    tenant, _, raw = make_tenant()
    with httpx.stream("POST", f"{stack.url}/v1/chat/completions", timeout=30,
                      headers={"Authorization": f"Bearer {raw}"},
                      json={"model": MODEL, "messages": [{"role": "user", "content": "long"}],
                            "max_tokens": 7000, "stream": True}) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        for _ in range(6):
            next(lines)
    # The worker aborts it (it does not run on to max_tokens); its KV reservation is released.
    record = wait_for(lambda: UsageRecord.objects.filter(tenant=tenant).first(), 10)
    assert record is not None and record.finish_reason == "abort"
    assert 0 < record.completion_tokens < 7000 and record.status == 499
    assert wait_for(lambda: stats(stack, operator)["total"]["active_kv_reserved"] == 0, 5)


def test_usage_records_are_written_per_request(stack, make_tenant, transactional_db):
    tenant, key, raw = make_tenant()
    c = client(stack, raw)
    ask(c, "count me", 7)
    ask_stream(c, "count me too", 5)
    records = wait_for(lambda: list(UsageRecord.objects.filter(tenant=tenant)) if
                       UsageRecord.objects.filter(tenant=tenant).count() == 2 else None, 10)
    assert records and {r.completion_tokens for r in records} == {7, 5}
    assert all(r.api_key_id == key.pk and r.status == 200 and r.ttft_s is not None
               for r in records)


def test_tenant_a_key_never_reaches_tenant_b(stack, make_tenant, transactional_db):
    tenant_a, key_a, raw_a = make_tenant()
    tenant_b, _, raw_b = make_tenant()
    a, b = client(stack, raw_a), client(stack, raw_b)
    with ThreadPoolExecutor(2) as pool:
        fa = pool.submit(ask_stream, a, "tenant a", 16)
        fb = pool.submit(ask_stream, b, "tenant b", 16)
        (text_a, chunks_a), (text_b, chunks_b) = fa.result(), fb.result()
    assert text_a == ask(b, "tenant a", 16) and text_b == ask(a, "tenant b", 16)
    assert {ch.id for ch in chunks_a}.isdisjoint({ch.id for ch in chunks_b})
    assert wait_for(lambda: UsageRecord.objects.filter(tenant=tenant_a).count() == 2, 10)
    assert not UsageRecord.objects.filter(tenant=tenant_a).exclude(api_key=key_a).exists()
    denied = httpx.get(f"{stack.url}/scheduler/stats", headers={"Authorization": f"Bearer {raw_a}"})
    assert denied.status_code == 403
    key_a.revoked_at = key_a.created_at
    key_a.save()
    with pytest.raises(openai.AuthenticationError):
        ask(a, "revoked")
    assert ask(b, "still fine")


def test_two_workers_share_the_load(stack, make_tenant, operator, transactional_db):
    c = client(stack, make_tenant()[2])
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda i: ask(c, f"share {i}", 48), range(4)))
    workers = stats(stack, operator)["workers"]
    assert len(workers) == 2
    assert all(w["tokens_generated"] > 0 for w in workers.values())


def test_sigterm_stops_a_worker_cleanly(stack, make_tenant, operator, transactional_db):
    extra = stack.start_worker()
    stack.wait_ready(3, 60)
    extra.send_signal(signal.SIGTERM)
    assert extra.wait(30) == 0
    assert wait_for(lambda: len(stats(stack, operator)["workers"]) == 2, 5)
    assert ask(client(stack, make_tenant()[2]), "after sigterm")
