"""Several base models and per-key access over the REST API: ``/v1/models`` lists what a key may
call, a model it may not call and one not served get the same 404 on every endpoint that names a
model, batch lines included, and a request is counted with its model's tokenizer."""

from __future__ import annotations

import json

import openai
import pytest

from gateway import tokens
from gateway.tokenizer_folders import counting_folder, tokenizer_folder
from tenants.models import ServedModel
from tenants.services import create_api_key
from tests.api.test_api import MODEL
from tests.api.test_batches_api import create_batch, line, outputs, run_until_ended
from tests.api.test_files_api import files_root  # noqa: F401 - the test's own files folder
from tests.api.test_nullable_fields import in_process
from tests.gateway.test_model_registry import byte_tokenizer_folder

pytestmark = pytest.mark.django_db

SECOND = "org/model-2"


@pytest.fixture
def registry(tmp_path):
    """A second model with its own tokenizer, models under two prefixes and a disabled one."""
    folder = byte_tokenizer_folder(tmp_path / "model-2")
    ServedModel.objects.create(name=SECOND, model_path=str(folder))
    for name in ("bedrock/claude", "bedrockz/claude", "bedrock/a/b"):
        ServedModel.objects.create(name=name, model_path=f"/models/{name}")
    ServedModel.objects.create(name="retired", model_path="/models/retired", enabled=False)
    return folder


def listed(raw_key: str) -> list[str]:
    async def calls(client: openai.AsyncOpenAI):
        return [m.id async for m in client.models.list()]

    return in_process(raw_key, calls)


def test_each_key_lists_the_models_it_may_call(make_tenant, registry):
    _, _, open_raw = make_tenant()
    assert listed(open_raw) == [MODEL, "bedrock/a/b", "bedrock/claude", "bedrockz/claude",
                                SECOND]
    tenant, _, raw = make_tenant(allowed_models=f"bedrock/*\n{MODEL}, retired, org/*")
    assert listed(raw) == [MODEL, "bedrock/claude", SECOND]  # never bedrockz/..., bedrock/a/b
    _, narrow_raw = create_api_key(tenant, "narrow")
    narrow = tenant.api_keys.get(name="narrow")
    narrow.allowed_models = "org/*, gpt-*"  # gpt-*: nothing served; org/*: the tenant allows
    narrow.save()
    assert listed(narrow_raw) == [SECOND]
    # An entry of the default model's name rules it: disabled, no key lists it.
    ServedModel.objects.create(name=MODEL, model_path="/models/smol", enabled=False)
    assert listed(raw) == ["bedrock/claude", SECOND]
    assert MODEL not in listed(open_raw)


def test_a_listed_model_is_retrieved_and_others_are_404_for_the_openai_client(make_tenant,
                                                                              registry):
    _, _, raw = make_tenant(allowed_models="org/*")

    async def calls(client: openai.AsyncOpenAI):
        found = await client.models.retrieve(SECOND)
        errors = []
        for name in (MODEL, "bedrock/claude", "retired", "no-such-model"):
            try:
                await client.models.retrieve(name)
            except openai.NotFoundError as exc:
                errors.append(exc)
        return found, errors

    found, errors = in_process(raw, calls)
    assert (found.id, found.object, found.created > 0) == (SECOND, "model", True)
    assert [(e.status_code, e.code, e.param) for e in errors] == [
        (404, "model_not_found", "model")] * 4


def body_for(path: str, model: object) -> dict:
    if path == "/v1/chat/completions":
        return {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    if path == "/v1/completions":
        return {"model": model, "prompt": "Hi", "max_tokens": 2}
    return {"model": model, "input": "Hi", "max_output_tokens": 4}


def call(client, raw_key: str, path: str, model: str):
    headers = {"HTTP_AUTHORIZATION": f"Bearer {raw_key}"}
    if path == "/v1/models":
        return client.get(f"/v1/models/{model}", **headers)
    return client.post(path, json.dumps(body_for(path, model)), content_type="application/json",
                       **headers)


ENDPOINTS = ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models"]


@pytest.mark.parametrize("path", ENDPOINTS)
def test_a_forbidden_model_and_an_unknown_one_get_byte_for_byte_the_same_404(
        client, make_tenant, registry, path):
    _, _, limited = make_tenant(allowed_models="bedrock/*")
    _, _, unlimited = make_tenant()
    secret = SECOND  # served, and this tenant may not call it
    forbidden = call(client, limited, path, secret)
    ServedModel.objects.filter(name=secret).update(enabled=False)
    ServedModel.objects.get(name="retired").save()  # a save here: read again at once
    disabled = call(client, unlimited, path, secret)
    ServedModel.objects.filter(name=secret).delete()
    unknown = call(client, unlimited, path, secret)
    assert forbidden.status_code == disabled.status_code == unknown.status_code == 404
    assert forbidden.content == disabled.content == unknown.content
    assert forbidden["Content-Type"] == unknown["Content-Type"]
    error = forbidden.json()["error"]
    assert (error["code"], error["param"], error["type"]) == (
        "model_not_found", "model", "invalid_request_error")
    assert "bedrock" not in error["message"] and MODEL not in error["message"]
    # The default model, not in the tenant's rules: the same words as for a name never served.
    not_allowed = call(client, limited, path, MODEL).json()["error"]["message"]
    assert not_allowed == error["message"].replace(secret, MODEL)


@pytest.mark.parametrize("path", ENDPOINTS[:3])
def test_a_model_that_is_not_a_string_is_still_the_schemas_400(client, tenant_key, registry,
                                                               path):
    response = call(client, tenant_key[2], path, 5)  # type: ignore[arg-type]
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "model"


@pytest.fixture
def counted_with(monkeypatch):
    """The tokenizer folders the prompts were counted with (in the counting processes)."""
    seen: list[str] = []
    real = tokens.run

    async def spy(fn, *args, folder=None):
        seen.append(counting_folder(folder))
        return await real(fn, *args, folder=folder)

    monkeypatch.setattr(tokens, "run", spy)
    return seen


@pytest.mark.parametrize("path", ENDPOINTS[:3])
def test_a_request_for_a_second_model_is_counted_with_its_own_tokenizer(
        client, tenant_key, registry, counted_with, path):
    # No worker runs: the request is resolved and counted, then refused for want of a worker.
    assert call(client, tenant_key[2], path, SECOND).status_code not in (400, 404)
    assert call(client, tenant_key[2], path, MODEL).status_code == 503
    assert counted_with == [str(registry), str(tokenizer_folder())]


def test_a_batch_line_naming_a_model_its_key_may_not_call_is_refused_by_line(
        tenant_key, registry, inproc_worker):
    tenant, key, raw = tenant_key
    key.allowed_models = f"{MODEL}, bedrock/*"
    key.save()
    lines = [line("ok", "Hi"), line("forbidden", "Hi", model=SECOND),
             line("unknown", "Hi", model="org/model-3"),
             line("tenant-forbidden", "Hi", model="bedrock/claude")]
    tenant.allowed_models = f"{MODEL}, {SECOND}"
    tenant.save()
    made = in_process(raw, lambda client: create_batch(client, lines))
    row = run_until_ended(made.id)
    assert (row.status, row.completed, row.failed) == ("completed", 1, 3)
    out, err = outputs(raw, row)
    assert [o["custom_id"] for o in out] == ["ok"]
    by_id = {e["custom_id"]: e["response"] for e in err}
    assert {r["status_code"] for r in by_id.values()} == {404}
    bodies = {custom_id: json.dumps(r["body"]) for custom_id, r in by_id.items()}
    assert bodies["forbidden"] == bodies["unknown"].replace("org/model-3", SECOND)
    assert bodies["tenant-forbidden"] == bodies["unknown"].replace("org/model-3",
                                                                   "bedrock/claude")
    assert by_id["forbidden"]["body"]["error"]["code"] == "model_not_found"
