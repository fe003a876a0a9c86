"""A database that cannot serve: the REST API, ``/scheduler/stats``, ``/metrics`` and ``/readyz``
answer a retryable 503 naming it, a best-effort write never fails a request, a stream already
started finishes, and its usage is recorded exactly once when the database is back.

The database really fails (``tests.support.database``: its file cannot be opened, or it refuses
writes); the REST API is driven by the ``openai`` client, in-process over ASGI.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time

import httpx
import openai
import pytest
from asgiref.sync import async_to_sync, sync_to_async
from django.core.handlers.asgi import ASGIHandler
from django.db import OperationalError
from django.db.backends.postgresql.base import DatabaseWrapper as PostgresWrapper
from django.db.backends.sqlite3.base import DatabaseWrapper

from benchmarks.harness.stack import free_port
from gateway import tasks, usage
from gateway.errors import unexpected_error
from tenants.best_effort import OccasionalLog
from tenants.models import ApiKey, UsageRecord
from tenants.selectors import LAST_USED_WRITE
from tests.api.test_api import MODEL
from tests.support import database

pytestmark = pytest.mark.django_db(transaction=True)
database_fault = database.database_fault  # the fixture

MESSAGES = [{"role": "user", "content": "Hello"}]


def openai_client(http: httpx.AsyncClient, raw_key: str) -> openai.AsyncOpenAI:
    # max_retries=0: the client retries a 503 by itself; the test looks at the first answer.
    return openai.AsyncOpenAI(base_url="http://testserver/v1", api_key=raw_key, http_client=http,
                              max_retries=0)


def in_process(raw_key: str, calls):
    """``calls(client)`` with an ``openai.AsyncOpenAI`` client served by this process's ASGI
    application; its database calls run in this thread (as the faults' do). (Django's handler
    itself: ``get_asgi_application`` would set logging up again, past the test's capture.)"""

    async def go():
        transport = httpx.ASGITransport(app=ASGIHandler())
        async with httpx.AsyncClient(transport=transport, timeout=30) as http:
            return await calls(openai_client(http, raw_key))

    return async_to_sync(go)()


def assert_database_outage(exc: openai.APIStatusError) -> None:
    """What a client gets from a database outage: a retryable 503 that names the database."""
    assert exc.status_code == 503
    assert exc.response.headers["Retry-After"] == "1"
    assert exc.response.headers["retry-after-ms"] == "1000"
    assert "x-should-retry" not in exc.response.headers
    assert exc.code == "service_unavailable"
    assert exc.body["type"] == "service_unavailable"
    assert exc.body["details"] == {"dependency": "database"}
    assert "database" in exc.message
    assert "Traceback" not in exc.response.text and "sqlite" not in exc.response.text.lower()


CALLS = {
    "models.list": lambda c: c.models.list(),
    "models.retrieve": lambda c: c.models.retrieve(MODEL),
    "chat.completions": lambda c: c.chat.completions.create(model=MODEL, messages=MESSAGES,
                                                            max_tokens=3),
    "chat.completions stream": lambda c: c.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=3, stream=True),
    "completions": lambda c: c.completions.create(model=MODEL, prompt="Once", max_tokens=3),
    "completions stream": lambda c: c.completions.create(model=MODEL, prompt="Once",
                                                         max_tokens=3, stream=True),
}


@pytest.mark.parametrize("call", list(CALLS))
def test_every_endpoint_answers_a_retryable_503_while_the_database_is_down(
        tenant_key, live_worker, database_fault, call):
    database_fault.down()

    async def calls(client):
        with pytest.raises(openai.APIStatusError) as raised:
            await CALLS[call](client)
        return raised.value

    assert_database_outage(in_process(tenant_key[2], calls))


def test_the_client_retries_by_itself_and_gets_through_once_the_database_is_back(
        tenant_key, database_fault):
    # The openai client retries a 503 after its Retry-After; the database is back meanwhile.
    database_fault.down()

    async def calls(client):
        with pytest.raises(openai.APIStatusError) as raised:
            await client.models.list()
        assert_database_outage(raised.value)

        async def back_soon():
            await asyncio.sleep(0.3)
            await sync_to_async(database_fault.restore)()

        back = asyncio.ensure_future(back_soon())
        started = time.monotonic()
        models = await client.with_options(max_retries=2).models.list()
        await back
        return models, time.monotonic() - started

    models, waited = in_process(tenant_key[2], calls)
    assert [m.id for m in models.data] == [MODEL]
    assert waited >= 0.9  # it waited the Retry-After (1 s) before trying again


def test_scheduler_stats_and_metrics_answer_503_json(client, make_tenant, admin_client, settings,
                                                     database_fault):
    operator = make_tenant(operator_key=True)[2]
    settings.DASHBOARD = {**settings.DASHBOARD, "METRICS_TOKEN": "scrape-me"}
    database_fault.down()
    answers = [
        client.get("/scheduler/stats", HTTP_AUTHORIZATION=f"Bearer {operator}"),
        admin_client.get("/scheduler/stats"),  # the staff session cannot be read either
        client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {operator}"),
        admin_client.get("/metrics"),
    ]
    for response in answers:
        assert response.status_code == 503, response.content
        assert response["Content-Type"] == "application/json"
        assert response["Retry-After"] == "1"
        error = response.json()["error"]
        assert error["code"] == "service_unavailable" and "database" in error["message"]
    # A scrape with the metrics token needs no database: the metrics stay readable.
    scrape = client.get("/metrics", HTTP_AUTHORIZATION="Bearer scrape-me")
    assert scrape.status_code == 200 and b"llm_workers_alive" in scrape.content


def test_readyz_says_the_database_is_down(client, live_worker, database_fault):
    assert client.get("/readyz").status_code == 200
    database_fault.down()
    ready = client.get("/readyz")
    assert ready.status_code == 503 and ready["Retry-After"] == "1"
    body = ready.json()
    assert body["status"] == "unavailable"
    assert body["checks"]["database"].startswith("error: ")
    assert body["checks"]["redis"] == "ok" and body["checks"]["workers"] == 1
    assert client.get("/healthz").status_code == 200  # the process itself is up
    database_fault.restore()
    assert client.get("/readyz").status_code == 200


def test_a_database_that_refuses_writes_fails_no_request_for_last_used_at(
        tenant_key, inproc_worker, database_fault, caplog, monkeypatch):
    # The key's last_used_at is written on authentication; a read-only database refuses it.
    _, key, raw = tenant_key
    refusals = LAST_USED_WRITE.refusals
    monkeypatch.setattr(LAST_USED_WRITE, "refusals", OccasionalLog(refusals.logger))
    database_fault.read_only()

    async def calls(client):
        models = [await client.models.list() for _ in range(3)]
        reply = await client.chat.completions.create(model=MODEL, messages=MESSAGES,
                                                     max_tokens=3)
        return models, reply

    with caplog.at_level(logging.WARNING, logger="tenants.best_effort"):
        models, reply = in_process(raw, calls)
    assert all(m.data[0].id == MODEL for m in models)
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 3
    skipped = [r for r in caplog.records if "last_used_at" in r.getMessage()]
    assert len(skipped) == 1  # four writes refused, one line
    database_fault.restore()
    key.refresh_from_db()
    assert key.last_used_at is None
    in_process(raw, lambda client: client.models.list())
    key.refresh_from_db()
    assert key.last_used_at is not None  # written again once the database takes it


def test_a_stream_started_before_the_outage_finishes_and_is_billed_once_after(
        tenant_key, inproc_worker, database_fault, rclient, keys):
    async def calls(client):
        stream = await client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=24, stream=True,
            stream_options={"include_usage": True})
        chunks = []
        async for chunk in stream:
            if not chunks:  # the stream has started: the database goes away
                await sync_to_async(database_fault.down)()
            chunks.append(chunk)
        return chunks

    chunks = in_process(tenant_key[2], calls)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 24  # the whole answer was streamed
    request_id = chunks[0].id.removeprefix("chatcmpl-")
    deadline = time.monotonic() + 5
    while not rclient.hexists(keys.usage_pending, request_id) and time.monotonic() < deadline:
        time.sleep(0.01)
    # While the database is down, the usage task fails and the ledger keeps the entry.
    for record in (tasks.record_usage, usage.record):
        with pytest.raises(OperationalError):
            record(request_id)
    with pytest.raises(OperationalError):
        usage.reconcile(older_than_s=0)
    assert rclient.hexists(keys.usage_pending, request_id)
    database_fault.restore()
    # Back: the reconciliation records it, once; the task delivered again changes nothing.
    assert usage.reconcile(older_than_s=0) == 1
    assert tasks.record_usage(request_id) is False
    assert usage.reconcile(older_than_s=0) == 0
    records = UsageRecord.objects.filter(request_id=request_id)
    assert records.count() == 1
    assert records.get().completion_tokens == 24 and records.get().status == 200
    assert not rclient.hexists(keys.usage_pending, request_id)
    assert ApiKey.objects.get(pk=tenant_key[1].pk).usage_records.count() == 1


# What counts as an outage: the real errors of a SQLite database -----------------------------

def sqlite(path, **options) -> DatabaseWrapper:
    """A Django connection of its own to the SQLite file ``path``."""
    return DatabaseWrapper({
        "ENGINE": "django.db.backends.sqlite3", "NAME": str(path), "OPTIONS": options,
        "TIME_ZONE": None, "CONN_MAX_AGE": 0, "CONN_HEALTH_CHECKS": False, "AUTOCOMMIT": True,
        "ATOMIC_REQUESTS": False, "USER": "", "PASSWORD": "", "HOST": "", "PORT": "",
        "TEST": {}}, alias="outage-test")


def raised(action) -> Exception:
    try:
        action()
    except Exception as exc:  # noqa: BLE001 - the error under test
        return exc
    raise AssertionError("no error")


def test_database_errors_a_retry_can_get_past_are_503_the_others_500(tmp_path):
    db = sqlite(tmp_path / "db.sqlite3")
    cursor = db.cursor()
    cursor.execute("CREATE TABLE t (x TEXT UNIQUE)")
    cursor.execute("PRAGMA page_count")
    cursor.execute(f"PRAGMA max_page_count = {cursor.fetchone()[0] + 1}")

    def fill():
        for i in range(1000):
            cursor.execute("INSERT INTO t VALUES (%s)", [f"{i:04d}" + "x" * 2000])

    full = raised(fill)
    cursor.execute("PRAGMA max_page_count = 1000000")
    cursor.execute("PRAGMA query_only = ON")
    read_only = raised(lambda: cursor.execute("INSERT INTO t VALUES ('a')"))
    cursor.execute("PRAGMA query_only = OFF")
    cursor.execute("BEGIN EXCLUSIVE")
    locked = raised(lambda: sqlite(tmp_path / "db.sqlite3", timeout=0.05).cursor().execute(
        "SELECT * FROM t"))
    cursor.execute("ROLLBACK")
    unreachable = raised(lambda: sqlite(tmp_path / "gone" / "db.sqlite3").cursor())
    assert str(full) == "database or disk is full"
    assert str(read_only) == "attempt to write a readonly database"
    assert str(locked) == "database is locked"
    assert str(unreachable) == "unable to open database file"
    for outage in (full, read_only, locked, unreachable):
        assert isinstance(outage.__cause__, sqlite3.Error)
        error = unexpected_error(outage)
        assert (error.status, error.code, error.retry_after_s) == (503, "service_unavailable", 1)
    cursor.execute("INSERT INTO t VALUES ('same')")
    duplicate = raised(lambda: cursor.execute("INSERT INTO t VALUES ('same')"))
    no_column = raised(lambda: cursor.execute("SELECT nope FROM t"))
    for bug in (duplicate, no_column):  # a retry would fail the same way
        error = unexpected_error(bug)
        assert (error.status, error.code) == (500, "internal_error")
    db.close()


def postgres(port: int, **options) -> PostgresWrapper:
    """A Django connection of its own to the PostgreSQL on ``port`` (database ``postgres``)."""
    return PostgresWrapper({
        "ENGINE": "django.db.backends.postgresql", "NAME": "postgres", "USER": "postgres",
        "PASSWORD": "", "HOST": "127.0.0.1", "PORT": str(port),
        "OPTIONS": {"connect_timeout": 2, **options}, "TIME_ZONE": None, "CONN_MAX_AGE": 0,
        "CONN_HEALTH_CHECKS": False, "AUTOCOMMIT": True, "ATOMIC_REQUESTS": False,
        "TEST": {}}, alias="outage-test")


def test_postgresql_errors_a_retry_can_get_past_are_503_the_others_500():
    refused = raised(lambda: postgres(free_port()).cursor())  # nothing listens there
    assert "Connection refused" in str(refused)
    standby = postgres(5432, options="-c default_transaction_read_only=on")
    try:
        cursor = standby.cursor()
    except OperationalError:
        pytest.skip("no PostgreSQL at 127.0.0.1:5432")
    # A read-only database (a standby, or one set read-only) refuses the write.
    read_only = raised(lambda: cursor.execute("CREATE TABLE outage_probe (x int)"))
    assert read_only.__cause__.sqlstate == "25006"
    missing = raised(lambda: cursor.execute("SELECT nope FROM pg_class"))
    standby.close()
    for outage in (refused, read_only):
        error = unexpected_error(outage)
        assert (error.status, error.code, error.retry_after_s) == (503, "service_unavailable", 1)
    assert unexpected_error(missing).status == 500
