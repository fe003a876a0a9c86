"""Fuzz: no input gets a 5xx, and every error is a JSON body that names its field.

Hypothesis drives, in-process through the ASGI stack:

- both REST endpoints' bodies: JSON values of every shape (not only objects), valid-looking
  requests with one field (top-level or nested) replaced by any JSON value or removed, and raw
  text no encoder writes: nesting 100,000 levels deep, numbers too big for a float or an
  integer, ``NaN`` and ``Infinity`` literals, lone surrogate escapes, bytes that are not UTF-8;
- the ``Authorization`` header (any bytes, as HTTP carries them; enormous) of every endpoint, and
  the query parameters of the GET ones, ``/v1/models/<id>`` with any id;
- the dashboard's query parameters (``since``: any text, ``nan``, ``1e20``, ...; any others; too
  many of them);
- ``HEAD`` wherever ``GET`` is served, in-process and on a real web process (the same status and
  headers, no body);
- on a real web process (``python -m llm_platform.serve``), over raw sockets, what only a server
  sees: bodies over the limit (announced and never sent, or chunked past it), odd request targets
  (raw bytes, absolute-form, ``*``, dot segments into and out of ``/static/``), websocket
  upgrades to any path, malformed HTTP, and any mix of them: an answer always comes, never a
  5xx, and under ``/v1`` every error is the JSON error shape.

Requests that pass validation run to the end on an in-process worker (reference backend), so a
valid request's whole path is fuzzed too, streaming or not. Every response must be < 500; every
error a JSON body in the OpenAI shape; an error about the field that was changed must name it; a
field the server does not know gets a 400 naming it, whatever its value (``null`` too).
"""

from __future__ import annotations

import json
from urllib.parse import quote_from_bytes

import pytest
from asgiref.sync import async_to_sync
from django.db import connection
from django.test import AsyncClient
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from tests.api.test_api import MODEL
from tests.support.platform import InProcessWorker

pytestmark = pytest.mark.django_db

CHAT, TEXT, RESP = "/v1/chat/completions", "/v1/completions", "/v1/responses"
FUZZ = hypothesis_settings(max_examples=100, deadline=None,
                           suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                  HealthCheck.too_slow,
                                                  HealthCheck.data_too_large])
# Error codes that are about one field of the request (the rest are about the whole body).
FIELD_CODES = {"invalid_value", "unsupported_parameter", "unknown_parameter", "model_not_found",
               "context_length_exceeded", "invalid_json_schema", "invalid_structured_output"}

# -- JSON values of every shape ----------------------------------------------------------------

LONE_SURROGATES = st.sampled_from(["\ud800", "a\udfff", "\udc00b", "x\ud83d"])
TEXT_VALUES = st.one_of(
    st.text(alphabet=st.characters(categories=["Cs", "L", "N", "P", "Z", "S", "Cc"]),
            max_size=12),
    LONE_SURROGATES,
    st.sampled_from(["", " ", "text", "none", MODEL, "user", "assistant", "system"]),
)
NUMBERS = st.one_of(
    st.integers(),
    st.integers(min_value=-(10**4200), max_value=10**4200),  # json writes up to 4300 digits
    st.sampled_from([0, 1, -1, 2, 3, 2**31 - 1, 2**31, 2**63, 2**64, -(2**63) - 1]),
    st.floats(),  # with nan and infinity: json writes NaN and Infinity literals
    st.sampled_from([0.5, -0.0, 1e-300, 1e308, 2.0000001]),
)
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, TEXT_VALUES)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda children: st.lists(children, max_size=3)
    | st.dictionaries(TEXT_VALUES, children, max_size=3),
    max_leaves=8,
)
# Values a field could well take (so that many changed requests are valid and run to the end).
NEAR_VALID = st.one_of(
    st.none(), st.booleans(), st.integers(-2, 70), st.floats(-0.5, 2.5),
    st.text(max_size=6), st.lists(st.text(max_size=3), max_size=5),
    st.sampled_from([{}, [], {"include_usage": False}, {"type": "text"}, "none", ["text"]]),
)

# -- raw JSON text no encoder writes ------------------------------------------------------------

DEEP = st.builds(
    lambda depth, kind: ("[" * depth + "]" * depth) if kind == "array"
    else ('{"a":' * depth + "1" + "}" * depth),
    st.one_of(st.integers(1, 2_000), st.sampled_from([100_000])), st.sampled_from(["array",
                                                                                   "object"]))
RAW_LITERALS = st.one_of(
    DEEP,
    st.sampled_from(["NaN", "-NaN", "Infinity", "-Infinity", "1e999", "-1e999", "1e-999",
                     "-0", "1E400", '"\\ud800"', '"\\udfff\\ud800"', '"\\u0000"', "[NaN]",
                     '{"include_usage": Infinity}', "tru", '"unterminated', "01", "1.", "."]),
    st.integers(300, 6_000).map(lambda digits: "9" * digits),
)

# -- valid requests, one field changed ----------------------------------------------------------

CHAT_FIELDS = [
    "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed",
    "stop", "n", "user", "stream", "stream_options", "top_k", "min_tokens", "ignore_eos",
    "tools", "tool_choice", "functions", "function_call", "logprobs", "top_logprobs",
    "logit_bias", "audio", "modalities", "prediction", "presence_penalty", "frequency_penalty",
    "response_format", "store", "metadata", "parallel_tool_calls", "reasoning_effort",
    "guided_json", "structured_outputs", "an_unknown_field",
]
TEXT_FIELDS = [
    "model", "prompt", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "user",
    "stream", "stream_options", "top_k", "min_tokens", "ignore_eos", "logprobs", "echo",
    "suffix", "best_of", "logit_bias", "presence_penalty", "frequency_penalty",
    "response_format", "store", "guided_regex", "structured_outputs", "an_unknown_field",
]
RESP_FIELDS = [
    "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "metadata",
    "stream", "store", "previous_response_id", "text", "tools", "tool_choice",
    "parallel_tool_calls", "user", "truncation", "include", "reasoning", "background",
    "top_logprobs", "stream_options", "service_tier", "prompt_cache_key", "safety_identifier",
    "max_tool_calls", "conversation", "prompt", "an_unknown_field",
]
FIELDS = {CHAT: CHAT_FIELDS, TEXT: TEXT_FIELDS, RESP: RESP_FIELDS}
UNKNOWN = "an_unknown_field"
# Nested places: (top-level field, the path below it).
CHAT_NESTED = [("messages", (0,)), ("messages", (0, "role")), ("messages", (0, "content")),
               ("messages", (0, "content", 0)), ("messages", (0, "content", 0, "text")),
               ("messages", (0, "name")), ("messages", (0, "tool_calls")),
               ("stream_options", ("include_usage",)), ("stop", (0,)),
               ("response_format", ("type",))]
TEXT_NESTED = [("prompt", (0,)), ("stream_options", ("include_usage",)), ("stop", (1,)),
               ("response_format", ("type",))]
RESP_NESTED = [("input", (0,)), ("input", (0, "role")), ("input", (0, "content")),
               ("input", (0, "type")), ("input", (0, "content", 0)),
               ("input", (0, "content", 0, "type")), ("input", (0, "content", 0, "text")),
               ("text", ("format",)), ("text", ("format", "type")), ("tools", (0,)),
               ("tools", (0, "name")), ("tools", (0, "parameters"))]
NESTED = {CHAT: CHAT_NESTED, TEXT: TEXT_NESTED, RESP: RESP_NESTED}


def base(path: str) -> dict:
    if path == RESP:
        return {"model": MODEL, "max_output_tokens": 2, "store": False, "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "Hello"}]}]}
    if path == CHAT:
        return {"model": MODEL, "max_tokens": 2, "stop": ["a", "b"], "stream": True,
                "stream_options": {"include_usage": True},
                "messages": [{"role": "user", "content": [{"type": "text", "text": "Hello"}]}]}
    return {"model": MODEL, "prompt": ["Once upon"], "max_tokens": 2, "stop": ["a", "b"],
            "stream": True, "stream_options": {"include_usage": True}}


def put(body: dict, top: str, below: tuple, value, remove: bool) -> None:
    """Replace (or remove) ``body[top][below...]``; a path that is not there is created."""
    if not below:
        if remove:
            body.pop(top, None)
        else:
            body[top] = value
        return
    node = body.setdefault(top, {} if isinstance(below[0], str) else [])
    for i, key in enumerate(below):
        last = i == len(below) - 1
        if isinstance(key, int):
            if not isinstance(node, list):
                return
            while len(node) <= key:
                node.append({})
        elif not isinstance(node, dict):
            return
        if last:
            if remove and isinstance(node, dict):
                node.pop(key, None)
            elif remove:
                del node[key]
            else:
                node[key] = value
        else:
            if isinstance(node, dict) and key not in node:
                node[key] = {} if isinstance(below[i + 1], str) else []
            node = node[key]


REQUIRED = {"model", "messages", "prompt", "input"}


@st.composite
def mutated(draw, path: str) -> tuple[str, str, bool]:
    """A valid request of ``path`` with one field changed: (the top-level field, the body,
    whether the change is an optional top-level field sent as null, which means its default)."""
    body = base(path)
    body["stream"] = draw(st.booleans())
    if not body["stream"]:  # stream_options only go with a stream
        body.pop("stream_options", None)
    places = [(f, ()) for f in FIELDS[path]] + NESTED[path]
    top, below = draw(st.sampled_from(places))
    remove = draw(st.integers(0, 5)) == 0
    value = draw(st.one_of(JSON_VALUES, NEAR_VALID)) if not remove else None
    put(body, top, below, value, remove)
    # A null stream is no stream: the stream_options beside it are then a 400 of their own.
    unwanted = top == "stream" and "stream_options" in body
    return top, json.dumps(body), value is None and not remove and not below and \
        top not in REQUIRED | {UNKNOWN} and not unwanted


@st.composite
def raw_in_a_field(draw, path: str) -> tuple[str, str]:
    """A valid request of ``path`` with raw JSON text in one field: (the field, the body)."""
    body = base(path)
    top = draw(st.sampled_from(FIELDS[path]))
    body.pop(top, None)
    text = json.dumps(body)
    return top, text[:-1] + f', "{top}": {draw(RAW_LITERALS)}' + "}"


WHOLE_BODIES = st.one_of(  # bytes as sent: any bytes too, UTF-8 or not
    JSON_VALUES.map(lambda value: json.dumps(value).encode()),
    RAW_LITERALS.map(str.encode),
    st.binary(max_size=40),
    st.sampled_from([b"", b"\xef\xbb\xbf{}", b'{"model": "\xff"}', '{"a": 1}'.encode("utf-16")]),
)


# -- sending and checking -----------------------------------------------------------------------

def send(method: str, path: str, body: str | bytes | None = None, **headers: str):
    """One request through the ASGI handler; the whole content, streamed or not, is read."""

    async def go():
        client = AsyncClient()
        if method == "post":
            response = await client.post(path, body, content_type="application/json",
                                         headers=headers)
        elif method == "head":
            response = await client.head(path, headers=headers)
        else:
            response = await client.get(path, headers=headers)
        if response.streaming:
            content = b"".join([part async for part in response.streaming_content])
        else:
            content = response.content
        return response, content

    return async_to_sync(go)()


def check(response, content: bytes, field: str | None = None) -> None:
    """No 5xx; errors are JSON in the OpenAI shape; a field's error names ``field``."""
    status = response.status_code
    assert status < 500, content[:500]
    if status < 400:
        if response.streaming:
            for frame in content.decode().split("\n\n"):
                data = frame.rpartition("data: ")[2] if "data: {" in frame else ""
                if data:  # a chat chunk's error, or a failed response's
                    event = json.loads(data)
                    error = event.get("error") or (event.get("response") or {}).get("error")
                    assert error is None or error["type"] != "server_error", frame
        return
    assert response["Content-Type"] == "application/json", content[:300]
    error = json.loads(content)["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if field is not None and error["code"] in FIELD_CODES:
        param = error["param"] or ""
        # A stream turned off (or not a boolean) leaves stream_options unwanted: named instead.
        named = param == field or param.startswith((f"{field}[", f"{field}."))
        assert named or (field == "stream" and param == "stream_options"), (field, error)


@pytest.fixture
def worker(redis_prefix, settings):
    """A small in-process worker (a 64-token context keeps generations short)."""
    settings.LLM_PLATFORM = {**settings.LLM_PLATFORM, "REQUEST_IDLE_TIMEOUT_S": 60.0}
    w = InProcessWorker(redis_prefix, settings.REDIS_URL, max_model_len=64, max_batch_size=4,
                        prefetch=4).start()
    yield w
    w.stop()


def bearer(raw_key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {raw_key}"}


# -- the REST endpoints -------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("path", [CHAT, TEXT, RESP])
def test_one_field_changed(tenant_key, worker, path):
    @FUZZ
    @given(case=mutated(path))
    def run(case):
        field, body, default = case
        response, content = send("post", path, body, **bearer(tenant_key[2]))
        check(response, content, field=field)
        if default:  # null means the default: the request is as valid as without the field
            assert response.status_code == 200, (field, content[:300])
        if field == UNKNOWN and f'"{UNKNOWN}"' in body:
            assert response.status_code == 400, content[:300]
            assert json.loads(content)["error"]["param"] == UNKNOWN

    run()


@pytest.mark.slow
@pytest.mark.parametrize("path", [CHAT, TEXT, RESP])
def test_raw_json_text_in_a_field(tenant_key, worker, path):
    @FUZZ
    @given(case=raw_in_a_field(path))
    def run(case):
        field, body = case
        check(*send("post", path, body, **bearer(tenant_key[2])), field=field)

    run()


@pytest.mark.slow
@pytest.mark.parametrize("path", [CHAT, TEXT, RESP])
def test_whole_bodies_of_any_shape(tenant_key, worker, path):
    @FUZZ
    @given(body=WHOLE_BODIES)
    def run(body):
        check(*send("post", path, body, **bearer(tenant_key[2])))

    run()


@pytest.mark.parametrize("path", [CHAT, TEXT, RESP])
@pytest.mark.parametrize("wrap", ["body", "field"])
def test_nesting_100000_levels_deep(tenant_key, path, wrap):
    deep = "[" * 100_000 + "]" * 100_000
    body = deep if wrap == "body" else json.dumps(base(path))[:-1] + f', "stop": {deep}' + "}"
    response, content = send("post", path, body, **bearer(tenant_key[2]))
    assert response.status_code == 400, content[:300]
    assert json.loads(content)["error"]["code"] == "invalid_json"


# -- headers, paths and query parameters --------------------------------------------------------

AUTHORIZATION = st.one_of(
    st.binary(max_size=60).map(lambda b: "Bearer " + b.decode("latin-1")),
    st.binary(max_size=60).map(lambda b: b.decode("latin-1")),
    st.sampled_from(["Bearer " + "x" * 1_000_000, "Bearer sk-\x00", "Bearer é", "Bearer  ",
                     "bearer sk-a b", "Basic dXNlcjpwYXNz"]),
)
QUERY = st.lists(st.tuples(st.binary(max_size=8), st.binary(max_size=24)), max_size=4).map(
    lambda pairs: "&".join(f"{quote_from_bytes(k)}={quote_from_bytes(v)}" for k, v in pairs))
GET_PATHS = ["/v1/models", "/scheduler/stats", "/metrics", "/readyz", "/healthz",
             "/v1/models/" + MODEL]


@pytest.mark.slow
def test_any_authorization_header_and_query(worker, db):
    @FUZZ
    @given(path=st.sampled_from(GET_PATHS + [CHAT, TEXT]), auth=AUTHORIZATION, query=QUERY,
           head=st.booleans())
    def run(path, auth, query, head):
        if path in (CHAT, TEXT):
            response, content = send("post", f"{path}?{query}", json.dumps(base(path)),
                                     Authorization=auth)
        else:
            response, content = send("head" if head else "get", f"{path}?{query}",
                                     Authorization=auth)
        assert response.status_code < 500, content[:300]
        if head and path not in (CHAT, TEXT):
            assert content == b""
        elif response.status_code >= 400 and path != "/readyz":
            assert json.loads(content)["error"]["code"]

    run()


# Any bytes but a newline (see the test after this one).
MODEL_IDS = st.one_of(
    st.binary(min_size=1, max_size=40).filter(lambda b: b"\n" not in b).map(quote_from_bytes),
    st.sampled_from(["%00", "%ff", "%ed%a0%80", "..", "%2F", "a" * 100_000, MODEL + "%00",
                     "%0D", "%E2%80%A8"]),
)


@pytest.mark.slow
def test_any_model_id(tenant_key, worker):
    @FUZZ
    @given(model_id=MODEL_IDS)
    def run(model_id):
        response, content = send("get", f"/v1/models/{model_id}", **bearer(tenant_key[2]))
        check(response, content)
        assert len(content) < 2_000  # a long id is not echoed whole

    run()


@pytest.mark.parametrize("path", ["/v1/models/%0A", "/v1/models/a%0Ab", "/v1/x%0A"])
def test_a_path_with_a_newline_gets_a_json_404(tenant_key, path):
    response, content = send("get", path, **bearer(tenant_key[2]))
    assert response.status_code == 404 and response["Content-Type"] == "application/json"


# -- the dashboard's query parameters -----------------------------------------------------------

SINCE = st.one_of(
    st.sampled_from(["1e20", "-1e20", "nan", "NaN", "inf", "-inf", "infinity", "1e308",
                     "-1e308", "1e-320", "0", "-0", "", " ", "abc", "1_000", "0x10",
                     "253402300800", "-62135596801", "%00", "%ff", "1e20%00"]),
    st.floats().map(repr),
    st.integers(min_value=-(10**30), max_value=10**30).map(str),
    st.binary(max_size=12).map(quote_from_bytes),
)


@pytest.mark.slow
def test_the_dashboard_data_takes_any_query(admin_client, db):
    admin_client.raise_request_exception = False

    @FUZZ
    @given(since=SINCE, others=QUERY)
    def run(since, others):
        response = admin_client.get(f"/admin/scheduler/data?since={since}&{others}")
        check(response, response.content, field="since")
        if response.status_code == 200:
            assert isinstance(response.json()["history"], list)
        else:
            assert response.status_code == 400
            assert response.json()["error"]["param"] == "since"

    run()


@pytest.mark.parametrize("since", ["1e20", "nan", "-1e20", "inf", "-inf", "1e308", "abc"])
def test_the_dashboard_data_answers_odd_since_values(admin_client, since):
    admin_client.raise_request_exception = False
    response = admin_client.get(f"/admin/scheduler/data?since={since}")
    check(response, response.content, field="since")
    if since in ("1e20", "-1e20", "1e308"):  # numbers: after the last snapshot, or the window
        assert response.status_code == 200
    else:
        assert response.status_code == 400 and response.json()["error"]["param"] == "since"


def test_too_many_query_parameters_get_a_json_400(admin_client):
    admin_client.raise_request_exception = False
    response = admin_client.get("/admin/scheduler/data?" + "&".join(["a=1"] * 1_200))
    assert response.status_code == 400 and response["Content-Type"] == "application/json"


@pytest.mark.parametrize("path", ["/v1/models", "/scheduler/stats", "/metrics"])
def test_a_token_that_cannot_be_a_key_gets_a_json_401(client, db, path):
    # Over HTTP a header is bytes (read as latin-1, never a lone surrogate); Django's test
    # client hands the string over as it is, which covers both.
    for token in ["\ud800", "sk-\x00", "é" * 10, "x" * 1_000_000]:
        response = client.get(path, HTTP_AUTHORIZATION=f"Bearer {token}")
        assert response.status_code == 401, token[:20]
        assert response["Content-Type"] == "application/json"


@pytest.mark.skipif(connection.vendor != "postgresql", reason="PostgreSQL's text refuses NUL")
@pytest.mark.parametrize("path", ["/scheduler/stats", "/metrics", "/admin/scheduler/data"])
def test_a_session_cookie_with_a_nul_gets_no_500(client, path):
    client.raise_request_exception = False
    client.cookies["sessionid"] = "abcdefgh\x00ijklmnop"
    assert client.get(path).status_code < 500


# -- below the views: a real web process, raw sockets -------------------------------------------
#
# What only a real server sees, below Django and the views: bodies over the limit (announced and
# not sent, or chunked past it), odd request targets (raw bytes, absolute-form, ``*``, dot
# segments into and out of /static/), websocket upgrades to any path, ``HEAD``, malformed HTTP.
# The process runs with a small body limit (64 KiB; /v1/files 256 KiB) so a large body is cheap.

WEB_LIMIT, WEB_FILES_LIMIT = 65_536, 262_144


@pytest.fixture(scope="module")
def web(django_db_setup, django_db_blocker, tmp_path_factory):
    from django.conf import settings

    from benchmarks.harness.stack import database_url
    from tests.support.web_process import WebProcess

    with django_db_blocker.unblock():
        url = database_url(connection.settings_dict)
    process = WebProcess(url, tmp_path_factory.mktemp("fuzz-web") / "daphne.log",
                         MAX_BODY_BYTES=str(WEB_LIMIT),
                         MAX_BODY_BYTES_BY_PATH=f"/v1/files={WEB_FILES_LIMIT}").wait_up()
    yield process
    process.stop(settings.REDIS_URL)


def raw_request(method: bytes, target: bytes, headers: list[bytes], body: bytes = b"") -> bytes:
    lines = [method + b" " + target + b" HTTP/1.1", *headers]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def chunk(payload: bytes, *, end: bool = True) -> bytes:
    framed = b"%x\r\n%s\r\n" % (len(payload), payload) if payload else b""
    return framed + (b"0\r\n\r\n" if end else b"")


def under_v1(target: bytes) -> bool:
    """Whether the platform serves ``target`` as a path under /v1 (or cannot parse it: the
    server's own refusal, JSON too)."""
    from llm_platform.http_guard import parse_target

    try:
        route = parse_target(target).route
    except ValueError:
        return True
    return route == "/v1" or route.startswith("/v1/")


def check_raw(web, method: bytes, target: bytes, raw: bytes, upgrade: bool) -> None:
    """An answer came, below 500; under /v1 an error is the platform's JSON error; a HEAD's
    answer has no body."""
    from tests.support.web_process import exchange

    answer = exchange(web.port, raw, timeout_s=10)
    assert answer.status != 0, raw[:200]
    # /readyz answers 503 while no worker is alive (none is, here): its answer, not an error (a
    # HEAD's has no body: its Retry-After says it).
    ready = answer.status == 503 and (b'"status": "unavailable"' in answer.body or (
        method == b"HEAD" and target.split(b"?")[0].endswith(b"/readyz")
        and answer.headers.get("retry-after") == "1"))
    assert answer.status < 500 or ready, (raw[:200], answer.raw[:300])
    if upgrade or answer.status < 400:
        return
    if method == b"HEAD":
        assert answer.body == b"", (raw[:200], answer.raw[:300])
    elif under_v1(target):
        answer.json_error()


OWN = b"Host: 127.0.0.1"
ODD_TARGETS = [
    b"/static/%2e%2e/%2e%2e/etc/passwd", b"/static/..%2f..%2fmanage.py", b"/static/%2E%2E/",
    b"/static/%00", b"/static/" + b"a" * 300, b"/v1/%00", b"/v1/%ff", b"/%2e%2e/v1/models",
    b"//v1/models", b"/v1//models", b"/v1/models/..", b"*", b"127.0.0.1:443", b"v1/models",
    b"http://127.0.0.1/v1/models", b"http://evil.example/v1/models", b"HTTP://127.0.0.1:1/v1/x?a",
    b"https://127.0.0.1/static/%2e%2e/manage.py", b"http://user@127.0.0.1/v1/models",
    b"http:///v1/models", b"/v1/\xff\xfe", b"/v1/models/\x80", b"/v1/models?q=\xe9",
    b"/chat/\xc3\xa9", b"/v1/models?" + b"a" * 20_000, b"/ws/", b"/ws/chat", b"/ws/chat/x",
]
# (name, extra headers, body) of the request's body.
BODY_CASES = [
    ("none", [], b""),
    ("small", [b"Content-Length: 2"], b"{}"),
    ("announced 300 MB", [b"Content-Length: 300000000"], b""),
    ("announced 10^30 bytes", [b"Content-Length: " + b"9" * 30], b""),
    ("over the limit by one", [b"Content-Length: %d" % (WEB_LIMIT + 1)], b"x" * (WEB_LIMIT + 1)),
    ("over the files limit", [b"Content-Length: %d" % (WEB_FILES_LIMIT + 1)], b""),
    ("chunked past the limit", [b"Transfer-Encoding: chunked"],
     chunk(b"x" * (WEB_LIMIT + 1), end=False)),
    ("chunked, small", [b"Transfer-Encoding: chunked"], chunk(b"{}")),
    ("chunked, malformed", [b"Transfer-Encoding: chunked"], b"zz\r\n"),
    ("length and chunked", [b"Content-Length: 2", b"Transfer-Encoding: chunked"], b"{}"),
    ("negative length", [b"Content-Length: -1"], b""),
    ("two lengths", [b"Content-Length: 1", b"Content-Length: 2"], b"{}"),
    ("expect 100-continue", [b"Content-Length: 300000", b"Expect: 100-continue"], b""),
]
UPGRADE_HEADERS = [b"Upgrade: websocket", b"Connection: Upgrade",
                   b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==", b"Sec-WebSocket-Version: 13"]


@pytest.mark.process
@pytest.mark.parametrize("target", ODD_TARGETS)
@pytest.mark.parametrize("method", [b"GET", b"HEAD", b"POST"])
def test_odd_targets_on_the_real_server(web, method, target):
    raw = raw_request(method, target, [OWN, b"Connection: close", b"Content-Length: 0"])
    check_raw(web, method, target, raw, upgrade=False)


@pytest.mark.process
@pytest.mark.parametrize("name, headers, body", BODY_CASES, ids=[c[0] for c in BODY_CASES])
@pytest.mark.parametrize("target", [b"/v1/chat/completions", b"/v1/completions", b"/v1/files",
                                    b"/v1/models", b"/chat/login/", b"/static/%2e%2e/x"])
def test_bodies_on_the_real_server(web, target, name, headers, body):
    raw = raw_request(b"POST", target, [OWN, b"Connection: close",
                                        b"Authorization: Bearer sk-" + b"x" * 43, *headers], body)
    check_raw(web, b"POST", target, raw, upgrade=False)


@pytest.mark.process
@pytest.mark.parametrize("target", [b"/ws/", b"/ws/chat", b"/v1/models", b"/healthz", b"/",
                                    b"/static/%2e%2e/x", b"http://127.0.0.1/ws/", b"/v1/\xff"])
@pytest.mark.parametrize("origin", [None, b"http://127.0.0.1", b"http://evil.example"])
def test_websocket_upgrades_on_the_real_server(web, target, origin):
    headers = [OWN, *UPGRADE_HEADERS] + ([b"Origin: " + origin] if origin else [])
    check_raw(web, b"GET", target, raw_request(b"GET", target, headers), upgrade=True)


MALFORMED = [
    b"GARBAGE\r\n\r\n", b"\r\n\r\n", b"GET\r\n\r\n", b"GET /v1/models\r\n\r\n",
    b"GET /v1/models HTTP/2.0\r\nHost: 127.0.0.1\r\n\r\n",
    b"GET /v1/models HTTP/1.1\r\nNo colon\r\n\r\n",
    b"GET /v1/models HTTP/1.1\r\nBad Name: x\r\n\r\n",
    b"GET /v1/models HTTP/1.1\r\nX: a\x00b\r\n\r\n",
    b"GET /v1/models HTTP/1.1\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n",
    b"GET /v1/models HTTP/1.1\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(600)) + b"\r\n",
    b"\xff\xfe\r\n\r\n", b"G\x00T /v1/models HTTP/1.1\r\n\r\n",
]


@pytest.mark.process
@pytest.mark.parametrize("raw", MALFORMED)
def test_malformed_http_on_the_real_server(web, raw):
    check_raw(web, b"GET", b"/v1", raw, upgrade=False)


@pytest.mark.process
@pytest.mark.parametrize("path", GET_PATHS + ["/", "/chat/login/"])
def test_head_on_the_real_server_is_get_without_a_body(web, path):
    from tests.support.web_process import exchange

    headers = [OWN, b"Connection: close"]
    get = exchange(web.port, raw_request(b"GET", path.encode(), headers))
    head = exchange(web.port, raw_request(b"HEAD", path.encode(), headers))
    assert head.status == get.status, (path, get.raw[:300])
    assert get.status < 500 or path == "/readyz"  # not ready: no worker is alive here
    assert head.body == b""
    assert head.headers.get("content-length") == get.headers.get("content-length")


# Pieces the fuzzer puts together into one request.
RAW_METHODS = st.sampled_from([b"GET", b"HEAD", b"POST", b"PUT", b"DELETE", b"OPTIONS", b"PATCH",
                               b"TRACE", b"CONNECT", b"FOO", b"get"])
RAW_TARGETS = st.one_of(
    st.sampled_from(ODD_TARGETS + [p.encode() for p in GET_PATHS]
                    + [b"/v1/chat/completions", b"/v1/completions", b"/v1/files", b"/chat/",
                       b"/admin/", b"/", b"/static/chat/chat.js"]),
    st.lists(st.sampled_from(["v1", "models", "files", "..", "%2e%2e", "%2f", "static", "ws",
                              "chat", "", "%00", "%ff", "%0a", "admin", "metrics"]),
             max_size=5).map(lambda parts: ("/" + "/".join(parts)).encode()),
    st.binary(min_size=1, max_size=16).map(lambda raw: b"/v1/" + raw),
    st.binary(min_size=1, max_size=16),
    st.sampled_from([b"http://127.0.0.1", b"http://localhost:1", b"https://[::1]"]).flatmap(
        lambda host: st.sampled_from(GET_PATHS + ["/v1/x", "/static/%2e%2e/a", ""]).map(
            lambda path: host + path.encode())),
)
RAW_HOSTS = st.sampled_from([[OWN], [], [b"Host: evil.example"], [OWN, OWN], [b"Host: "]])
RAW_AUTH = st.sampled_from([[], [b"Authorization: Bearer sk-" + b"x" * 43],
                            [b"Authorization: Bearer \xff"], [b"Authorization: Basic eA=="]])


@pytest.mark.slow
@pytest.mark.process
def test_any_request_on_the_real_server(web):
    @FUZZ
    @given(method=RAW_METHODS, target=RAW_TARGETS, host=RAW_HOSTS, auth=RAW_AUTH,
           upgrade=st.booleans(), body=st.sampled_from(BODY_CASES))
    def run(method, target, host, auth, upgrade, body):
        _, body_headers, payload = body
        headers = [*host, b"Connection: close", *auth, *body_headers]
        if upgrade:
            headers = [*host, *UPGRADE_HEADERS, b"Origin: http://127.0.0.1", *auth]
            payload = b""
        check_raw(web, method, target, raw_request(method, target, headers, payload), upgrade)

    run()
