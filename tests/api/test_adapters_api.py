"""LoRA adapters over the API (``/v1/adapters``) and the operator's ``register_adapter``: an
upload written privately under ``ADAPTER_ROOT`` and checked, what an upload is refused for,
who sees and deletes what; and the admin's page of adapters."""

from __future__ import annotations

import hashlib
import json
import re
import stat
from pathlib import Path

import pytest
from asgiref.sync import async_to_sync
from django.conf import settings as django_settings
from django.core.files.uploadedfile import SimpleUploadedFile
from django.core.management import CommandError, call_command
from django.urls import reverse

from api import file_views
from gateway.model_registry import model_not_found
from tenants.models import LoraAdapter, ServedModel
from tests.api.test_api import MODEL
from tests.support.adapters import (
    adapter_config,
    default_config,
    lora_tensors,
    registered,
    safetensors_bytes,
    write_adapter,
)

pytestmark = pytest.mark.django_db


def weights(**options) -> bytes:
    return safetensors_bytes(lora_tensors(default_config(), **options))


def upload(client, raw_key: str, *, name: str = "mine", model: str = MODEL,
           config: bytes | None = None, model_file: bytes | None = None,
           model_filename: str = "adapter_model.safetensors", omit: tuple[str, ...] = (),
           **extra):
    """``POST /v1/adapters`` as a client's form (the parts named in ``omit`` left out)."""
    data = {"name": name, "model": model,
            "adapter_config": SimpleUploadedFile(
                "adapter_config.json", config if config is not None
                else json.dumps(adapter_config()).encode()),
            "adapter_model": SimpleUploadedFile(
                model_filename, model_file if model_file is not None else weights()),
            **extra}
    return client.post("/v1/adapters", {k: v for k, v in data.items() if k not in omit},
                       HTTP_AUTHORIZATION=f"Bearer {raw_key}")


def get(client, raw_key: str, path: str):
    return client.get(path, HTTP_AUTHORIZATION=f"Bearer {raw_key}")


def test_an_upload_is_written_privately_checked_and_then_listed_and_callable(
        client, tenant_key, make_tenant, adapter_root, checks_inline,
        django_capture_on_commit_callbacks):
    tenant, _, raw = tenant_key
    with django_capture_on_commit_callbacks(execute=True):
        response = upload(client, raw)
    assert response.status_code == 200, response.content
    made = response.json()
    assert (made["id"], made["object"], made["state"], made["owned_by"], made["refusal"]) == (
        f"{MODEL}:mine", "adapter", "pending", tenant.slug, None)
    folder = Path(LoraAdapter.objects.get().folder)  # a folder of its own, made new for it
    assert folder.parent == adapter_root / tenant.slug / MODEL
    assert re.fullmatch(r"mine\.[0-9a-f]{16}", folder.name)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert stat.S_IMODE((adapter_root / tenant.slug).stat().st_mode) == 0o700
    assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json",
                                                      "adapter_model.safetensors"]
    assert {stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir()} == {0o600}
    assert (folder / "adapter_model.safetensors").read_bytes() == weights()
    assert len(checks_inline) == 1  # queued once its row was committed

    shown = get(client, raw, f"/v1/adapters/{MODEL}:mine").json()
    assert (shown["state"], shown["rank"], shown["target_modules"]) == (
        "ready", 4, ["q_proj", "v_proj"])
    assert shown["digest"] == hashlib.sha256(weights()).hexdigest()
    assert [a["id"] for a in get(client, raw, "/v1/adapters").json()["data"]] == [
        f"{MODEL}:mine"]
    models = get(client, raw, "/v1/models").json()["data"]
    assert [m["id"] for m in models] == [MODEL, f"{MODEL}:mine"]
    assert (models[1]["owned_by"], models[1]["parent"]) == (tenant.slug, MODEL)
    assert get(client, raw, f"/v1/models/{MODEL}:mine").json()["id"] == f"{MODEL}:mine"

    _, _, other = make_tenant()
    assert get(client, other, "/v1/adapters").json()["data"] == []
    assert get(client, other, f"/v1/adapters/{MODEL}:mine").status_code == 404
    assert [m["id"] for m in get(client, other, "/v1/models").json()["data"]] == [MODEL]


def refusal(response) -> tuple[int, str | None, str | None]:
    error = response.json()["error"]
    return response.status_code, error["param"], error["code"]


@pytest.mark.parametrize(("change", "expected"), [
    ({"omit": ("name",)}, (400, "name", "missing_required_parameter")),
    ({"omit": ("model",)}, (400, "model", "missing_required_parameter")),
    ({"omit": ("adapter_config",)}, (400, "adapter_config", "missing_required_parameter")),
    ({"omit": ("adapter_model",)}, (400, "adapter_model", "missing_required_parameter")),
    ({"adapter_model": "text"}, (400, "adapter_model", "invalid_value")),
    ({"name": "a/b"}, (400, "name", "invalid_value")),
    ({"name": "x" * 65}, (400, "name", "invalid_value")),
    ({"name": "-dash"}, (400, "name", "invalid_value")),
    ({"purpose": "batch"}, (400, "purpose", "unknown_parameter")),
    ({"name": ["one", "two"]}, (400, "name", "invalid_value")),
    ({"config": b"{not json"}, (400, "adapter_config", "invalid_file")),
    ({"config": b"[1, 2]"}, (400, "adapter_config", "invalid_file")),
    # A pickle, under its own name or under the safetensors file's.
    ({"model_filename": "adapter_model.bin", "model_file": b"\x80\x04\x95" + b"\0" * 64},
     (400, "adapter_model", "invalid_file")),
    ({"model_file": b"\x80\x04\x95" + b"\0" * 64}, (400, "adapter_model", "invalid_file")),
    ({"model_file": b"not a safetensors file at all"}, (400, "adapter_model", "invalid_file")),
])
def test_what_an_upload_is_refused_for(client, tenant_key, adapter_root, change, expected):
    assert refusal(upload(client, tenant_key[2], **change)) == expected
    assert not LoraAdapter.objects.exists() and not any(adapter_root.iterdir())


def test_a_json_body_is_told_that_an_upload_is_a_form(client, tenant_key, adapter_root):
    answer = client.post("/v1/adapters", {"name": "mine", "model": MODEL},
                         content_type="application/json",
                         HTTP_AUTHORIZATION=f"Bearer {tenant_key[2]}")
    assert refusal(answer) == (400, "name", "missing_required_parameter")
    assert "multipart/form-data" in answer.json()["error"]["message"]


def test_files_over_max_adapter_bytes_are_413_naming_the_limit(client, settings, tenant_key,
                                                               adapter_root):
    assert django_settings.LLM_PLATFORM["MAX_BODY_BYTES_BY_PATH"]["/v1/adapters"] == (
        django_settings.LLM_PLATFORM["MAX_ADAPTER_BYTES"]
        + django_settings.MULTIPART_OVERHEAD_BYTES)  # the web process's limit, before reading
    body = weights()
    settings.LLM_PLATFORM = {**settings.LLM_PLATFORM, "MAX_ADAPTER_BYTES": len(body) // 2}
    streamed = upload(client, tenant_key[2], model_file=body)  # its Content-Length fits
    settings.LLM_PLATFORM = {**settings.LLM_PLATFORM, "MAX_ADAPTER_BYTES": 1000}
    declared = upload(client, tenant_key[2], model_file=body)  # refused from its length
    for response, limit in ((streamed, len(body) // 2), (declared, 1000)):
        assert refusal(response) == (413, "adapter_model", "request_too_large")
        error = response.json()["error"]
        assert f"limit of {limit} bytes (MAX_ADAPTER_BYTES)" in error["message"]
        assert error["details"] == {"limit_bytes": limit}
    assert not LoraAdapter.objects.exists() and not any(adapter_root.iterdir())


def test_a_base_model_the_key_may_not_call_or_not_served_is_the_404_of_an_unknown_model(
        client, make_tenant, adapter_root):
    ServedModel.objects.create(name="org/secret", model_path="/models/secret")
    _, _, limited = make_tenant(allowed_models=MODEL)
    forbidden = upload(client, limited, model="org/secret")
    ServedModel.objects.filter(name="org/secret").delete()
    unknown = upload(client, limited, model="org/secret")
    assert forbidden.status_code == unknown.status_code == 404
    assert forbidden.content == unknown.content
    assert forbidden.json() == json.loads(json.dumps(model_not_found("org/secret").body()))


def test_names_are_per_tenant_and_409_names_only_its_own_or_a_shared_adapter(
        client, tenant_key, make_tenant, adapter_root, base_config,
        django_capture_on_commit_callbacks):
    # Another tenant's adapter of the same name is no business of this one's: its upload is
    # taken (no 409 that would tell the name is used), and each tenant's keys reach its own.
    tenant, _, raw = tenant_key
    assert upload(client, raw).status_code == 200
    assert refusal(upload(client, raw)) == (409, "name", "adapter_exists")
    other, _, other_raw = make_tenant()
    assert upload(client, other_raw).status_code == 200
    assert LoraAdapter.objects.filter(name="mine").count() == 2
    for slug, key in ((tenant.slug, raw), (other.slug, other_raw)):
        assert get(client, key, f"/v1/adapters/{MODEL}:mine").json()["owned_by"] == slug
        assert [a["owned_by"] for a in get(client, key, "/v1/adapters").json()["data"]] == [
            slug]
    # A shared adapter's name is public (listed for every tenant): it is taken for all.
    registered(adapter_root, "common")
    assert refusal(upload(client, raw, name="common")) == (409, "name", "adapter_exists")
    # Deleting one tenant's leaves the other's.
    assert client.delete(f"/v1/adapters/{MODEL}:mine",
                         HTTP_AUTHORIZATION=f"Bearer {raw}").status_code == 200
    assert get(client, other_raw, f"/v1/adapters/{MODEL}:mine").status_code == 200


def test_only_its_owner_deletes_an_adapter_with_its_files(
        client, tenant_key, make_tenant, adapter_root, base_config,
        django_capture_on_commit_callbacks):
    tenant, _, raw = tenant_key
    _, _, other = make_tenant()
    mine = registered(adapter_root, "mine", tenant)
    shared = registered(adapter_root, "shared")

    def delete(raw_key, name):
        return client.delete(f"/v1/adapters/{MODEL}:{name}",
                             HTTP_AUTHORIZATION=f"Bearer {raw_key}")

    assert refusal(delete(other, "mine")) == (404, None, "adapter_not_found")
    assert refusal(delete(raw, "shared")) == (403, None, "permission_denied")
    with django_capture_on_commit_callbacks(execute=True):
        response = delete(raw, "mine")
    assert response.json() == {"id": f"{MODEL}:mine", "object": "adapter", "deleted": True}
    assert not LoraAdapter.objects.filter(pk=mine.pk).exists()
    assert not (adapter_root / tenant.slug).exists()  # its folders, emptied, are gone
    assert (adapter_root / "shared").is_dir() and LoraAdapter.objects.filter(
        pk=shared.pk).exists()
    assert delete(raw, "mine").status_code == 404


def test_a_tenants_adapter_files_go_with_its_row_however_it_is_deleted(
        tenant_key, make_tenant, adapter_root, base_config, django_capture_on_commit_callbacks):
    """The admin's "delete selected" (a bulk delete) and a tenant's deletion remove its
    adapters' folders as the API's delete does; a shared adapter's folder (the operator's) and a
    folder another row still names stay."""
    tenant, _, _ = make_tenant()
    doomed, _, _ = make_tenant()
    one, two = registered(adapter_root, "one", tenant), registered(adapter_root, "two", tenant)
    twin = LoraAdapter.objects.create(name="twin", base_model=two.base_model, owner=tenant,
                                      folder=two.folder)  # a second row naming two's folder
    theirs = registered(adapter_root, "theirs", doomed)
    shared = registered(adapter_root, "shared")
    with django_capture_on_commit_callbacks(execute=True):
        LoraAdapter.objects.filter(pk__in=[one.pk, two.pk, shared.pk]).delete()
    assert not Path(one.folder).exists()
    assert Path(two.folder).is_dir()  # twin still names it
    assert Path(shared.folder).is_dir()
    with django_capture_on_commit_callbacks(execute=True):
        twin.delete()
        doomed.delete()
    assert not Path(two.folder).exists() and not Path(theirs.folder).exists()
    assert not (adapter_root / doomed.slug).exists()  # the folders it emptied too
    assert adapter_root.is_dir() and Path(shared.folder).is_dir()


def test_the_listing_shows_states_and_refusals_of_the_tenants_and_shared_adapters(
        client, tenant_key, make_tenant, adapter_root, base_config):
    tenant, _, raw = tenant_key
    other, _, _ = make_tenant()
    registered(adapter_root, "dora", tenant, config=adapter_config(use_dora=True))
    registered(adapter_root, "shared")
    registered(adapter_root, "theirs", other)
    listed = {a["id"]: a for a in get(client, raw, "/v1/adapters").json()["data"]}
    assert sorted(listed) == [f"{MODEL}:dora", f"{MODEL}:shared"]
    dora = listed[f"{MODEL}:dora"]
    assert (dora["state"], dora["rank"], dora["digest"]) == ("refused", None, None)
    assert "DoRA" in dora["refusal"]
    assert listed[f"{MODEL}:shared"]["owned_by"] == "system"


def test_register_adapter_registers_a_folder_under_the_root_and_checks_it(
        adapter_root, tenant_key, base_config, capsys):
    tenant, _, _ = tenant_key
    folder = write_adapter(adapter_root / "ops" / "support-v1")
    call_command("register_adapter", "--base", MODEL, "--name", "support", "--folder",
                 str(folder), "--tenant", tenant.slug)
    row = LoraAdapter.objects.get(name="support")
    assert (row.state, row.owner, row.folder) == ("ready", tenant, str(folder))
    assert capsys.readouterr().out.startswith(f"{MODEL}:support: ready (rank 4, q_proj,v_proj")

    refused = write_adapter(adapter_root / "ops" / "wide", adapter_config(modules_to_save=["x"]))
    with pytest.raises(CommandError, match="refused: adapter_config.json: modules_to_save"):
        call_command("register_adapter", "--base", MODEL, "--name", "wide", "--folder",
                     str(refused), "--shared")
    assert not LoraAdapter.objects.filter(name="wide").exists()  # a refusal leaves no row


def test_register_adapter_refuses_a_folder_outside_the_root_even_through_a_symlink(
        adapter_root, tmp_path, base_config):
    outside = write_adapter(tmp_path / "elsewhere")
    (adapter_root / "link").symlink_to(outside)
    for folder in (outside, adapter_root / "link", adapter_root / ".." / "elsewhere"):
        with pytest.raises(CommandError) as caught:
            call_command("register_adapter", "--base", MODEL, "--name", "x", "--folder",
                         str(folder), "--shared")
        message = str(caught.value)
        assert "is not under ADAPTER_ROOT" in message and "\n" not in message
    assert not LoraAdapter.objects.exists()


def test_the_admin_lists_adapters_and_validates_them_again(
        admin_client, adapter_root, base_config, checks_inline,
        django_capture_on_commit_callbacks):
    row = registered(adapter_root, "shared")
    page = admin_client.get(reverse("admin:tenants_loraadapter_changelist"))
    assert page.status_code == 200 and b"LoRA adapters" in page.content
    assert f"{MODEL}:shared".encode() in page.content
    (adapter_root / "shared" / MODEL / "shared" / "adapter_model.bin").write_bytes(b"\x80")
    with django_capture_on_commit_callbacks(execute=True):
        admin_client.post(reverse("admin:tenants_loraadapter_changelist"),
                          {"action": "validate_again", "_selected_action": [row.pk]})
    row.refresh_from_db()
    assert checks_inline == [row.pk] and row.state == "refused"
    assert "adapter_model.bin" in row.refusal
    add = admin_client.post(reverse("admin:tenants_loraadapter_add"), {
        "name": "x", "base_model": MODEL, "owner": "", "folder": "/etc", "enabled": "on"})
    assert b"must lie under ADAPTER_ROOT" in add.content


def test_an_upload_holds_one_of_its_tenants_upload_leases(client, settings, tenant_key,
                                                          adapter_root):
    tenant, _, raw = tenant_key
    settings.LLM_PLATFORM = {**settings.LLM_PLATFORM, "FILES_MAX_CONCURRENT_UPLOADS": 1}
    lease = async_to_sync(file_views.take_upload_lease)(tenant.pk)  # a file upload under way
    assert refusal(upload(client, raw)) == (429, None, "concurrency_limit_exceeded")
    async_to_sync(file_views.end_upload_lease)(tenant.pk, lease)
    assert upload(client, raw).status_code == 200
    assert upload(client, raw, name="second").status_code == 200  # its lease ended with it
