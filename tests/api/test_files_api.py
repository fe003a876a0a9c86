"""The Files API (fast lane): the real ``openai`` client against the ASGI application, files kept
in a private folder of the test's own; shapes read back with the SDK's own types."""

from __future__ import annotations

import json
import os
import stat
import time

import openai
import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from openai.types import FileDeleted, FileObject

from api import file_store
from api.models import StoredFile
from api.tasks import purge_files
from llm_platform import private_files
from tenants.services import create_api_key
from tests.api.test_nullable_fields import in_process

pytestmark = pytest.mark.django_db

BATCH = b"".join(json.dumps({"custom_id": f"r{i}", "method": "POST",
                             "url": "/v1/chat/completions",
                             "body": {"model": "m", "messages": []}}).encode() + b"\n"
                 for i in range(3))


@pytest.fixture(autouse=True)
def files_root(settings, tmp_path):
    """The ``files`` storage in a private folder of this test."""
    root = private_files.private_folder(tmp_path / "files")
    settings.STORAGES = {**settings.STORAGES, "files": {
        "BACKEND": "django.core.files.storage.FileSystemStorage",
        "OPTIONS": {"location": str(root), "file_permissions_mode": 0o600,
                    "directory_permissions_mode": 0o700}}}
    return root


def limits(settings, **values):
    settings.LLM_PLATFORM = {**settings.LLM_PLATFORM, **values}


def upload(client: openai.AsyncOpenAI, data: bytes = BATCH, name: str = "input.jsonl", **extra):
    return client.files.create(file=(name, data), purpose="batch", **extra)


def refused(raw_key: str, call) -> openai.APIStatusError:
    async def calls(client):
        try:
            await call(client)
        except openai.APIStatusError as exc:
            return exc
        raise AssertionError("not refused")

    return in_process(raw_key, calls)


def test_a_file_is_uploaded_read_back_listed_and_deleted(tenant_key, tmp_path):
    tenant, key, raw = tenant_key
    path = tmp_path / "from-disk.jsonl"
    path.write_bytes(BATCH)

    async def calls(client):
        made = await upload(client)
        from_path = await client.files.create(file=path, purpose="batch")
        shown = await client.files.with_raw_response.retrieve(made.id)
        content = await client.files.content(made.id)
        listed = await client.files.with_raw_response.list()
        deleted = await client.files.delete(made.id)
        gone = await client.files.list()
        return made, from_path, json.loads(shown.content), content, listed, deleted, gone

    made, from_path, shown, content, listed, deleted, gone = in_process(raw, calls)
    FileObject.model_validate(shown, strict=True)  # the SDK's own type, as the server wrote it
    assert made.id.startswith("file-") and made.object == "file" and made.status == "processed"
    assert made.purpose == "batch" and made.filename == "input.jsonl" and made.bytes == len(BATCH)
    assert made.expires_at - made.created_at == 30 * 86400
    assert abs(made.created_at - time.time()) < 60
    assert FileObject.model_validate(shown) == made
    assert from_path.filename == "from-disk.jsonl" and from_path.bytes == len(BATCH)
    assert content.content == BATCH
    assert content.response.headers["content-type"] == "application/jsonl"
    assert content.response.headers["content-length"] == str(len(BATCH))
    assert 'filename="input.jsonl"' in content.response.headers["content-disposition"]
    page = json.loads(listed.content)
    assert page["object"] == "list" and [f["id"] for f in page["data"]] == [from_path.id, made.id]
    assert page["first_id"] == from_path.id and page["last_id"] == made.id
    assert page["has_more"] is False
    assert FileDeleted.model_validate(deleted.model_dump()) == deleted
    assert deleted.model_dump() == {"id": made.id, "object": "file", "deleted": True}
    assert [f.id for f in gone.data] == [from_path.id]
    row = StoredFile.objects.get(pk=from_path.id)
    assert row.tenant_id == tenant.pk and row.api_key_id == key.pk and row.lines == 3


def test_the_list_pages_with_limit_order_after_and_purpose(tenant_key):
    _, _, raw = tenant_key

    async def calls(client):
        made = [await upload(client, name=f"{i}.jsonl") for i in range(5)]
        first = await client.files.list(limit=2)
        every = [f.id async for f in await client.files.list(limit=2)]  # follows has_more
        oldest = [f.id async for f in await client.files.list(limit=3, order="asc")]
        after = await client.files.list(limit=10, order="asc", after=made[1].id)
        outputs = await client.files.list(purpose="batch_output")
        return made, first, every, oldest, after, outputs

    made, first, every, oldest, after, outputs = in_process(raw, calls)
    ids = [f.id for f in made]
    assert [f.id for f in first.data] == ids[::-1][:2] and first.has_more is True
    assert every == ids[::-1]
    assert oldest == ids
    assert [f.id for f in after.data] == ids[2:] and after.has_more is False
    assert outputs.data == []

    async def bad_limit(client):
        return await client.files.list(limit=10_001)

    error = refused(raw, bad_limit)
    assert error.status_code == 400 and error.body["param"] == "limit"
    error = refused(raw, lambda c: c.files.list(order="sideways"))
    assert error.status_code == 400 and error.body["param"] == "order"
    error = refused(raw, lambda c: c.files.list(after="file-nothing"))
    assert error.status_code == 404 and error.body["param"] == "after"
    error = refused(raw, lambda c: c.files.list(purpose="bogus"))
    assert error.status_code == 400 and error.body["param"] == "purpose"
    assert in_process(raw, lambda c: c.files.list(purpose="assistants")).data == []


def test_every_key_of_the_tenant_sees_a_file_and_another_tenant_gets_404(tenant_key,
                                                                         make_tenant):
    tenant, _, raw = tenant_key
    _, second_raw = create_api_key(tenant, "second")
    _, _, other_raw = make_tenant()
    made = in_process(raw, upload)
    seen = in_process(second_raw, lambda c: c.files.retrieve(made.id))
    assert seen.id == made.id
    for call in (lambda c: c.files.retrieve(made.id), lambda c: c.files.content(made.id),
                 lambda c: c.files.delete(made.id), lambda c: c.files.list(after=made.id)):
        error = refused(other_raw, call)
        assert error.status_code == 404, error
        assert made.id in error.body["message"]
    assert in_process(other_raw, lambda c: c.files.list()).data == []
    assert StoredFile.objects.filter(pk=made.id).exists()


@pytest.mark.parametrize(("data", "line", "why"), [
    (b'{"a": 1}\n{"b": 2}\n{"c": \n', 3, "not valid JSON"),
    (b'{"a": 1}\n\n[1, 2]\n', 3, "JSON array, not an object"),
    (b'{"a": 1}\n{"b": "\xff"}\n', 2, "not UTF-8"),
    (b'{"a": NaN}\n', 1, "not valid JSON"),
])
def test_a_bad_line_is_a_400_naming_file_and_its_line(tenant_key, data, line, why):
    _, _, raw = tenant_key
    error = refused(raw, lambda c: upload(c, data))
    assert error.status_code == 400 and error.body["param"] == "file"
    assert error.body["code"] == "invalid_file"
    assert f"line {line} " in error.body["message"] and why in error.body["message"]
    assert error.body["details"] == {"line": line}
    assert not StoredFile.objects.exists() and not any(file_store.storage().listdir("")[1])


def test_blank_lines_a_byte_order_mark_and_crlf_are_taken(tenant_key):
    _, _, raw = tenant_key
    data = b'\xef\xbb\xbf{"a": 1}\r\n\r\n{"b": 2}'
    made = in_process(raw, lambda c: upload(c, data))
    assert StoredFile.objects.get(pk=made.id).lines == 2


def test_the_line_and_byte_limits_and_an_empty_file(settings, tenant_key):
    _, _, raw = tenant_key
    limits(settings, FILES_MAX_LINES=2)
    error = refused(raw, upload)
    assert error.status_code == 400 and error.body["param"] == "file"
    assert error.body["code"] == "too_many_lines" and "more than 2 requests" in error.body[
        "message"]
    limits(settings, FILES_MAX_LINES=50_000, FILES_MAX_BYTES=len(BATCH) - 1)
    error = refused(raw, upload)
    assert error.body["code"] == "file_too_large" and error.body["param"] == "file"
    assert str(len(BATCH) - 1) in error.body["message"]
    error = refused(raw, lambda c: upload(c, b"\n  \n"))
    assert error.body["code"] == "empty_file" and error.body["param"] == "file"


def test_a_tenants_quota_counts_its_files_and_names_the_numbers(settings, tenant_key,
                                                                make_tenant):
    tenant, _, raw = tenant_key
    limits(settings, FILES_TENANT_QUOTA_BYTES=2 * len(BATCH) + 10)
    first = in_process(raw, upload)
    in_process(raw, upload)
    error = refused(raw, upload)
    assert error.status_code == 400 and error.body["param"] == "file"
    assert error.body["code"] == "storage_quota_exceeded"
    assert error.body["details"] == {"quota_bytes": 2 * len(BATCH) + 10,
                                     "used_bytes": 2 * len(BATCH), "file_bytes": len(BATCH)}
    assert str(2 * len(BATCH) + 10) in error.body["message"]
    assert error.response.headers["x-should-retry"] == "false"
    other = make_tenant()[2]
    in_process(other, upload)  # another tenant's quota is its own
    in_process(raw, lambda c: c.files.delete(first.id))
    in_process(raw, upload)  # room again


@pytest.mark.parametrize("purpose", ["assistants", "fine-tune", "vision", "user_data", "evals",
                                     "batch_output", "nonsense"])
def test_a_purpose_not_served_is_a_400_naming_purpose(tenant_key, purpose):
    _, _, raw = tenant_key
    error = refused(raw, lambda c: c.files.create(file=("a.jsonl", BATCH), purpose=purpose))
    assert error.status_code == 400 and error.body["param"] == "purpose"
    assert error.body["code"] == "unsupported_value" and purpose in error.body["message"]
    assert not StoredFile.objects.exists()


def test_a_form_without_its_fields_or_with_others_is_a_400_naming_them(client, tenant_key):
    _, _, raw = tenant_key
    auth = {"HTTP_AUTHORIZATION": f"Bearer {raw}"}
    cases = [
        ({"purpose": "batch"}, "file", "missing_required_parameter"),
        ({"file": _named(BATCH)}, "purpose", "missing_required_parameter"),
        ({"file": _named(BATCH), "purpose": "batch", "colour": "red"}, "colour",
         "unknown_parameter"),
        ({"file": "text, not a file", "purpose": "batch"}, "file", "invalid_value"),
        ({"file": _named(BATCH), "purpose": "batch", "expires_after[anchor]": "created_at",
          "expires_after[seconds]": "60"}, "expires_after.seconds", "invalid_value"),
    ]
    for form, param, code in cases:
        answer = client.post("/v1/files", form, **auth)
        assert answer.status_code == 400, (form, answer.content)
        assert (answer.json()["error"]["param"], answer.json()["error"]["code"]) == (param, code)
    not_a_form = client.post("/v1/files", "{}", content_type="application/json", **auth)
    assert not_a_form.status_code == 400 and not_a_form.json()["error"]["param"] == "file"
    assert client.post("/v1/files", {"purpose": "batch"}).status_code == 401
    assert client.put("/v1/files", **auth).status_code == 405


def _named(data: bytes):
    from django.core.files.uploadedfile import SimpleUploadedFile

    return SimpleUploadedFile("batch.jsonl", data)


def test_expires_after_sets_expires_at(tenant_key):
    _, _, raw = tenant_key
    made = in_process(raw, lambda c: upload(c, expires_after={"anchor": "created_at",
                                                              "seconds": 3600}))
    assert made.expires_at - made.created_at == 3600


def test_files_past_their_retention_are_404_and_purged_by_beat(settings, tenant_key,
                                                               files_root):
    _, _, raw = tenant_key
    limits(settings, FILES_RETENTION_S=100.0)
    made = in_process(raw, upload)
    assert made.expires_at - made.created_at == 100
    row = StoredFile.objects.get(pk=made.id)
    assert file_store.purge() == 0
    StoredFile.objects.filter(pk=made.id).update(expires_at=row.created_at)  # now past it
    error = refused(raw, lambda c: c.files.retrieve(made.id))
    assert error.status_code == 404
    assert (files_root / row.storage_name).is_file()
    assert purge_files() == 1  # the beat task
    assert not StoredFile.objects.filter(pk=made.id).exists()
    assert not (files_root / row.storage_name).exists()
    schedule = {entry["task"] for entry in settings.CELERY_BEAT_SCHEDULE.values()}
    assert "api.tasks.purge_files" in schedule


def test_the_stored_file_is_its_owners_only_under_a_generated_name(tenant_key, files_root):
    tenant, _, raw = tenant_key
    big = BATCH * 10_000  # over FILE_UPLOAD_MAX_MEMORY_SIZE: a temporary file, moved in
    made = in_process(raw, lambda c: upload(c, big, name="secret-plans.jsonl"))
    row = StoredFile.objects.get(pk=made.id)
    path = files_root / row.storage_name
    assert path.read_bytes() == big and made.bytes == len(big) and row.lines == 30_000
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(files_root.stat().st_mode) == 0o700
    assert "secret" not in row.storage_name and made.id not in row.storage_name
    assert row.storage_name.startswith(f"{tenant.pk}/")
    assert path.stat().st_uid == os.getuid()


def test_a_file_the_platform_writes_is_read_and_deleted_but_never_uploaded(settings,
                                                                           tenant_key):
    tenant, _, raw = tenant_key
    limits(settings, FILES_OUTPUT_RETENTION_S=7200.0)
    output = file_store.create_from_bytes(b'{"id": "r1"}\n{"id": "r2"}\n', tenant_id=tenant.pk,
                                          filename="batch_abc_output.jsonl")

    async def calls(client):
        shown = await client.files.retrieve(output.id)
        content = await client.files.content(output.id)
        listed = await client.files.list(purpose="batch_output")
        deleted = await client.files.delete(output.id)
        return shown, content.content, listed, deleted

    shown, content, listed, deleted = in_process(raw, calls)
    assert shown.purpose == "batch_output" and shown.filename == "batch_abc_output.jsonl"
    assert shown.expires_at - shown.created_at == 7200
    assert content == b'{"id": "r1"}\n{"id": "r2"}\n' and output.lines == 2
    assert [f.id for f in listed.data] == [output.id] and deleted.deleted is True


def test_concurrent_uploads_over_the_tenants_cap_get_429(settings, tenant_key, rclient,
                                                        redis_prefix):
    tenant, _, raw = tenant_key
    limits(settings, FILES_MAX_CONCURRENT_UPLOADS=1)
    leases = f"{redis_prefix}:files:uploads:{tenant.pk}"
    rclient.zadd(leases, {"another-upload": time.time() + 60})  # one in progress elsewhere
    error = refused(raw, upload)
    assert error.status_code == 429 and error.body["code"] == "concurrency_limit_exceeded"
    assert error.response.headers["retry-after"] == "1"
    rclient.zadd(leases, {"another-upload": time.time() - 1})  # its lease ran out
    in_process(raw, upload)
    assert rclient.zcard(leases) == 0  # each upload's lease ends with it


# -- forms of any shape: a 4xx with the JSON error, never a 5xx --------------------------------

PART_NAMES = st.sampled_from(["file", "purpose", "expires_after[anchor]", "expires_after[seconds]",
                              "colour", "", "file\u00e9", "purpose[0]"])
PART_VALUES = st.one_of(st.sampled_from([b"batch", b"batch_output", b"created_at", b"3600",
                                         b"-1", b"\xff\xfe", b"", BATCH, b'{"a": 1}\n[1]\n',
                                         b"\x00" * 10]),
                        st.binary(max_size=64))
PARTS = st.lists(st.tuples(PART_NAMES, st.sampled_from([None, "a.jsonl", "", "../../x", "a\"b"]),
                           PART_VALUES), max_size=5)


def multipart(parts, boundary: bytes = b"XyZ") -> bytes:
    out = b""
    for name, filename, value in parts:
        disposition = f'form-data; name="{name}"'
        if filename is not None:
            disposition += f'; filename="{filename}"'
        out += (b"--" + boundary + b"\r\nContent-Disposition: " + disposition.encode()
                + b"\r\n\r\n" + value + b"\r\n")
    return out + b"--" + boundary + b"--\r\n"


@hypothesis_settings(max_examples=60, deadline=None,
                     suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parts=PARTS, mangle=st.sampled_from(["none", "cut", "no end", "other boundary"]))
def test_forms_of_any_shape_get_a_json_answer_below_500(client, tenant_key, parts, mangle):
    body = multipart(parts)
    if mangle == "cut":
        body = body[:len(body) // 2]
    elif mangle == "no end":
        body = body.rsplit(b"--XyZ--", 1)[0]
    boundary = "Other" if mangle == "other boundary" else "XyZ"
    answer = client.post("/v1/files", body, content_type=f"multipart/form-data; "
                                                         f"boundary={boundary}",
                         HTTP_AUTHORIZATION=f"Bearer {tenant_key[2]}")
    assert answer.status_code in (200, 400), answer.content
    if answer.status_code == 400:
        assert set(answer.json()["error"]) >= {"message", "type", "param", "code"}
    else:
        assert answer.json()["object"] == "file"


def test_a_file_whose_bytes_cannot_be_deleted_keeps_its_row_for_the_next_purge(tenant_key,
                                                                               files_root):
    _, _, raw = tenant_key
    made = in_process(raw, upload)
    row = StoredFile.objects.get(pk=made.id)
    StoredFile.objects.filter(pk=made.id).update(expires_at=row.created_at)
    path = files_root / row.storage_name
    path.unlink()
    (path / "in-the-way").mkdir(parents=True)  # a folder not empty: the storage cannot delete it
    assert file_store.purge() == 0
    assert StoredFile.objects.filter(pk=made.id).exists()
    (path / "in-the-way").rmdir()
    assert file_store.purge() == 1
    assert not path.exists() and not StoredFile.objects.filter(pk=made.id).exists()


def test_a_deleted_files_bytes_go_once_committed_also_with_its_tenant(
        tenant_key, make_tenant, files_root, django_capture_on_commit_callbacks):
    _, _, raw = tenant_key
    made = in_process(raw, upload)
    path = files_root / StoredFile.objects.get(pk=made.id).storage_name
    with django_capture_on_commit_callbacks(execute=True):
        in_process(raw, lambda c: c.files.delete(made.id))
    assert not path.exists()
    tenant, _, other = make_tenant()
    kept = in_process(other, upload)
    path = files_root / StoredFile.objects.get(pk=kept.id).storage_name
    with django_capture_on_commit_callbacks(execute=True):
        tenant.delete()
    assert not path.exists() and not StoredFile.objects.filter(pk=kept.id).exists()


def test_the_admin_lists_and_shows_files_read_only(admin_client, tenant_key):
    tenant, _, _ = tenant_key
    made = file_store.create_from_bytes(b'{"id": "r1"}\n', tenant_id=tenant.pk,
                                        filename="out.jsonl")
    listed = admin_client.get("/admin/api/storedfile/")
    assert listed.status_code == 200 and made.id.encode() in listed.content
    shown = admin_client.get(f"/admin/api/storedfile/{made.id}/change/")
    assert shown.status_code == 200 and b"out.jsonl" in shown.content
    assert b'name="_save"' not in shown.content
    assert admin_client.get("/admin/api/storedfile/add/").status_code == 403


def test_any_django_storage_may_keep_the_files(settings, tenant_key, files_root):
    settings.STORAGES = {**settings.STORAGES, "files": {
        "BACKEND": "django.core.files.storage.InMemoryStorage"}}
    _, _, raw = tenant_key
    big = BATCH * 10_000  # a temporary file, read into the storage

    async def calls(client):
        made = await upload(client, big)
        content = await client.files.content(made.id)
        await client.files.delete(made.id)
        return made, content.content

    made, content = in_process(raw, calls)
    assert content == big and made.bytes == len(big)
    assert not any(files_root.iterdir())  # nothing on the local disk
