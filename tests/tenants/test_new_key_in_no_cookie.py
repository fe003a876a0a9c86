"""A key made in the admin is shown on the page that answers the form, and nowhere else a
client or the server keeps: no cookie holds it (signed cookies are readable: base64, often
zlib-compressed, then a signature), nor the session the database stores."""

from __future__ import annotations

import base64
import binascii
import re
import zlib

import pytest
from django.contrib.sessions.models import Session
from django.urls import reverse

pytestmark = pytest.mark.django_db

NEW_KEY = re.compile(r'<code id="new-api-key">(sk-[\w-]+)</code>')


def readable(value: str) -> str:
    """What a client reads in a cookie's value without any secret: the value itself and, for a
    value signed by Django (``payload:signature``, the payload URL-safe base64, zlib-compressed
    when it starts with a dot), the payload decoded."""
    texts = [value]
    for cut in range(value.count(":") + 1):
        payload = value.rsplit(":", cut)[0] if cut else value
        compressed = payload.startswith(".")
        try:
            data = base64.urlsafe_b64decode(payload.lstrip(".") + "=" * (-len(payload) % 4))
            texts.append((zlib.decompress(data) if compressed else data).decode("utf-8",
                                                                                 "replace"))
        except (binascii.Error, ValueError, zlib.error):
            pass
    return "\n".join(texts)


def cookies_read_by_a_client(client, *responses) -> str:
    values = [morsel.value for response in responses for morsel in response.cookies.values()]
    values += [morsel.value for morsel in client.cookies.values()]
    return "\n".join(readable(v) for v in values)


def add_key(client, tenant, name="ci", **extra):
    return client.post(reverse("admin:tenants_apikey_add"), {
        "tenant": tenant.pk, "name": name, "requests_per_minute": 0, "tokens_per_minute": 0,
        **extra})


@pytest.mark.parametrize("button", [{}, {"_continue": "1"}, {"_addanother": "1"}])
def test_a_new_key_is_shown_on_its_page_and_held_by_no_cookie_or_session(admin_client,
                                                                         tenant_key, button):
    tenant, _, _ = tenant_key
    made = add_key(admin_client, tenant, **button)
    assert made.status_code == 200
    raw = NEW_KEY.search(made.content.decode())[1]
    assert "no-store" in made["Cache-Control"]  # a browser keeps no copy of the page
    # The pages a user goes on to.
    after = [admin_client.get(reverse("admin:tenants_apikey_changelist")),
             admin_client.get(reverse("admin:index"))]
    secret = raw[len("sk-"):]
    read = cookies_read_by_a_client(admin_client, made, *after)
    assert secret not in read
    for page in after:
        assert secret not in page.content.decode()
    for session in Session.objects.all():
        assert secret not in str(session.get_decoded())
        assert secret not in session.session_data


def test_a_client_reads_the_messages_cookie_so_nothing_secret_may_go_there(admin_client,
                                                                           tenant_key):
    """The reading above works: the admin's own message after an action is read from the
    cookie without the server's key."""
    _, key, _ = tenant_key
    response = admin_client.post(reverse("admin:tenants_apikey_changelist"),
                                 {"action": "revoke", "_selected_action": [key.pk]})
    assert "Revoked 1 key(s)." in cookies_read_by_a_client(admin_client, response)
