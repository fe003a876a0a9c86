"""A NUL character (U+0000) anywhere a client can put text never becomes a 500.

PostgreSQL refuses NUL in text and in ``jsonb`` (the suite runs on it in CI). An id holding one
(in a path, a query or a body) is an id this platform never issued: a 404. Text holding one that
is stored (a stored response's input, instructions, metadata and user; a file's name; a chat
message or a conversation's title) is stored with the NUL replaced by U+FFFD, and served as usual.
"""

from __future__ import annotations

import json

import pytest

from api.models import StoredResponse
from tests.api.test_api import MODEL, error_of, post

pytestmark = pytest.mark.django_db

NUL = "\u0000"
REPLACED = "\ufffd"


def bearer(raw_key: str) -> dict:
    return {"HTTP_AUTHORIZATION": f"Bearer {raw_key}"}


@pytest.mark.parametrize(("method", "path"), [
    ("get", "/v1/responses/resp_%00"), ("delete", "/v1/responses/%00"),
    ("get", "/v1/responses/resp_a%00b/input_items"),
    ("get", "/v1/files/file-%00"), ("delete", "/v1/files/%00"),
    ("get", "/v1/files/file-%00/content"), ("get", "/v1/models/%00"),
    ("post", "/v1/chat/completions%00"), ("get", "/v1/files?after=file-%00"),
    ("get", "/v1/responses/resp_1/input_items?after=%00"),
])
def test_an_id_holding_a_nul_in_a_path_or_a_query_is_a_404(client, tenant_key, method, path):
    response = getattr(client, method)(path, **bearer(tenant_key[2]))
    assert response.status_code == 404, response.content[:300]
    assert error_of(response)["code"] is not None


@pytest.mark.parametrize("query", ["purpose=%00batch", "x%00=1", "order=%00"])
def test_a_filter_or_an_unknown_parameter_holding_a_nul_is_read_as_text(client, tenant_key,
                                                                          query):
    response = client.get(f"/v1/files?{query}", **bearer(tenant_key[2]))
    if query.startswith(("order", "purpose")):  # neither is one of the values it takes
        name = query.split("=")[0]
        assert response.status_code == 400 and error_of(response)["param"] == name
    else:
        assert response.status_code == 200 and response.json()["data"] == []


def test_a_page_with_a_nul_in_its_query_is_served(client):
    assert client.get("/chat/login/?next=%00").status_code == 200


def test_a_previous_response_id_holding_a_nul_is_a_404_naming_it(client, tenant_key):
    body = {"model": MODEL, "input": "Hi", "previous_response_id": f"resp_{NUL}"}
    response = post(client, tenant_key[2], body, "/v1/responses")
    assert response.status_code == 404, response.content[:300]
    assert error_of(response)["param"] == "previous_response_id"


@pytest.mark.parametrize("where", ["input", "instructions", "metadata", "user"])
def test_a_stored_response_with_a_nul_in_its_text_is_served_and_read_back(
        client, tenant_key, inproc_worker, where):
    body = {"model": MODEL, "input": [{"role": "user", "content": f"Hel{NUL}lo"}]
            if where == "input" else "Hello", "max_output_tokens": 2}
    if where == "instructions":
        body["instructions"] = f"Be{NUL} brief"
    if where == "metadata":
        body["metadata"] = {f"k{NUL}": f"v{NUL}"}
    if where == "user":
        body["user"] = f"u{NUL}"
    made = post(client, tenant_key[2], body, "/v1/responses")
    assert made.status_code == 200, made.content[:300]
    response_id = made.json()["id"]
    got = client.get(f"/v1/responses/{response_id}", **bearer(tenant_key[2]))
    items = client.get(f"/v1/responses/{response_id}/input_items", **bearer(tenant_key[2]))
    assert got.status_code == items.status_code == 200
    stored = json.dumps([got.json(), items.json()])
    assert "\\u0000" not in stored
    if where == "input":
        assert f"Hel{REPLACED}lo" in items.json()["data"][0]["content"][0]["text"]
    if where == "instructions":
        assert got.json()["instructions"] == f"Be{REPLACED} brief"
    if where == "metadata":
        assert got.json()["metadata"] == {f"k{REPLACED}": f"v{REPLACED}"}
    assert StoredResponse.objects.filter(pk=response_id).exists()


def test_a_chat_completion_with_nul_in_its_fields_is_served(client, tenant_key, inproc_worker):
    body = {"model": MODEL, "max_tokens": 2, "user": f"u{NUL}", "metadata": {"k": f"v{NUL}"},
            "messages": [{"role": "user", "content": f"Hi{NUL}"}]}
    response = post(client, tenant_key[2], body)
    assert response.status_code == 200, response.content[:300]


def test_a_file_name_holding_a_nul_is_stored_replaced(client, tenant_key, settings, tmp_path):
    settings.STORAGES = {**settings.STORAGES, "files": {
        "BACKEND": "django.core.files.storage.FileSystemStorage",
        "OPTIONS": {"location": str(tmp_path)}}}
    line = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}})
    boundary = "XyZ"
    data = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; "
            f"filename=\"in{NUL}put.jsonl\"\r\nContent-Type: application/jsonl\r\n\r\n"
            f"{line}\n\r\n--{boundary}--\r\n").encode()
    response = client.post("/v1/files", data, content_type=f"multipart/form-data; "
                           f"boundary={boundary}", **bearer(tenant_key[2]))
    assert response.status_code in (200, 400), response.content[:300]
    if response.status_code == 200:
        assert NUL not in response.json()["filename"]
    else:
        assert error_of(response)["param"] == "file"
