"""A tenant's LoRA adapter end to end, on the real processes (daphne, a worker, Celery) and the
``openai`` client: uploaded over the API, checked by Celery, served as ``base:adapter`` by the
worker beside the bare model, billed and counted under its name; another tenant gets a 404."""

from __future__ import annotations

import httpx
import openai
import pytest

from benchmarks.harness.adapters import make_adapter
from tests.support.e2e import MODEL, client, start_stack, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.model]

PROMPT = "The three most useful metals are"


@pytest.fixture(scope="module")
def stack(request, django_db_setup, django_db_blocker, tmp_path_factory):
    from inference.protocol.settings import PlatformSettings

    if not (PlatformSettings().model_folder / "config.json").is_file():
        pytest.skip("the default model is not prepared: python -m inference.worker.prepare_model")
    root = tmp_path_factory.mktemp("adapter-root")
    stack = start_stack(request, django_db_blocker, tmp_path_factory, workers=1,
                        BACKEND="transformers", MAX_BATCH_SIZE=4, ADAPTER_ROOT=str(root))
    stack.adapter_root = root
    return stack


def upload(stack, raw_key: str, folder, name: str) -> httpx.Response:
    files = {"adapter_config": ("adapter_config.json",
                                (folder / "adapter_config.json").read_bytes()),
             "adapter_model": ("adapter_model.safetensors",
                               (folder / "adapter_model.safetensors").read_bytes())}
    return httpx.post(f"{stack.url}/v1/adapters", data={"name": name, "model": MODEL},
                      files=files, headers={"Authorization": f"Bearer {raw_key}"}, timeout=60)


def test_an_uploaded_adapter_is_checked_served_and_billed_for_its_tenant_only(
        stack, make_tenant, transactional_db, tmp_path):
    from inference.protocol.settings import PlatformSettings
    from tenants.models import UsageRecord

    tenant, _, raw = make_tenant()
    _, _, other = make_tenant()
    made = tmp_path / "made"
    make_adapter(PlatformSettings().model_folder, made, rank=8, seed=7)
    answer = upload(stack, raw, made, "metals")
    assert answer.status_code in (200, 201), answer.text
    name = f"{MODEL}:metals"
    headers = {"Authorization": f"Bearer {raw}"}

    def state() -> str:
        return httpx.get(f"{stack.url}/v1/adapters/{name}", headers=headers,
                         timeout=10).json()["state"]

    assert wait_for(lambda: state() != "pending", 60, 0.2) and state() == "ready"
    assert name in [m.id for m in client(stack, raw).models.list().data]

    def complete(key: str, model: str) -> str:
        reply = client(stack, key).completions.create(model=model, prompt=PROMPT, max_tokens=12,
                                                      temperature=0)
        return reply.choices[0].text

    base = complete(raw, MODEL)
    tuned = complete(raw, name)
    again = complete(raw, name)
    assert tuned != base and again == tuned  # the adapter's own greedy answer, every time
    with pytest.raises(openai.NotFoundError):  # another tenant cannot call it, nor see it
        complete(other, name)
    assert name not in [m.id for m in client(stack, other).models.list().data]

    def billed() -> list[UsageRecord]:
        rows = list(UsageRecord.objects.filter(tenant=tenant).order_by("created_at"))
        return rows if len(rows) == 3 else []

    records = wait_for(billed, 30, 0.2)
    assert [r.adapter for r in records] == ["", name, name], records
    assert all(r.model == MODEL and r.completion_tokens == 12 for r in records)
    _, _, operator = make_tenant(operator_key=True)

    def metrics() -> str:
        return httpx.get(f"{stack.url}/metrics", timeout=10,
                         headers={"Authorization": f"Bearer {operator}"}).text

    loaded = [line for line in metrics().splitlines()
              if line.startswith("llm_adapter_loaded{") and f'adapter="{name}"' in line]
    assert loaded and loaded[0].endswith(" 1.0"), loaded
    wait_for(lambda: f'llm_adapter_requests_total{{adapter="{name}",status="200"}}' in metrics(),
             15, 0.3)
    assert f'llm_adapter_requests_total{{adapter="{name}",status="200"}} 2.0' in metrics()
