"""Uploads to a web process (``python -m llm_platform.serve``, as the run command starts it) with
the default body limit of ``/v1/files``: ``FILES_MAX_BYTES`` (4 MiB here, so that a large body is
cheap) and the multipart framing, over ``MAX_BODY_BYTES`` (2.5 MiB). A large body is read only
once its key is valid; one over the path's limit is refused unread; a file between the two limits
is uploaded with the real ``openai`` client and kept private.
"""

from __future__ import annotations

import json
import socket
import stat
from collections.abc import Iterator

import openai
import pytest
import redis

from tests.support.e2e import wait_for
from tests.support.web_process import WebProcess, committed_key, exchange, parse_response

# transaction: the web process writes file rows, which must not wait for the write lock of a
# test's open transaction (SQLite).
pytestmark = [pytest.mark.process, pytest.mark.django_db(transaction=True)]

LIMIT = 2_621_440
FILES_MAX_BYTES = 4 * 2**20
FILES_LIMIT = FILES_MAX_BYTES + 65_536  # the file and its multipart framing


@pytest.fixture
def web(request, django_db_setup, django_db_blocker, tmp_path
        ) -> Iterator[tuple[WebProcess, str]]:
    """A web process and a key of a tenant of its own (``indirect`` parameters: more
    settings)."""
    from django.conf import settings

    extra = getattr(request, "param", {})
    with committed_key(django_db_blocker, "files") as (url, key):
        process = WebProcess(url, tmp_path / "daphne.log", FILES_MAX_BYTES=str(FILES_MAX_BYTES),
                             FILES_ROOT=str(tmp_path / "files"), **extra).wait_up()
        try:
            yield process, key
        finally:
            process.stop(settings.REDIS_URL)


def head(*lines: str) -> bytes:
    """A raw ``POST /v1/files``'s head (``Connection: close``), no body."""
    return "\r\n".join(["POST /v1/files HTTP/1.1", "Host: 127.0.0.1", "Connection: close",
                        "Content-Type: multipart/form-data; boundary=b", *lines,
                        "", ""]).encode()


def batch_file(size: int) -> bytes:
    line = json.dumps({"custom_id": "r", "method": "POST", "url": "/v1/chat/completions",
                       "body": {"pad": "x" * 900}}).encode() + b"\n"
    data = line * (size // len(line))
    return data + b" " * (size - len(data))  # blank to the size: not a request


def test_a_large_upload_needs_its_key_before_its_body_and_fits_the_files_limit(web, tmp_path):
    process, key = web
    size = 3 * 2**20  # over MAX_BODY_BYTES, under the files limit
    for auth, code in ((None, "missing_api_key"), ("Bearer sk-wrong", "invalid_api_key")):
        lines = [f"Content-Length: {size}"] + ([f"Authorization: {auth}"] if auth else [])
        answer = exchange(process.port, head(*lines))  # the body is never sent
        assert answer.status == 401 and answer.json_error()["code"] == code
    over = exchange(process.port, head(f"Authorization: Bearer {key}",
                                       f"Content-Length: {FILES_LIMIT + 1}"))
    assert over.status == 413 and over.json_error()["code"] == "request_too_large"
    assert over.json_error()["details"] == {"limit_bytes": FILES_LIMIT}

    client = openai.OpenAI(base_url=f"{process.url}/v1", api_key=key, max_retries=0,
                           timeout=60)
    data = batch_file(size)
    made = client.files.create(file=("big.jsonl", data), purpose="batch")
    assert made.bytes == size and made.status == "processed"
    assert client.files.content(made.id).content == data
    stored = [p for p in (tmp_path / "files").rglob("*") if p.is_file()]
    assert len(stored) == 1 and stored[0].read_bytes() == data
    assert stat.S_IMODE(stored[0].stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "files").stat().st_mode) == 0o700
    # A file just over FILES_MAX_BYTES fits the body limit (its framing's room), and is refused
    # by the API, naming it.
    with pytest.raises(openai.BadRequestError) as raised:
        client.files.create(file=("over.jsonl", batch_file(FILES_MAX_BYTES + 1)),
                            purpose="batch")
    assert raised.value.body["param"] == "file" and raised.value.code == "file_too_large"
    client.files.delete(made.id)
    assert not [p for p in (tmp_path / "files").rglob("*") if p.is_file()]
    assert "Traceback" not in process.output()


def multipart(data: bytes) -> bytes:
    """A form of ``file`` (``data``) and ``purpose`` ``batch``, boundary ``b``."""
    return (b'--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            b'--b\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n'
            b"Content-Type: application/jsonl\r\n\r\n" + data + b"\r\n--b--\r\n")


@pytest.mark.parametrize("web", [{"FILES_MAX_CONCURRENT_UPLOADS": "1"}], indirect=True)
def test_a_large_upload_holds_its_tenants_lease_while_its_body_arrives(web):
    from django.conf import settings

    process, key = web
    leases = redis.Redis.from_url(settings.REDIS_URL)

    def held() -> int:
        return sum(leases.zcard(name) for name in
                   leases.scan_iter(f"{process.redis_prefix}:files:uploads:*"))

    body = multipart(batch_file(3 * 2**20))
    auth = f"Authorization: Bearer {key}"
    with socket.create_connection(("127.0.0.1", process.port), timeout=30) as first:
        first.sendall(head(auth, f"Content-Length: {len(body)}") + body[:2**20])
        assert wait_for(lambda: held() == 1, 10)  # taken before its body was read
        second = exchange(process.port, head(auth, f"Content-Length: {len(body)}"))
        assert second.status == 429 and second.json_error()["code"] == (
            "concurrency_limit_exceeded")
        assert second.headers["retry-after"] == "1"
        # The process names its lease to the view in a header; one a client sends is dropped,
        # even naming the lease held: a small upload then takes a lease of its own, and finds
        # none free.
        lease = next(member.decode() for name in
                     leases.scan_iter(f"{process.redis_prefix}:files:uploads:*")
                     for member in leases.zrange(name, 0, -1))
        small = multipart(b'{"a": 1}\n')
        forged = exchange(process.port, head(auth, f"Content-Length: {len(small)}",
                                             f"X-Platform-Upload-Lease: {lease}") + small)
        assert forged.status == 429, forged.raw[:300]
        first.sendall(body[2**20:])
        out = b""
        while part := first.recv(65536):
            out += part
    answer = parse_response(out)
    assert answer.status == 200, answer.raw[:500]
    assert json.loads(answer.body)["bytes"] == 3 * 2**20
    assert wait_for(lambda: held() == 0, 10)  # ended with its request
    client = openai.OpenAI(base_url=f"{process.url}/v1", api_key=key, max_retries=0,
                           timeout=60)
    assert client.files.create(file=("small.jsonl", b'{"a": 1}\n'), purpose="batch").bytes == 9
    assert held() == 0
    assert "Traceback" not in process.output()
