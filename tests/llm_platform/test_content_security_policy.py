"""Every HTML page (the chat, the admin, the dashboard) is sent with a Content-Security-Policy that
would block what untrusted text could do if it got past the chat's sanitizer: load a remote
image, style the page, post a form elsewhere, connect elsewhere, frame the page; and the pages
themselves need nothing it forbids (no inline script, style element, style attribute or
handler)."""

from __future__ import annotations

from html.parser import HTMLParser

import pytest
from django.contrib import admin
from django.urls import reverse

from chat.models import Conversation, Message
from tests.support.web import PASSWORD

pytestmark = pytest.mark.django_db

DATA_SCRIPTS = {"application/json", "application/ld+json"}


def policy(response) -> dict[str, list[str]]:
    header = response.headers.get("Content-Security-Policy")
    assert header, f"no Content-Security-Policy on {response.request['PATH_INFO']}"
    directives: dict[str, list[str]] = {}
    for part in header.split(";"):
        name, *values = part.split()
        directives[name.lower()] = values
    return directives


def assert_blocks_untrusted_content(response) -> None:
    csp = policy(response)
    for fetch in ("img-src", "style-src", "script-src", "connect-src", "font-src"):
        allowed = csp.get(fetch, csp.get("default-src"))
        assert allowed == ["'self'"], (fetch, allowed)
    assert csp["form-action"] == ["'self'"]
    assert csp["frame-ancestors"] == ["'none'"]
    assert csp["object-src"] == ["'none'"] and csp["base-uri"] == ["'none'"]
    assert "'unsafe-inline'" not in str(csp) and "'unsafe-eval'" not in str(csp)


class InlineFinder(HTMLParser):
    """Collects what a policy without 'unsafe-inline' would block in a page."""

    def __init__(self):
        super().__init__()
        self.found: list[str] = []

    def handle_starttag(self, tag, attrs):
        attributes = dict(attrs)
        if tag == "script" and "src" not in attributes and \
                (attributes.get("type") or "") not in DATA_SCRIPTS:
            self.found.append(f"inline <script> {attributes}")
        if tag == "style":
            self.found.append("<style> element")
        for name, value in attrs:
            if name == "style":
                self.found.append(f"style attribute on <{tag}>: {value}")
            if name.startswith("on"):
                self.found.append(f"{name} handler on <{tag}>: {value}")
            if name in ("href", "src", "action") and (value or "").strip().lower().startswith(
                    "javascript:"):
                self.found.append(f"javascript: URL on <{tag}>")


def inline_parts(response) -> list[str]:
    finder = InlineFinder()
    finder.feed(response.content.decode())
    return finder.found


def check_page(response) -> None:
    assert response.status_code == 200, response.request["PATH_INFO"]
    assert_blocks_untrusted_content(response)
    assert inline_parts(response) == [], response.request["PATH_INFO"]


def test_the_chat_pages(client, make_member):
    check_page(client.get(reverse("chat:login")))
    user = make_member()
    assert client.post(reverse("chat:login"), {"username": user.username,
                                               "password": PASSWORD}).status_code == 302
    check_page(client.get(reverse("chat:index")))
    conversation = Conversation.objects.create(user=user, tenant=user.membership.tenant,
                                               title="t")
    Message.objects.create(conversation=conversation, role="assistant",
                           content='<img src="http://evil.example/x.png" style="color:red">')
    check_page(client.get(reverse("chat:conversation", args=[conversation.pk])))


def test_the_no_tenant_page(client, django_user_model):
    client.force_login(django_user_model.objects.create_user("loner", password=PASSWORD))
    response = client.get(reverse("chat:index"))
    assert response.status_code == 403
    assert_blocks_untrusted_content(response)
    assert inline_parts(response) == []


def test_the_dashboard(admin_client):
    check_page(admin_client.get(reverse("scheduler-dashboard")))
    assert_blocks_untrusted_content(admin_client.get(reverse("scheduler-dashboard-data")))


def test_the_admin_login_and_index(client, admin_client):
    check_page(client.get(reverse("admin:login")))
    check_page(admin_client.get(reverse("admin:index")))


def test_every_admin_list_and_form(admin_client, admin_user, rf, make_member):
    make_member()  # a tenant, a key, a user and a membership to show
    request = rf.get("/admin/")
    request.user = admin_user
    for model, model_admin in admin.site._registry.items():
        prefix = f"admin:{model._meta.app_label}_{model._meta.model_name}"
        check_page(admin_client.get(reverse(f"{prefix}_changelist")))
        obj = model._default_manager.first()
        if obj is not None:
            check_page(admin_client.get(reverse(f"{prefix}_change", args=[obj.pk])))
        if model_admin.has_add_permission(request):
            check_page(admin_client.get(reverse(f"{prefix}_add")))


def test_an_error_page(client):
    response = client.get("/no/such/page/")
    assert response.status_code == 404
    assert_blocks_untrusted_content(response)
