"""End to end on the real default model (one worker), driven by the ``openai`` client."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.support.e2e import MODEL, client, start_stack

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.model]


@pytest.fixture(scope="module")
def stack(request, django_db_setup, django_db_blocker, tmp_path_factory):
    from inference.protocol.settings import PlatformSettings

    if not (PlatformSettings().model_folder / "config.json").is_file():
        pytest.skip("the default model is not prepared: python -m inference.worker.prepare_model")
    return start_stack(request, django_db_blocker, tmp_path_factory, workers=1,
                       BACKEND="transformers", MAX_BATCH_SIZE=4)


def test_chat_on_the_real_model(stack, make_tenant, transactional_db):
    c = client(stack, make_tenant()[2])
    reply = c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=16, temperature=0)
    assert reply.choices[0].message.content.strip()
    assert reply.usage.prompt_tokens > 5 and 0 < reply.usage.completion_tokens <= 16


def test_concurrent_streams_on_the_real_model(stack, make_tenant, transactional_db):
    c = client(stack, make_tenant()[2])

    def stream(prompt: str):
        chunks = list(c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=12,
            temperature=0, stream=True, stream_options={"include_usage": True}))
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        return text, chunks

    prompts = ["Name a colour.", "Name an animal.", "Say hello."]
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(stream, prompts))
    ids = [{ch.id for ch in chunks} for _, chunks in results]
    assert all(len(s) == 1 for s in ids) and len(set.union(*ids)) == 3
    for text, chunks in results:
        assert text.strip()
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens <= 12
