"""What an adapter upload leaves on disk: its temporary files are deleted as soon as it is
stored or refused, whatever refused it (never left open until the request is garbage
collected), no more than ``MAX_ADAPTER_BYTES`` of them is ever written, and each upload is
written to a new folder of its own, never into one that another row (a shared adapter the
operator registered from a tenant's upload, say) still names."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from asgiref.sync import async_to_sync
from django.core.files.uploadedfile import SimpleUploadedFile
from django.core.management import CommandError, call_command
from django.test import RequestFactory
from django.test.client import BOUNDARY, MULTIPART_CONTENT, encode_multipart

from api import adapter_uploads
from gateway import adapter_validation
from gateway.errors import APIError
from tenants.models import LoraAdapter
from tests.api.test_adapters_api import refusal, upload, weights
from tests.api.test_api import MODEL
from tests.support.adapters import adapter_config, write_adapter

pytestmark = pytest.mark.django_db


@pytest.fixture
def upload_temp_dir(settings, tmp_path) -> Path:
    """``FILE_UPLOAD_TEMP_DIR`` in a folder of this test, every uploaded file kept there (none
    in memory)."""
    folder = tmp_path / "uploads"
    folder.mkdir()
    settings.FILE_UPLOAD_TEMP_DIR = str(folder)
    settings.FILE_UPLOAD_MAX_MEMORY_SIZE = 0
    return folder


def limit_to(settings, limit: int) -> None:
    settings.LLM_PLATFORM = {**settings.LLM_PLATFORM, "MAX_ADAPTER_BYTES": limit}


def test_a_refused_oversized_upload_leaves_no_temporary_file(
        client, settings, tenant_key, adapter_root, upload_temp_dir):
    body = weights()
    limit_to(settings, len(body) // 2)  # its Content-Length fits: refused as the files stream
    response = upload(client, tenant_key[2], model_file=body)
    assert refusal(response) == (413, "adapter_model", "request_too_large")
    # The response, and so its request and the request's upload handlers, are still alive
    # here: the files are gone all the same (not left for the garbage collector).
    assert response.wsgi_request is not None
    assert list(upload_temp_dir.iterdir()) == []
    assert not LoraAdapter.objects.exists() and not any(adapter_root.iterdir())


def body_cut_in_its_weights(**parts) -> bytes:
    """A multipart form of an upload that ends in the middle of ``adapter_model`` (the client
    went away there: no closing boundary)."""
    body = encode_multipart(BOUNDARY, {
        "name": "mine", "model": MODEL,
        "adapter_config": SimpleUploadedFile("adapter_config.json",
                                             json.dumps(adapter_config()).encode()),
        "adapter_model": SimpleUploadedFile("adapter_model.safetensors", weights()), **parts})
    return body[:len(body) - len(weights()) // 2]


@pytest.mark.parametrize("refused", [
    "413 from its Content-Length", "413 as its files stream", "400 bad config",
    "400 unknown parameter", "400 pickle", "409 taken", "404 unknown base model",
    "400 body cut off"])
def test_every_refusal_deletes_the_uploads_temporary_files_at_once(
        client, settings, tenant_key, adapter_root, upload_temp_dir, refused):
    raw = tenant_key[2]
    if refused == "409 taken":
        assert upload(client, raw).status_code == 200
    if refused.startswith("413"):
        limit_to(settings, 1000 if "Content-Length" in refused else len(weights()) // 2)
    response = {
        # Its Content-Length is over the limit and its framing: refused before it is read.
        "413 from its Content-Length": lambda: upload(client, raw,
                                                      model_file=weights() + b"\0" * 10_000),
        "413 as its files stream": lambda: upload(client, raw),
        "400 bad config": lambda: upload(client, raw, config=b"{not json"),
        "400 unknown parameter": lambda: upload(client, raw, purpose="batch"),
        "400 pickle": lambda: upload(client, raw, model_filename="adapter_model.bin"),
        "409 taken": lambda: upload(client, raw),
        "404 unknown base model": lambda: upload(client, raw, model="org/unknown"),
        "400 body cut off": lambda: client.generic(
            "POST", "/v1/adapters", body_cut_in_its_weights(), MULTIPART_CONTENT,
            HTTP_AUTHORIZATION=f"Bearer {raw}"),
    }[refused]()
    assert response.status_code == int(refused[:3]), response.content
    assert list(upload_temp_dir.iterdir()) == []
    assert LoraAdapter.objects.count() == (1 if refused == "409 taken" else 0)


def test_a_stored_upload_leaves_no_temporary_file(
        client, tenant_key, adapter_root, upload_temp_dir):
    response = upload(client, tenant_key[2])
    assert response.status_code == 200
    assert list(upload_temp_dir.iterdir()) == []
    folder = Path(LoraAdapter.objects.get().folder)
    assert (folder / "adapter_model.safetensors").read_bytes() == weights()


def test_no_more_than_max_adapter_bytes_is_ever_written_to_disk(settings, upload_temp_dir):
    """The handler stops before it writes the chunk that passes the limit; closing it deletes
    every file it opened, the one cut off included."""
    limit = 50_000  # the body (about 60 kB) is under the limit and its framing: it is parsed
    limit_to(settings, limit)
    request = RequestFactory().post("/v1/adapters", {
        "name": "mine", "model": MODEL,
        "adapter_config": SimpleUploadedFile("adapter_config.json", b"{}"),
        "adapter_model": SimpleUploadedFile("adapter_model.safetensors", b"\0" * 60_000)})
    handler = adapter_uploads.CappedUpload(request, limit)
    with pytest.raises(APIError) as caught:
        adapter_uploads.read_form(request, handler)
    assert caught.value.status == 413
    open_files = [file for file in handler.opened if not file.closed]
    for file in open_files:
        file.flush()
    on_disk = [path.stat().st_size for path in upload_temp_dir.iterdir()]
    # The weights cut off, still open (Django's parser closed the complete config's file).
    assert len(handler.opened) == 2 and len(on_disk) == len(open_files) == 1
    assert handler.received > limit and sum(on_disk) <= limit
    handler.close()
    assert list(upload_temp_dir.iterdir()) == []


def test_a_reupload_never_overwrites_a_folder_a_shared_adapter_was_registered_from(
        client, tenant_key, adapter_root, base_config, django_capture_on_commit_callbacks,
        capsys):
    """acme uploads e2; the operator shares e2's folder (``register_adapter --shared``); acme
    deletes e2 (its folder stays: the shared adapter names it) and uploads e2 again, other
    weights: the new upload gets a folder of its own and the shared adapter's files stay as
    they were checked."""
    raw = tenant_key[2]
    first, second = weights(seed=1), weights(seed=2)
    assert upload(client, raw, name="e2", model_file=first).status_code == 200
    uploaded = Path(LoraAdapter.objects.get(name="e2").folder)
    call_command("register_adapter", "--base", MODEL, "--name", "shared-e2", "--folder",
                 str(uploaded), "--shared")
    assert capsys.readouterr().out.startswith(f"{MODEL}:shared-e2: ready")
    shared = LoraAdapter.objects.get(name="shared-e2")
    assert shared.digest == hashlib.sha256(first).hexdigest()

    with django_capture_on_commit_callbacks(execute=True):
        assert client.delete(f"/v1/adapters/{MODEL}:e2",
                             HTTP_AUTHORIZATION=f"Bearer {raw}").status_code == 200
    assert (uploaded / "adapter_model.safetensors").read_bytes() == first  # kept: shared

    with django_capture_on_commit_callbacks(execute=True):
        assert upload(client, raw, name="e2", model_file=second).status_code == 200
    again = Path(LoraAdapter.objects.get(name="e2").folder)
    assert again != uploaded and again.parent == uploaded.parent
    assert (again / "adapter_model.safetensors").read_bytes() == second
    assert (uploaded / "adapter_model.safetensors").read_bytes() == first
    checked = adapter_validation.validate(shared.pk)
    assert checked is not None and checked.state == "ready"
    assert checked.digest == hashlib.sha256(first).hexdigest()

    # Deleting the new one removes its own folder only.
    with django_capture_on_commit_callbacks(execute=True):
        assert client.delete(f"/v1/adapters/{MODEL}:e2",
                             HTTP_AUTHORIZATION=f"Bearer {raw}").status_code == 200
    assert not again.exists() and (uploaded / "adapter_model.safetensors").is_file()


def test_an_upload_never_writes_into_a_folder_that_exists(
        client, tenant_key, adapter_root, base_config):
    """Even the folder an upload of that name took before this change (``<name>``, which the
    operator may have registered) is left as it is."""
    tenant, _, raw = tenant_key
    legacy = adapter_root / tenant.slug / MODEL / "e2"
    legacy.mkdir(parents=True)
    (legacy / "adapter_model.safetensors").write_bytes(b"the operator's")
    folders = set()
    for name in ("e2", "e3"):
        assert upload(client, raw, name=name).status_code == 200
        folders.add(LoraAdapter.objects.get(name=name).folder)
    assert str(legacy) not in folders and len(folders) == 2
    assert (legacy / "adapter_model.safetensors").read_bytes() == b"the operator's"


def test_a_refused_register_adapter_leaves_no_row_and_the_name_may_be_registered_again(
        tenant_key, adapter_root, base_config, django_capture_on_commit_callbacks, capsys):
    """A refusal rolls its row back: no ``refused`` row that would make a retry "exist
    already", and (a tenant's) no deletion that would remove the operator's folder."""
    tenant, _, _ = tenant_key
    folder = write_adapter(adapter_root / "ops" / "wide",
                           adapter_config(modules_to_save=["x"]))
    with django_capture_on_commit_callbacks(execute=True), pytest.raises(
            CommandError, match=r"refused: adapter_config.json: modules_to_save .*"
                                r"\(nothing was registered\)$"):
        call_command("register_adapter", "--base", MODEL, "--name", "wide", "--folder",
                     str(folder), "--tenant", tenant.slug)
    assert not LoraAdapter.objects.exists()
    assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json",
                                                      "adapter_model.safetensors"]
    capsys.readouterr()
    write_adapter(folder)  # fixed
    call_command("register_adapter", "--base", MODEL, "--name", "wide", "--folder",
                 str(folder), "--tenant", tenant.slug)
    assert capsys.readouterr().out.startswith(f"{MODEL}:wide: ready")
    assert LoraAdapter.objects.get(name="wide").state == "ready"


def test_a_refused_oversized_upload_over_asgi_leaves_no_temporary_file(
        async_client, settings, tenant_key, adapter_root, upload_temp_dir):
    """The same through Django's ASGI handler, as daphne runs the view."""
    body = weights()
    limit_to(settings, len(body) // 2)
    data = {"name": "mine", "model": MODEL,
            "adapter_config": SimpleUploadedFile("adapter_config.json",
                                                 json.dumps(adapter_config()).encode()),
            "adapter_model": SimpleUploadedFile("adapter_model.safetensors", body)}
    response = async_to_sync(async_client.post)(
        "/v1/adapters", data, headers={"Authorization": f"Bearer {tenant_key[2]}"})
    assert refusal(response) == (413, "adapter_model", "request_too_large")
    assert response.asgi_request is not None  # still alive: its files are gone all the same
    assert list(upload_temp_dir.iterdir()) == []
