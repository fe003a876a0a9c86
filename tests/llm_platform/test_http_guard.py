"""The web process's HTTP layer (``llm_platform/http_guard.py``) in pieces: request targets, the
body limits of each path, and the answers it writes itself. The real process:
``test_http_guard_process.py``."""

from __future__ import annotations

import json

import pytest
from django.core.exceptions import ImproperlyConfigured

from gateway.errors import request_too_large
from llm_platform.http_guard import (
    BodyLimits,
    Target,
    parse_target,
    raw_response,
    server_error,
)
from tests.support.web_process import parse_response


@pytest.mark.parametrize("raw, target", [
    (b"/v1/models", Target(b"/v1/models")),
    (b"/v1/models?x=1", Target(b"/v1/models?x=1")),
    (b"http://127.0.0.1:8000/v1/models", Target(b"/v1/models", b"127.0.0.1:8000")),
    (b"HTTPS://example.com/v1/models?a=b", Target(b"/v1/models?a=b", b"example.com")),
    (b"http://example.com", Target(b"/", b"example.com")),
    (b"http://example.com?q", Target(b"/?q", b"example.com")),
])
def test_origin_and_absolute_form_targets_are_served_as_their_path(raw, target):
    assert parse_target(raw) == target


@pytest.mark.parametrize("raw", [b"*", b"127.0.0.1:443", b"v1/models", b"http:///v1/models",
                                 b"http://user@host/v1/models", b"ftp://host/v1/models",
                                 b"/v1/\x80", b"/v1/models?\xff"])
def test_other_targets_are_refused_with_a_reason(raw):
    with pytest.raises(ValueError, match="request target"):
        parse_target(raw)


def test_a_target_route_is_its_decoded_path_without_the_query():
    assert Target(b"/v1/%66iles/a%20b?x=%2F").route == "/v1/files/a b"


def test_a_path_prefix_covers_the_paths_below_it_the_longest_winning():
    limits = BodyLimits(100, (("/v1/files/big", 5000), ("/v1/files", 1000)))
    assert limits.for_path("/v1/files") == 1000
    assert limits.for_path("/v1/files/abc") == 1000
    assert limits.for_path("/v1/files/big/x") == 5000
    assert limits.for_path("/v1/filesystem") == 100  # not below /v1/files
    assert limits.for_path("/v1/chat/completions") == 100


def test_only_a_body_over_the_default_on_a_larger_path_waits_for_the_key():
    limits = BodyLimits(100, (("/v1/files", 1000), ("/v1/small", 10)))
    assert limits.needs_key("/v1/files", 101) and limits.needs_key("/v1/files", None)
    assert not limits.needs_key("/v1/files", 100)
    assert not limits.needs_key("/v1/chat/completions", None)  # the default: no key first
    assert not limits.needs_key("/v1/small", None)


def test_the_settings_give_the_limits_and_are_checked(settings):
    settings.LLM_PLATFORM = {**settings.LLM_PLATFORM, "MAX_BODY_BYTES": 10,
                             "MAX_BODY_BYTES_BY_PATH": {"/v1/files/": 20, "/v1/files/x": 30}}
    limits = BodyLimits.from_settings()
    assert limits == BodyLimits(10, (("/v1/files/x", 30), ("/v1/files", 20)))
    for wrong in ({"v1/files": 20}, {"/v1/files": -1}):
        settings.LLM_PLATFORM = {**settings.LLM_PLATFORM, "MAX_BODY_BYTES_BY_PATH": wrong}
        with pytest.raises(ImproperlyConfigured, match="MAX_BODY_BYTES_BY_PATH"):
            BodyLimits.from_settings()


def test_the_default_limit_is_djangos_upload_limit_too(settings):
    assert settings.LLM_PLATFORM["MAX_BODY_BYTES"] == settings.DATA_UPLOAD_MAX_MEMORY_SIZE


def test_a_refusal_is_a_whole_response_in_the_platforms_error_shape():
    response = parse_response(raw_response(request_too_large(2048)))
    assert response.status == 413 and response.headers["connection"] == "close"
    assert response.headers["x-should-retry"] == "false"
    assert int(response.headers["content-length"]) == len(response.body)
    error = response.json_error()
    assert error["code"] == "request_too_large" and "2048 bytes" in error["message"]
    assert error["details"] == {"limit_bytes": 2048}
    head = parse_response(raw_response(request_too_large(2048), head=True))
    assert head.body == b"" and head.headers["content-length"] == response.headers[
        "content-length"]


@pytest.mark.parametrize("status, detail, code", [
    (400, "Invalid header name", "bad_request"),
    (500, "Exception inside application.", "internal_error"),
    (503, "Application failed to respond within time limit.", "service_unavailable"),
])
def test_daphnes_own_errors_become_the_platforms(status, detail, code):
    error = server_error(status, detail)
    assert error.status == status and error.code == code
    body = json.dumps(error.body())
    assert "Daphne" not in body and "Exception" not in body
