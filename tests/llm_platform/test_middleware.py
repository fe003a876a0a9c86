"""The middlewares as daphne runs them (an async request, Django's ASGI handler: ``AsyncClient``):
pages keep sessions, CSRF, the logged-in user and every security header; the REST API keeps its
security headers and never reads or sets a session or a CSRF cookie (``llm_platform.middleware``).
"""

from __future__ import annotations

import pytest
from asgiref.sync import async_to_sync
from django.test import AsyncClient, Client
from django.urls import reverse

from llm_platform.middleware import is_rest_api
from tests.support.web import PASSWORD

pytestmark = pytest.mark.django_db

MODELS = "/v1/models"


def run(coro):
    async def go():
        return await coro

    return async_to_sync(go)()


def assert_security_headers(response) -> None:
    assert response.headers["X-Content-Type-Options"] == "nosniff"
    assert response.headers["Referrer-Policy"] == "same-origin"
    assert response.headers["Cross-Origin-Opener-Policy"] == "same-origin"


def test_pages_keep_csrf_sessions_and_the_user_on_the_async_handler(make_member):
    user = make_member()
    client = AsyncClient(enforce_csrf_checks=True)
    login = reverse("chat:login")
    page = run(client.get(login))
    assert page.status_code == 200
    assert_security_headers(page)
    assert page.headers["X-Frame-Options"] == "DENY"
    assert "Content-Security-Policy" in page.headers
    token = page.cookies["csrftoken"].value
    # No CSRF token: refused, as a page's form must be.
    refused = run(client.post(login, {"username": user.username, "password": PASSWORD}))
    assert refused.status_code == 403
    signed_in = run(client.post(login, {"username": user.username, "password": PASSWORD,
                                         "csrfmiddlewaretoken": token}))
    assert signed_in.status_code == 302
    assert signed_in.cookies["sessionid"].value
    # The session is read back and the user is the member: the chat page is theirs.
    index = run(client.get(reverse("chat:index")))
    assert index.status_code == 200
    assert user.username.encode() in index.content


def test_the_rest_api_ignores_sessions_and_sets_no_cookie(make_member, make_tenant):
    user = make_member()
    client = AsyncClient(enforce_csrf_checks=True)
    client.force_login(user)
    # A browser's session is not a credential of the API: a key is.
    anonymous = run(client.get(MODELS))
    assert anonymous.status_code == 401
    assert anonymous.json()["error"]["code"] == "missing_api_key"
    assert not anonymous.cookies
    assert "Cookie" not in anonymous.headers.get("Vary", "")
    assert_security_headers(anonymous)
    _, _, raw_key = make_tenant()
    listed = run(client.get(MODELS, headers={"Authorization": f"Bearer {raw_key}"}))
    assert listed.status_code == 200 and listed.json()["object"] == "list"
    assert not listed.cookies
    assert_security_headers(listed)


def test_the_sync_handler_treats_the_api_the_same(make_member):
    client = Client(enforce_csrf_checks=True)
    client.force_login(make_member())
    response = client.get(MODELS)
    assert response.status_code == 401
    assert not response.cookies
    assert_security_headers(response)


@pytest.mark.parametrize(("path", "api"), [
    ("/v1", True), ("/v1/", True), ("/v1/chat/completions", True), ("/v1/models/a/b", True),
    ("/v10", False), ("/v1x/models", False), ("/chat/", False), ("/", False),
])
def test_which_paths_are_the_rest_apis(rf, path, api):
    assert is_rest_api(rf.get(path)) is api


def test_a_path_beside_the_api_is_a_page(client):
    page = run(AsyncClient().get("/v1x/models"))
    assert page.status_code == 404 and page.headers["Content-Type"].startswith("text/html")
    assert "Content-Security-Policy" in page.headers
    api = run(AsyncClient().get("/v1/no/such/thing"))
    assert api.status_code == 404 and api.json()["error"]["code"] == "not_found"


@pytest.mark.parametrize("path, host, status", [
    ("/admin", "127.0.0.1", 301),  # CommonMiddleware's APPEND_SLASH redirect
    ("/v1/models", "evil.example", 400),  # a Host not allowed, refused by CommonMiddleware
    ("/chat/login/", "evil.example", 400),
])
def test_the_answers_common_middleware_gives_itself_carry_every_security_header(
        settings, path, host, status):
    settings.ALLOWED_HOSTS = ["127.0.0.1"]
    response = Client(HTTP_HOST=host).get(path)
    assert response.status_code == status
    assert_security_headers(response)
    assert response.headers["X-Frame-Options"] == "DENY"
    assert "frame-ancestors 'none'" in response.headers["Content-Security-Policy"]
