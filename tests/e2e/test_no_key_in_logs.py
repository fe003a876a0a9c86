"""No log line carries an API key: the real processes (daphne, a worker, Celery and beat) serve a
request with a key, streamed and not, a wrong key, a key where no key belongs (the URL), the
admin making a key and the chat; then their logs are read for any key (the visible prefix the
admin lists is not one)."""

from __future__ import annotations

import http.client
import re

import httpx
import openai
import pytest

from tenants.models import UsageRecord
from tenants.services import VISIBLE_PREFIX_LEN, generate_raw_key
from tests.support.e2e import MODEL, client, start_stack, wait_for
from tests.support.web import PASSWORD

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# Anything shaped like a key, past the visible prefix ("sk-" and 7 characters).
KEY_SHAPED = re.compile(rf"sk-[A-Za-z0-9_-]{{{VISIBLE_PREFIX_LEN - 3 + 1},}}")


@pytest.fixture(scope="module")
def stack(request, django_db_setup, django_db_blocker, tmp_path_factory):
    stack = start_stack(request, django_db_blocker, tmp_path_factory, workers=1)
    stack.start_beat()  # as the run command starts it
    return stack


def get_quietly(stack, path: str) -> int:
    """The status of ``GET path``, sent without the client logging its URL (as httpx does)."""
    connection = http.client.HTTPConnection("127.0.0.1", stack.port, timeout=10)
    try:
        connection.request("GET", path)
        return connection.getresponse().status
    finally:
        connection.close()


def admin_session(stack, username: str) -> httpx.Client:
    """A browser-like client signed in to the admin of ``stack``."""
    session = httpx.Client(base_url=stack.url, timeout=30, follow_redirects=True)
    page = session.get("/admin/login/")
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text)[1]
    signed_in = session.post("/admin/login/?next=/admin/", data={
        "csrfmiddlewaretoken": token, "username": username, "password": PASSWORD,
        "next": "/admin/"})
    assert signed_in.status_code == 200 and "/admin/login/" not in str(signed_in.url)
    return session


def add_key_in_the_admin(session: httpx.Client, tenant) -> str:
    page = session.get("/admin/tenants/apikey/add/")
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text)[1]
    made = session.post("/admin/tenants/apikey/add/", data={
        "csrfmiddlewaretoken": token, "tenant": tenant.pk, "name": "from-the-admin",
        "requests_per_minute": 0, "tokens_per_minute": 0})
    assert made.status_code == 200, made.text[-2000:]
    raw = re.search(r'<code id="new-api-key">(sk-[\w-]+)</code>', made.text)[1]
    assert "no-store" in made.headers["cache-control"]
    for cookie in session.cookies.jar:
        assert raw[VISIBLE_PREFIX_LEN:] not in cookie.value
    return raw


def test_no_log_line_carries_a_key(stack, make_tenant, make_member, transactional_db):
    tenant, _, raw = make_tenant()
    api = client(stack, raw)
    reply = api.chat.completions.create(model=MODEL, max_tokens=8,
                                        messages=[{"role": "user", "content": "Hi"}])
    assert reply.choices[0].message.content
    streamed = api.chat.completions.create(model=MODEL, max_tokens=8, stream=True,
                                           messages=[{"role": "user", "content": "Hi"}])
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    wrong = generate_raw_key()
    with pytest.raises(openai.AuthenticationError):
        client(stack, wrong).models.list()
    # A key put where none belongs (the platform reads keys from the Authorization header only):
    # a URL's query and its path, which the access log and Django's warnings write.
    assert get_quietly(stack, f"/v1/models?api_key={raw}") == 401
    assert get_quietly(stack, f"/v1/{raw}/models") == 404
    make_member(username="ops", is_staff=True, is_superuser=True)
    session = admin_session(stack, "ops")
    made = add_key_in_the_admin(session, tenant)
    assert client(stack, made).models.list().data
    session.get("/admin/tenants/apikey/")  # the list, with its visible prefixes
    assert session.get("/chat/").status_code == 200
    # Usage was recorded: the Celery worker ran its tasks.
    assert wait_for(lambda: UsageRecord.objects.filter(tenant=tenant).count() >= 2, 20)

    logs = {path.name: path.read_text(errors="replace")
            for path in sorted(stack.log_dir.glob("*.log"))}
    assert {"daphne.log", "celery.log", "beat.log", "worker0.log"} <= set(logs), logs.keys()
    assert "GET /v1/models" in logs["daphne.log"]  # the access log is there to be read
    for name, text in logs.items():
        for key in (raw, made, wrong):
            assert key[VISIBLE_PREFIX_LEN:] not in text, (name, key[:VISIBLE_PREFIX_LEN])
        assert not KEY_SHAPED.search(text), (name, KEY_SHAPED.findall(text)[:3])
