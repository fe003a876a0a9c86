"""A web process (``python -m llm_platform.serve``, as the run command starts it) and what reaches
it below the views: bodies over the limit, large bodies on a path that takes them, and requests
no HTTP client library writes (malformed HTTP, raw bytes, odd request targets, websocket
upgrades to paths without a route, ``HEAD``), over raw sockets and the real ``openai`` client.

The process runs on the test database (SQLite or PostgreSQL, as the run's), with the default
``MAX_BODY_BYTES`` (2.5 MiB) and ``MAX_BODY_BYTES_BY_PATH=/v1/files=8 MiB``.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest
import websocket

from tests.support.e2e import wait_for
from tests.support.web_process import (
    WebProcess,
    committed_key,
    exchange,
    parse_response,
)

# django_db: the test database is set up (the process runs on it); the tests write nothing.
pytestmark = [pytest.mark.process, pytest.mark.django_db]

MODEL = "SmolLM2-135M-Instruct"
LIMIT = 2_621_440
FILES_LIMIT = 8 * 2**20


@dataclass
class Web:
    process: WebProcess
    key: str

    @property
    def port(self) -> int:
        return self.process.port


@pytest.fixture(scope="module")
def web(django_db_setup, django_db_blocker, tmp_path_factory, redis_url) -> Iterator[Web]:
    with committed_key(django_db_blocker, "guard") as (url, key):
        process = WebProcess(url, tmp_path_factory.mktemp("web") / "daphne.log",
                             MAX_BODY_BYTES_BY_PATH=f"/v1/files={FILES_LIMIT}").wait_up()
        yield Web(process, key)
        process.stop(redis_url)


@pytest.fixture(scope="module")
def redis_url() -> str:
    from django.conf import settings

    return settings.REDIS_URL


def request(method: str, target: str | bytes, *headers: str, body: bytes = b"") -> bytes:
    """A raw HTTP/1.1 request (``Host: 127.0.0.1``, ``Connection: close``)."""
    target = target.encode() if isinstance(target, str) else target
    lines = [b"%s %s HTTP/1.1" % (method.encode(), target), b"Host: 127.0.0.1",
             b"Connection: close", *(h.encode("latin-1") for h in headers)]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def chunked(payload: bytes, piece: int = 2**16, *, end: bool = True) -> bytes:
    """``payload`` in chunked framing (without the last chunk unless ``end``)."""
    out = b"".join(b"%x\r\n%s\r\n" % (len(payload[i:i + piece]), payload[i:i + piece])
                   for i in range(0, len(payload), piece))
    return out + (b"0\r\n\r\n" if end else b"")


def tracebacks(web: Web) -> int:
    return web.process.output().count("Traceback")


# -- the body limit ---------------------------------------------------------------------------

def test_a_body_over_the_limit_is_refused_from_its_content_length_before_it_is_sent(web):
    # 300 MB announced, not one byte of it sent: the answer comes anyway.
    answer = exchange(web.port, request("POST", "/v1/chat/completions",
                                        "Content-Type: application/json",
                                        f"Content-Length: {300 * 10**6}"))
    assert answer.status == 413
    error = answer.json_error()
    assert error["code"] == "request_too_large" and f"{LIMIT} bytes" in error["message"]
    assert error["details"] == {"limit_bytes": LIMIT}
    assert answer.headers["x-should-retry"] == "false"


def test_a_chunked_body_is_refused_as_soon_as_it_passes_the_limit(web):
    # The body never ends (no last chunk): the refusal comes from what passed the limit.
    body = chunked(b"x" * (LIMIT + 1), end=False)
    answer = exchange(web.port, request("POST", "/v1/completions",
                                        "Transfer-Encoding: chunked", body=body))
    assert answer.status == 413 and answer.json_error()["code"] == "request_too_large"


def test_a_body_at_the_limit_reaches_the_api(web):
    for framing in ("length", "chunked"):
        payload = b"x" * LIMIT
        headers = [f"Authorization: Bearer {web.key}", "Content-Type: application/json"]
        if framing == "length":
            raw = request("POST", "/v1/chat/completions", *headers,
                          f"Content-Length: {LIMIT}", body=payload)
        else:
            raw = request("POST", "/v1/chat/completions", *headers,
                          "Transfer-Encoding: chunked", body=chunked(payload))
        answer = exchange(web.port, raw)
        assert answer.status == 400, framing  # read whole, then refused as not JSON
        assert answer.json_error()["code"] == "invalid_json"


def upload(web: Web, path: str, framing: str, data: dict, files: dict) -> dict:
    """The error of a multipart upload to ``path`` sent with a length or chunked."""
    form = httpx.Request("POST", f"http://127.0.0.1:{web.port}{path}", data=data, files=files)
    body = form.read()
    headers = [f"Authorization: Bearer {web.key}", f"Content-Type: {form.headers['content-type']}"]
    if framing == "length":
        raw = request("POST", path, *headers, f"Content-Length: {len(body)}", body=body)
    else:
        raw = request("POST", path, *headers, "Transfer-Encoding: chunked",
                      body=chunked(body, piece=50))
    return exchange(web.port, raw).json_error()


# Each form has every part, one of them refused: the answer names that part whatever the framing
# (a form read as empty would name the first part missing). The tests write nothing.
def test_a_chunked_file_upload_is_read_as_the_same_upload_with_a_length(web):
    lines = b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}}\n'
    errors = [upload(web, "/v1/files", framing, {"purpose": "assistants"},
                     {"file": ("lines.jsonl", lines, "application/jsonl")})
              for framing in ("length", "chunked")]
    assert errors[0] == errors[1]
    assert (errors[1]["param"], errors[1]["code"]) == ("purpose", "unsupported_value")


def test_a_chunked_adapter_upload_is_read_as_the_same_upload_with_a_length(web):
    errors = [upload(web, "/v1/adapters", framing, {"name": "chunky", "model": MODEL},
                     {"adapter_config": ("adapter_config.json", b"{}", "application/json"),
                      "adapter_model": ("adapter_model.bin", b"x" * 64, "application/x")})
              for framing in ("length", "chunked")]
    assert errors[0] == errors[1]
    assert (errors[1]["param"], errors[1]["code"]) == ("adapter_model", "invalid_file")


def test_the_openai_client_gets_a_413_naming_the_limit_and_goes_on(web):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{web.port}/v1", api_key=web.key,
                           max_retries=0, timeout=60)
    with pytest.raises(openai.APIStatusError) as raised:
        client.chat.completions.create(model=MODEL, max_tokens=1, messages=[
            {"role": "user", "content": "a" * (3 * 2**20)}])
    assert raised.value.status_code == 413 and raised.value.code == "request_too_large"
    assert str(LIMIT) in raised.value.message
    assert MODEL in [m.id for m in client.models.list()]  # the next request is served


# -- a path that takes larger bodies: the key first ------------------------------------------

def test_a_large_body_on_a_path_for_files_needs_a_valid_key_before_it_is_read(web):
    size = 4 * 2**20  # over the default, under the path's limit
    for auth, code in ((None, "missing_api_key"), ("Bearer sk-wrong", "invalid_api_key"),
                       ("Basic dXNlcjpwYXNz", "missing_api_key")):
        headers = [f"Content-Length: {size}"] + ([f"Authorization: {auth}"] if auth else [])
        answer = exchange(web.port, request("POST", "/v1/files", *headers))  # no body sent
        assert answer.status == 401 and answer.json_error()["code"] == code, auth
    chunked_head = request("POST", "/v1/files/upload", "Transfer-Encoding: chunked")
    assert exchange(web.port, chunked_head).status == 401


def test_with_a_valid_key_the_large_body_is_read(web):
    size = 4 * 2**20
    auth = f"Authorization: Bearer {web.key}"
    answers = [
        exchange(web.port, request("POST", "/v1/files", auth, f"Content-Length: {size}",
                                   body=b"x" * size)),
        exchange(web.port, request("POST", "/v1/files/abc", auth, "Transfer-Encoding: chunked",
                                   body=chunked(b"x" * size))),
    ]
    # Read whole, then answered by the API: not a form with a file; a file takes no POST.
    assert answers[0].status == 400 and answers[0].json_error()["param"] == "file"
    assert answers[1].status == 405 and answers[1].json_error()["code"] == "method_not_allowed"
    over = exchange(web.port, request("POST", "/v1/files", auth,
                                      f"Content-Length: {FILES_LIMIT + 1}"))
    assert over.status == 413 and f"{FILES_LIMIT} bytes" in over.json_error()["message"]


def test_expect_100_continue_is_answered_only_once_the_key_is_valid(web):
    size = 4 * 2**20
    with socket.create_connection(("127.0.0.1", web.port), timeout=30) as conn:
        conn.sendall(request("POST", "/v1/files", f"Authorization: Bearer {web.key}",
                             f"Content-Length: {size}", "Expect: 100-continue"))
        assert conn.recv(4096).startswith(b"HTTP/1.1 100 Continue")
        conn.sendall(b"x" * size)
        out = b""
        while part := conn.recv(65536):
            out += part
    assert parse_response(out).status == 400  # read, then refused: not a form with a file
    refused = exchange(web.port, request("POST", "/v1/files", f"Content-Length: {size}",
                                         "Expect: 100-continue"))
    assert refused.status == 401 and b"100 Continue" not in refused.raw


def test_the_key_check_of_a_large_body_with_the_database_down_is_a_retryable_503(tmp_path):
    process = WebProcess(f"sqlite:///{tmp_path}/gone/db.sqlite3", tmp_path / "daphne.log",
                         MAX_BODY_BYTES_BY_PATH=f"/v1/files={FILES_LIMIT}").wait_up()
    try:
        answer = exchange(process.port, request("POST", "/v1/files", "Authorization: Bearer "
                                                + "sk-" + "x" * 43, f"Content-Length: {LIMIT * 2}"))
    finally:
        process.stop()
    assert answer.status == 503 and answer.headers["retry-after"] == "1"
    error = answer.json_error()
    assert error["code"] == "service_unavailable" and error["details"] == {
        "dependency": "database"}


# -- odd paths and request targets -----------------------------------------------------------

@pytest.mark.parametrize("path", ["/static/%2e%2e/%2e%2e/etc/passwd", "/static/..%2fmanage.py",
                                  "/static/%2E%2E/llm_platform/settings.py"])
def test_a_static_path_outside_the_static_folders_is_a_404_without_a_traceback(web, path):
    before = tracebacks(web)
    answer = exchange(web.port, request("GET", path))
    assert answer.status == 404
    assert b"SECRET_KEY" not in answer.raw and b"root:" not in answer.raw
    assert tracebacks(web) == before


def test_an_absolute_form_target_is_served_as_its_path(web):
    auth = f"Authorization: Bearer {web.key}"
    models = exchange(web.port, request("GET", f"http://127.0.0.1:{web.port}/v1/models", auth))
    assert models.status == 200 and b'"object": "list"' in models.body
    missing = exchange(web.port, request("GET", f"HTTP://127.0.0.1:{web.port}/v1/nothing", auth))
    assert missing.status == 404 and missing.json_error()["code"] == "not_found"
    # The target's host counts, not the Host header: one not in ALLOWED_HOSTS is refused, in
    # one log line (any client can send one: no traceback each).
    before = tracebacks(web)
    foreign = exchange(web.port, request("GET", "http://evil.example/v1/models", auth))
    assert foreign.status == 400 and foreign.json_error()["code"] == "bad_request"
    assert wait_for(lambda: "evil.example" in web.process.output(), 5)
    assert tracebacks(web) == before


@pytest.mark.parametrize("method, target", [("OPTIONS", "*"), ("CONNECT", "127.0.0.1:443"),
                                            ("GET", "v1/models"), ("GET", "http://u@h/v1/x")])
def test_a_target_that_is_not_a_path_gets_a_json_400(web, method, target):
    answer = exchange(web.port, request(method, target))
    assert answer.status == 400 and "request target" in answer.json_error()["message"]


@pytest.mark.parametrize("target", [b"/v1/\xff\xfe", b"/v1/models/\x80", b"/v1/models?q=\xe9",
                                    b"/chat/\xc3\xa9"])
def test_raw_bytes_that_are_not_ascii_in_the_target_get_a_json_400(web, target):
    answer = exchange(web.port, request("GET", target))
    assert answer.status == 400 and "percent-encode" in answer.json_error()["message"]


@pytest.mark.parametrize("raw", [
    b"GARBAGE\r\n\r\n",
    b"GET /v1/models HTTP/2.0\r\nHost: 127.0.0.1\r\n\r\n",
    b"GET  /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
    b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nNo colon here\r\n\r\n",
    b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nBad Name: x\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: ten\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 3\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: gzip\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"zz\r\n",
    b"GET /v1/models HTTP/1.1\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(600)) + b"\r\n",
])
def test_malformed_http_gets_a_json_400(web, raw):
    answer = exchange(web.port, raw)
    assert answer.status == 400, answer.raw[:300]
    assert answer.json_error()["code"] == "bad_request"


def test_a_request_line_or_headers_too_long_get_414_and_431(web):
    line = exchange(web.port, request("GET", "/v1/models?" + "a" * 20_000))
    assert line.status == 414 and line.json_error()["code"] == "uri_too_long"
    header = exchange(web.port, request("GET", "/v1/models", "X-Big: " + "a" * 20_000))
    assert header.status == 431
    many = exchange(web.port, request("GET", "/v1/models",
                                      *(f"X-{i}: " + "a" * 100 for i in range(200))))
    assert many.status == 431
    assert many.json_error()["code"] == "request_header_fields_too_large"


def test_the_answers_of_this_layer_carry_every_security_header(web):
    """What the HTTP layer answers itself (before Django) carries the headers every response
    of the platform carries."""
    answers = {
        "413": exchange(web.port, request("POST", "/v1/completions",
                                          f"Content-Length: {LIMIT + 1}")),
        "400": exchange(web.port, b"GET  /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"),
        "414": exchange(web.port, request("GET", "/v1/models?" + "a" * 20_000)),
        "431": exchange(web.port, request("GET", "/v1/models", "X-Big: " + "a" * 20_000)),
        "401": exchange(web.port, request("POST", "/v1/files", f"Content-Length: {4 * 2**20}")),
    }
    for status, answer in answers.items():
        assert str(answer.status) == status, answer.raw[:300]
        assert answer.headers["x-content-type-options"] == "nosniff", status
        assert answer.headers["x-frame-options"] == "DENY", status
        assert answer.headers["referrer-policy"] == "same-origin", status
        assert answer.headers["cross-origin-opener-policy"] == "same-origin", status
        assert "frame-ancestors 'none'" in answer.headers["content-security-policy"], status
        answer.json_error()


# -- websockets -------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/ws/", "/ws/chat", "/ws/chat/more", "/v1/models", "/",
                                  "/healthz"])
def test_a_websocket_to_a_path_without_a_route_is_refused_without_a_traceback(web, path):
    before = tracebacks(web)
    with pytest.raises(websocket.WebSocketBadStatusException) as raised:
        websocket.create_connection(f"ws://127.0.0.1:{web.port}{path}", timeout=10,
                                    origin=f"http://127.0.0.1:{web.port}")
    assert raised.value.status_code == 403
    assert tracebacks(web) == before


# -- HEAD -------------------------------------------------------------------------------------

VOLATILE = {"date", "expires", "set-cookie", "content-security-policy"}


@pytest.mark.parametrize("path, authorized", [
    ("/healthz", False), ("/readyz", False), ("/v1/models", True), ("/v1/models", False),
    (f"/v1/models/{MODEL}", True), ("/scheduler/stats", False), ("/metrics", False),
    ("/chat/login/", False), ("/", False),
])
def test_head_is_answered_as_get_is_without_a_body(web, path, authorized):
    headers = [f"Authorization: Bearer {web.key}"] if authorized else []
    get = exchange(web.port, request("GET", path, *headers))
    head = exchange(web.port, request("HEAD", path, *headers))
    assert head.status == get.status, (path, get.raw[:300])
    assert get.status < 500 or path == "/readyz"  # not ready: no worker is alive here
    assert head.body == b""
    assert ({k: v for k, v in head.headers.items() if k not in VOLATILE}
            == {k: v for k, v in get.headers.items() if k not in VOLATILE})


def test_a_method_not_allowed_names_those_that_are(web):
    answer = exchange(web.port, request("POST", "/healthz", "Content-Length: 0"))
    assert answer.status == 405 and answer.headers["allow"] == "GET, HEAD"
    assert answer.json_error()["code"] == "method_not_allowed"
