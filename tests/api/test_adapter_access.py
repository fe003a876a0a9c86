"""Who may call a LoRA adapter over the REST API: ``base:adapter`` on every endpoint that names
a model (chat and text completions, the Responses API, ``/v1/models``, batch lines), the same
404 as an unknown model for anything a key may not call, and the request queued for the base
model's workers carrying the adapter."""

from __future__ import annotations

import json

import pytest

from api import batch_runner
from api.models import BatchLine
from gateway import admission
from inference.protocol.messages import AdapterRef, RequestMessage
from tenants.models import LoraAdapter
from tests.api.test_api import MODEL
from tests.api.test_batches_api import create_batch, line, step_until
from tests.api.test_files_api import files_root  # noqa: F401 - the test's own files folder
from tests.api.test_model_access_api import ENDPOINTS, call
from tests.api.test_nullable_fields import in_process
from tests.support.adapters import registered, write_adapter

pytestmark = pytest.mark.django_db


@pytest.fixture
def adapters(adapter_root, make_tenant, base_config):
    """Two tenants (raw keys ``owner``, ``other``), each with an adapter of its own over the
    default model, a shared one, and the owner's pending, refused and disabled ones."""
    owner, _, owner_raw = make_tenant()
    other, _, other_raw = make_tenant()
    rows = {"own": registered(adapter_root, "own", owner),
            "theirs": registered(adapter_root, "theirs", other),
            "shared": registered(adapter_root, "shared"),
            "refused": registered(adapter_root, "refused", owner, rank=128),
            "pending": LoraAdapter.objects.create(
                name="pending", base_model=MODEL, owner=owner,
                folder=str(write_adapter(adapter_root / owner.slug / "pending"))),
            "off": registered(adapter_root, "off", owner)}
    LoraAdapter.objects.filter(pk=rows["off"].pk).update(enabled=False)
    rows["pending"].save()  # a save: every copy of the adapters served is read again
    return owner_raw, other_raw, rows


@pytest.mark.parametrize("path", ENDPOINTS)
def test_another_tenants_adapter_is_byte_for_byte_the_404_of_an_unknown_model(
        client, adapters, path):
    owner, other, rows = adapters
    name = f"{MODEL}:theirs"
    forbidden = call(client, owner, path, name)
    assert call(client, other, path, name).status_code != 404  # its owner's: served
    rows["theirs"].delete()
    unknown = call(client, owner, path, name)
    assert forbidden.status_code == unknown.status_code == 404
    assert forbidden.content == unknown.content
    assert forbidden["Content-Type"] == unknown["Content-Type"]
    error = forbidden.json()["error"]
    assert (error["code"], error["param"]) == ("model_not_found", "model")
    assert error["message"] == f"The model '{name}' does not exist or you do not have access " \
                               "to it."


@pytest.mark.parametrize("path", ENDPOINTS)
@pytest.mark.parametrize("name", ["pending", "refused", "off", "never"])
def test_an_adapter_not_ready_or_disabled_is_the_same_404(client, adapters, path, name):
    owner, _, _ = adapters
    response = call(client, owner, path, f"{MODEL}:{name}")
    reference = call(client, owner, path, f"{MODEL}:{name[::-1]}x")  # never existed
    assert response.status_code == 404
    assert response.content == reference.content.replace(
        f"{name[::-1]}x".encode(), name.encode())


@pytest.mark.parametrize("path", ENDPOINTS)
def test_a_shared_adapter_is_callable_by_every_tenant(client, adapters, path):
    owner, other, _ = adapters
    for raw in (owner, other):
        response = call(client, raw, path, f"{MODEL}:shared")
        # No worker runs: resolved, then refused for want of one (a model: found).
        assert response.status_code == (200 if path == "/v1/models" else 503), response.content


def test_an_adapter_over_a_base_model_the_key_may_not_call_is_404(client, adapters):
    owner, _, rows = adapters
    tenant = rows["own"].owner
    tenant.allowed_models = "org/*"
    tenant.save()
    for name in ("own", "shared"):
        assert call(client, owner, "/v1/models", f"{MODEL}:{name}").status_code == 404


def listed(client, raw: str) -> list[tuple[str, str]]:
    data = client.get("/v1/models", HTTP_AUTHORIZATION=f"Bearer {raw}").json()["data"]
    return [(m["id"], m["owned_by"]) for m in data]


def test_the_models_list_holds_the_adapters_each_key_may_call(client, adapters):
    owner, other, rows = adapters
    owner_slug, other_slug = rows["own"].owner.slug, rows["theirs"].owner.slug
    assert listed(client, owner) == [(MODEL, "llm-platform"), (f"{MODEL}:own", owner_slug),
                                     (f"{MODEL}:shared", "system")]
    assert listed(client, other) == [(MODEL, "llm-platform"), (f"{MODEL}:shared", "system"),
                                     (f"{MODEL}:theirs", other_slug)]


@pytest.fixture
def queued(monkeypatch, rclient, keys) -> list[tuple[RequestMessage, list[dict]]]:
    """Each request admitted, and what waited in the default model's queue right after."""
    seen = []
    real = admission.admit

    async def admit(*args, **kwargs):
        message = await real(*args, **kwargs)
        seen.append((message, [json.loads(raw) for raw in rclient.hvals(keys.fq("wait"))]))
        return message

    monkeypatch.setattr(admission, "admit", admit)
    return seen


@pytest.mark.parametrize("path", ENDPOINTS[:3])
def test_a_request_for_an_adapter_waits_in_its_base_models_queue_carrying_it(
        client, settings, adapters, live_worker, queued, path):
    settings.LLM_PLATFORM = {**settings.LLM_PLATFORM, "REQUEST_IDLE_TIMEOUT_S": 0.3}
    owner, _, rows = adapters
    client.raise_request_exception = False
    assert call(client, owner, path, f"{MODEL}:own").status_code == 504  # nobody answers
    [(message, waiting)] = queued
    expected = AdapterRef(name=f"{MODEL}:own", path=rows["own"].folder,
                          digest=rows["own"].digest, rank=4,
                          revision=f"{rows['own'].pk}-{int(rows['own'].validated_at.timestamp())}")
    assert message.adapter == expected
    assert (message.meta["model"], message.meta["adapter"]) == (MODEL, f"{MODEL}:own")
    [entry] = waiting
    assert RequestMessage.from_json(entry["body"]).adapter == expected


def test_batch_lines_run_an_adapter_the_batch_may_call_and_refuse_others(
        adapters, live_worker, monkeypatch):
    owner, _, rows = adapters
    sent = []
    real = batch_runner.lifecycle.start

    async def spy(*args, **kwargs):
        generation = await real(*args, **kwargs)
        sent.append(generation.message)
        return generation

    monkeypatch.setattr(batch_runner.lifecycle, "start", spy)
    lines = [line("own", "Hi", model=f"{MODEL}:own"),
             line("theirs", "Hi", model=f"{MODEL}:theirs")]
    made = in_process(owner, lambda client: create_batch(client, lines))
    step_until(made.id, lambda: sent and BatchLine.objects.filter(
        batch_id=made.id, state=BatchLine.State.FAILED).exists())
    [message] = sent
    assert message.adapter is not None and message.adapter.digest == rows["own"].digest
    assert message.meta["model"] == MODEL and message.batch
    failed = BatchLine.objects.get(batch_id=made.id, custom_id="theirs")
    response = failed.result["response"]
    assert response["status_code"] == 404
    assert response["body"]["error"]["message"] == (
        f"The model '{MODEL}:theirs' does not exist or you do not have access to it.")
