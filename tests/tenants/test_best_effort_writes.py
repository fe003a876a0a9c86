"""Writes a request can do without never fail it: a database that refuses a user's
``last_login`` or an API key's ``last_used_at`` skips the write, and the refusals are logged once
in a while, not once per request."""

from __future__ import annotations

import logging

import pytest
from asgiref.sync import async_to_sync
from django.db import connection
from django.test import Client

from tenants import signals
from tenants.best_effort import OccasionalLog
from tenants.selectors import aauthenticate_key
from tests.support import database
from tests.support.web import PASSWORD

database_fault = database.database_fault  # the fixture


# A trigger that refuses every write of ``last_login``, and nothing else: the database's own
# refusal (SQLite's as a full disk makes it; PostgreSQL's "disk_full", SQLSTATE 53100).
REFUSE_LAST_LOGIN = {
    "sqlite": ["CREATE TRIGGER refuse_last_login BEFORE UPDATE OF last_login ON auth_user "
               "BEGIN SELECT RAISE(ABORT, 'database or disk is full'); END"],
    "postgresql": ["CREATE FUNCTION refuse_last_login() RETURNS trigger AS $$ BEGIN "
                   "RAISE EXCEPTION 'could not extend file: No space left on device' "
                   "USING ERRCODE = 'disk_full'; END $$ LANGUAGE plpgsql",
                   "CREATE TRIGGER refuse_last_login BEFORE UPDATE OF last_login ON auth_user "
                   "FOR EACH ROW EXECUTE FUNCTION refuse_last_login()"],
}
DROP_REFUSAL = {
    "sqlite": ["DROP TRIGGER refuse_last_login"],
    "postgresql": ["DROP TRIGGER refuse_last_login ON auth_user",
                   "DROP FUNCTION refuse_last_login()"],
}


@pytest.fixture
def last_login_refused(transactional_db, monkeypatch):
    """The database refuses every write of a user's ``last_login`` (:data:`REFUSE_LAST_LOGIN`),
    and nothing else."""
    monkeypatch.setattr(signals.LAST_LOGIN_WRITE, "refusals",
                        OccasionalLog(signals.LAST_LOGIN_WRITE.refusals.logger))
    with connection.cursor() as cursor:
        for statement in REFUSE_LAST_LOGIN[connection.vendor]:
            cursor.execute(statement)
    yield
    with connection.cursor() as cursor:
        for statement in DROP_REFUSAL[connection.vendor]:
            cursor.execute(statement)


@pytest.mark.parametrize(("login", "after"), [("/chat/login/", "/chat/"),
                                              ("/admin/login/?next=/admin/", "/admin/")])
def test_signing_in_works_when_last_login_cannot_be_written(make_member, last_login_refused,
                                                            caplog, login, after):
    user = make_member(is_staff=True)
    with caplog.at_level(logging.WARNING, logger="tenants.best_effort"):
        for _ in range(2):
            browser = Client(raise_request_exception=False)
            signed_in = browser.post(login, {"username": user.username, "password": PASSWORD})
            assert signed_in.status_code == 302, signed_in.content[:300]
            assert browser.get(after).status_code == 200  # the session signs the user in
    user.refresh_from_db()
    assert user.last_login is None
    assert len([r for r in caplog.records if "last_login" in r.getMessage()]) == 1


def test_a_key_authenticates_when_last_used_at_cannot_be_written(tenant_key, database_fault):
    _, key, raw = tenant_key
    database_fault.read_only()
    found = async_to_sync(aauthenticate_key)(raw)
    assert found is not None and found.pk == key.pk and found.last_used_at is None
    database_fault.restore()
    key.refresh_from_db()
    assert key.last_used_at is None


def test_an_occasional_log_says_how_many_lines_it_left_out(caplog):
    log = OccasionalLog(logging.getLogger("tests.occasional"), interval_s=3600)
    with caplog.at_level(logging.WARNING, logger="tests.occasional"):
        assert log.warning("refused: %s", "a") is True
        assert [log.warning("refused: %s", "b") for _ in range(4)] == [False] * 4
        log._last -= 3600  # an hour later
        assert log.warning("refused: %s", "c") is True
    assert [r.getMessage() for r in caplog.records] == [
        "refused: a", "refused: c (and 4 more since the last such line)"]
