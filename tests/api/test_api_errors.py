"""Bad input and server trouble get a JSON error body with the right status, never a 500 page."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid

import pytest
import redis.exceptions

from api.schemas import MAX_TOKENS_LIMIT, ChatCompletionRequest, CompletionRequest, validate
from gateway import admission, lifecycle
from gateway.admission import Principal
from inference.protocol.messages import RequestMessage
from tests.api.test_api import CHAT, MODEL, chat, error_of, post, post_stream, read_sse

pytestmark = pytest.mark.django_db

TEXT = "/v1/completions"


def text(prompt, **extra):
    return {"model": MODEL, "prompt": prompt, "max_tokens": 4, **extra}


def assert_400(response, param: str, *words: str) -> dict:
    assert response.status_code == 400
    assert response["Content-Type"] == "application/json"
    error = error_of(response)
    assert error["type"] == "invalid_request_error" and error["param"] == param
    for word in words:
        assert word in error["message"]
    return error


# 1. Text that is not valid Unicode (a lone surrogate escape) ------------------------------------

@pytest.mark.parametrize(("path", "body", "param"), [
    (CHAT, {**chat(), "messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content"),
    (CHAT, {**chat(stream=True), "messages": [{"role": "user", "content": "\ud800"}]},
     "messages[0].content"),
    (CHAT, {**chat(), "messages": [{"role": "system", "content": "ok"},
                                   {"role": "user", "content": [{"type": "text",
                                                                 "text": "x\udc00"}]}]},
     "messages[1].content"),
    (TEXT, text("a\udfff"), "prompt"),
    (TEXT, text("a\udfff", stream=True), "prompt"),
    (TEXT, text(["a\udfff"]), "prompt"),
    (CHAT, chat(stop="end\ud800"), "stop"),
    (CHAT, chat(stop=["fine", "end\ud800"]), "stop[1]"),
    (TEXT, text("Once", stop="\udfff"), "stop"),
    (CHAT, chat(user="\ud800"), "user"),
])
def test_lone_surrogate_gets_400_naming_the_field(client, tenant_key, path, body, param):
    assert "\\ud" in json.dumps(body)  # sent as the client sends it: an escape in the JSON
    assert_400(post(client, tenant_key[2], body, path=path), param, "not valid Unicode text")


# 2. Strict JSON types ------------------------------------------------------------------------

@pytest.mark.parametrize(("extra", "param", "expected"), [
    ({"max_tokens": "10"}, "max_tokens", "an integer"),
    ({"max_tokens": True}, "max_tokens", "an integer"),
    ({"max_tokens": 10.5}, "max_tokens", "an integer"),
    ({"max_completion_tokens": "3"}, "max_completion_tokens", "an integer"),
    ({"seed": "7"}, "seed", "an integer"),
    ({"n": True}, "n", "an integer"),
    ({"stream": "yes"}, "stream", "a boolean"),
    ({"stream": 1}, "stream", "a boolean"),
    ({"ignore_eos": "true"}, "ignore_eos", "a boolean"),
    ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage", "a boolean"),
    ({"temperature": "1"}, "temperature", "a number"),
    ({"top_p": False}, "top_p", "a number"),
    ({"user": 5}, "user", "a string"),
])
def test_loose_types_get_400_naming_the_field(client, tenant_key, extra, param, expected):
    assert_400(post(client, tenant_key[2], chat(**extra)), param, "Invalid type", expected)


def test_json_numbers_and_booleans_of_the_right_type_are_accepted():
    req = validate(ChatCompletionRequest, chat(max_tokens=10, temperature=1, top_p=0.5,
                                               stream=True, seed=-3, stop=None))
    assert (req.max_tokens, req.temperature, req.stream, req.stop) == (10, 1.0, True, [])
    assert validate(CompletionRequest, text(["Once"])).prompt == "Once"


def test_nan_is_not_json(client, tenant_key):
    body = json.dumps(chat()).replace('"max_tokens": 4', '"max_tokens": 4, "temperature": NaN')
    response = post(client, tenant_key[2], body)
    assert response.status_code == 400 and error_of(response)["code"] == "invalid_json"


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-32"])
def test_a_json_body_in_another_encoding_than_utf_8_is_refused_as_such(client, tenant_key,
                                                                       encoding):
    # Python's json.loads would read these (it guesses UTF-16 and 32); RFC 8259 says UTF-8.
    response = client.post(CHAT, json.dumps(chat()).encode(encoding),
                           content_type="application/json",
                           HTTP_AUTHORIZATION=f"Bearer {tenant_key[2]}")
    assert response.status_code == 400 and error_of(response)["code"] == "invalid_json"
    # (without a byte order mark, UTF-16-LE's ASCII is valid UTF-8 with NULs: not JSON then)
    assert "not UTF-8" in error_of(response)["message"] or encoding == "utf-16-le"
    assert "codec" not in error_of(response)["message"]


def test_a_utf_8_body_with_a_byte_order_mark_is_read(client, tenant_key):
    body = b"\xef\xbb\xbf" + json.dumps(chat(max_tokens=-1)).encode()
    response = client.post(CHAT, body, content_type="application/json",
                           HTTP_AUTHORIZATION=f"Bearer {tenant_key[2]}")  # its field refused
    assert response.status_code == 400 and error_of(response)["param"] == "max_tokens"


# 3. Field names as the client wrote them, and limits in the message --------------------------

@pytest.mark.parametrize(("path", "body", "param"), [
    (CHAT, {**chat(), "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    (CHAT, {**chat(), "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content"),
    (CHAT, {**chat(), "messages": [{"role": "user", "content": [7]}]}, "messages[0].content"),
    (CHAT, {**chat(), "messages": [{"role": "user", "content": "a"}, {"role": "bot",
                                                                      "content": "b"}]},
     "messages[1].role"),
    (CHAT, {**chat(), "messages": ["hello"]}, "messages[0]"),
    (CHAT, chat(stop=5), "stop"),
    (CHAT, chat(stop=["a", 1]), "stop[1]"),
    (CHAT, chat(stop=["a"] * 5), "stop"),
    (TEXT, text(None), "prompt"),
    (TEXT, text(5), "prompt"),
    (TEXT, text(["a", "b"]), "prompt"),
    (TEXT, {"model": MODEL}, "prompt"),
])
def test_error_param_is_the_field_as_written(client, tenant_key, path, body, param):
    error = assert_400(post(client, tenant_key[2], body, path=path), param)
    assert ".str" not in error["message"] and "list[" not in error["message"]


@pytest.mark.parametrize(("path", "body", "param", "words"), [
    (CHAT, {**chat(), "messages": []}, "messages", ("at least 1 item", "got 0")),
    (CHAT, {**chat(), "messages": [{"role": "user", "content": "hi", "name": 5}]},
     "messages[0].name", ("a string",)),
    (CHAT, chat(min_tokens=10), "min_tokens", ("at most 'max_tokens' (4)", "got 10")),
    (CHAT, {**chat(min_tokens=10), "max_tokens": None, "max_completion_tokens": 6}, "min_tokens",
     ("at most 'max_completion_tokens' (6)",)),
    (TEXT, text("Once", min_tokens=5), "min_tokens", ("at most 'max_tokens' (4)",)),
])
def test_fields_that_contradict_or_break_the_shape_get_400_with_the_limit(
        client, tenant_key, path, body, param, words):
    error = assert_400(post(client, tenant_key[2], body, path=path), param, *words)
    assert "validation" not in error["message"]  # the validator's own words stay inside


def test_min_tokens_up_to_max_tokens_and_a_named_message_are_accepted():
    req = validate(ChatCompletionRequest, {**chat(min_tokens=4), "messages": [
        {"role": "user", "content": "hi", "name": "ada"}]})
    assert req.min_tokens == 4 and req.messages[0].as_dict() == {"role": "user", "content": "hi"}
    unbounded = validate(CompletionRequest, text("Once", max_tokens=None, min_tokens=50))
    assert unbounded.min_tokens == 50


@pytest.mark.parametrize("raw", ["1e30", "1" + "0" * 400, "-1", "0"])
def test_out_of_range_integer_gets_a_short_message_with_the_limit(client, tenant_key, raw):
    body = json.dumps(chat()).replace('"max_tokens": 4', f'"max_tokens": {raw}')
    error = assert_400(post(client, tenant_key[2], body), "max_tokens", str(MAX_TOKENS_LIMIT))
    assert len(error["message"]) < 160 and "parse" not in error["message"]


@pytest.mark.parametrize(("path", "body", "param"), [
    (CHAT, chat(max_tokens=250), "max_tokens"),
    (CHAT, chat(max_tokens=250, stream=True), "max_tokens"),
    (CHAT, {**chat(max_completion_tokens=250), "max_tokens": None}, "max_completion_tokens"),
    (CHAT, {**chat(), "max_tokens": None, "messages": [{"role": "user", "content": "x" * 400}]},
     "messages"),
    (TEXT, text("x" * 400, max_tokens=None), "prompt"),
    (TEXT, text("Once", max_tokens=255), "max_tokens"),
    # The prompt alone fills the context: the prompt is at fault, whatever max_tokens says.
    (TEXT, text("x" * 400, max_tokens=2), "prompt"),
    (CHAT, {**chat(max_tokens=2), "messages": [{"role": "user", "content": "x" * 400}]},
     "messages"),
])
def test_context_length_exceeded_names_the_field(client, tenant_key, inproc_worker, path, body,
                                                 param):
    error = assert_400(post(client, tenant_key[2], body, path=path), param)
    assert error["code"] == "context_length_exceeded"


# 4. Bodies over the upload limit, unknown paths ----------------------------------------------

@pytest.mark.parametrize("path", [CHAT, TEXT])
def test_body_over_the_upload_limit_gets_413_naming_the_limit(client, tenant_key, settings,
                                                              path):
    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    body = {**chat(), "messages": [{"role": "user", "content": "x" * (limit + 10)}]}
    response = post(client, tenant_key[2], body, path=path)
    assert response.status_code == 413 and response["Content-Type"] == "application/json"
    error = error_of(response)
    assert error["code"] == "request_too_large" and f"{limit} bytes" in error["message"]
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(("method", "path"), [
    ("post", "/v1/embeddings"),
    ("get", "/v1/vector_stores"),
    ("post", "/v1/chat/completions/extra"),
    ("get", "/v1"),
    ("delete", "/v1/"),
])
def test_unknown_path_under_v1_gets_json_404(client, method, path):
    response = getattr(client, method)(path)
    assert response.status_code == 404 and response["Content-Type"] == "application/json"
    error = error_of(response)
    assert error["code"] == "not_found" and path in error["message"]


# 5. Redis trouble and unexpected exceptions ----------------------------------------------------

@pytest.mark.parametrize("exc", [redis.exceptions.ConnectionError("Connection refused"),
                                 redis.exceptions.MaxConnectionsError("Too many connections")])
def test_redis_trouble_gets_503_with_retry_after(client, tenant_key, monkeypatch, caplog, exc):
    async def unavailable(*args, **kwargs):
        raise exc

    monkeypatch.setattr(admission, "alive_workers", unavailable)
    with caplog.at_level(logging.ERROR, logger="gateway.errors"):
        response = post(client, tenant_key[2], chat())
    assert response.status_code == 503 and response["Content-Type"] == "application/json"
    assert response["Retry-After"] == "1"
    error = error_of(response)
    assert error["code"] == "service_unavailable" and error["type"] == "service_unavailable"
    assert any(r.exc_info and r.exc_info[1] is exc for r in caplog.records)


def test_unexpected_exception_gets_json_500_and_is_logged(client, tenant_key, monkeypatch,
                                                          caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("secret internal detail")

    monkeypatch.setattr(lifecycle, "count_chat_tokens", broken)
    with caplog.at_level(logging.ERROR, logger="gateway.errors"):
        response = post(client, tenant_key[2], chat())
    assert response.status_code == 500 and response["Content-Type"] == "application/json"
    error = error_of(response)
    assert error["code"] == "internal_error" and error["type"] == "server_error"
    assert "secret" not in error["message"]
    assert any(r.exc_info and isinstance(r.exc_info[1], RuntimeError) for r in caplog.records)


def test_redis_trouble_mid_stream_ends_with_an_error_event(tenant_key, inproc_worker,
                                                           monkeypatch):
    real_batches = lifecycle.event_batches

    async def events_then_lost(*args, **kwargs):
        async for batch in real_batches(*args, **kwargs):
            tokens = [] if not isinstance(batch, list) else [
                i for i, event in enumerate(batch) if event.type == "token"]
            yield batch[:tokens[0] + 1] if tokens else batch
            if tokens:  # the connection fails after the first token reached the client
                raise redis.exceptions.ConnectionError("Connection reset by peer")

    monkeypatch.setattr(lifecycle, "event_batches", events_then_lost)
    response, content = post_stream(tenant_key[2], chat(max_tokens=8, stream=True))
    assert response.status_code == 200
    frames = read_sse(content)
    assert "[DONE]" not in frames
    assert json.loads(frames[-1])["error"]["code"] == "service_unavailable"


# 6. The concurrency limit is transient: Retry-After ------------------------------------------

def test_concurrency_limit_429_has_retry_after(client, make_tenant, live_worker):
    tenant, key, raw = make_tenant(max_concurrent_requests=1)
    in_flight = RequestMessage(request_id=uuid.uuid4().hex, tenant=tenant.slug,
                               fairness_key=tenant.slug, prompt="hi")
    asyncio.run(admission.admit(Principal.for_api_key(key), in_flight, 5))
    response = post(client, raw, chat())
    assert response.status_code == 429
    assert error_of(response)["code"] == "concurrency_limit_exceeded"
    assert response["Retry-After"] == "1"


@pytest.mark.parametrize("path", ["/v1/models", "/v1/chat/completions", "/healthz"])
def test_a_host_not_allowed_gets_a_json_400_on_the_api(client, path):
    client.raise_request_exception = False
    response = client.get(path, HTTP_HOST="evil.example")
    assert response.status_code == 400 and response["Content-Type"] == "application/json"
    assert error_of(response)["code"] == "bad_request"


# 7. A worker that dies under an answer not streamed ---------------------------------------------

def test_an_answer_not_streamed_whose_worker_died_says_its_client_got_nothing(
        client, tenant_key, live_worker, rclient, keys):
    """The worker died after 5 tokens, and the reclaim ended the request: the client of an answer
    not streamed got none of them (it goes out only whole), and its error says so, with the
    retry hints in its body as in its headers."""
    import threading
    import time

    from inference.protocol.events import TokenEvent
    from inference.worker.fair_queue import FairQueue

    dead, judge = FairQueue(rclient, keys, "dead", "vtc"), FairQueue(rclient, keys, "judge", "vtc")
    rclient.zadd(keys.workers, {"dead": time.time()})

    def worker_dies() -> None:
        deadline = time.monotonic() + 20
        while not (taken := dead.take(1)) and time.monotonic() < deadline:
            time.sleep(0.02)
        [request] = taken
        tokens = [(TokenEvent(request_id=request.request_id, seq=i, token_id=97, text="a"),
                   request.take) for i in range(5)]
        dead.write_events(tokens, 60, {request.request_id: 9})
        rclient.zadd(keys.workers, {"dead": time.time() - 60})  # its heartbeat lapsed
        judge.reclaim(ttl_s=10, events_ttl_s=60, sight_s=3600.0)

    thread = threading.Thread(target=worker_dies, daemon=True)
    thread.start()
    response = post(client, tenant_key[2], chat(max_tokens=50))
    thread.join(5)
    assert response.status_code == 503 and response["Retry-After"] == "1"
    error = error_of(response)
    assert error["code"] == "worker_lost" and error["details"]["completion_tokens"] == 0
    assert not any(ch.isdigit() for ch in error["message"])  # no count of the engine's
    assert error["retryable"] is True and error["retry_after_ms"] == 1000
