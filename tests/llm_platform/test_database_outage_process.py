"""A web process (``python -m llm_platform.serve``, as the run command starts it) whose database
cannot be reached: every surface answers a retryable 503 naming the database, and a database
host that never answers costs a request ``DATABASE_CONNECT_TIMEOUT_S``, not minutes.

The databases are real and really down: PostgreSQL on a port nothing listens on, or one that
accepts connections and never answers, and a SQLite file in a folder that does not exist.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
import websocket

from benchmarks.harness.stack import REPO, free_port
from tests.support.web_process import WebProcess

pytestmark = pytest.mark.process

MODEL = "SmolLM2-135M-Instruct"
# A session key of the shape the session store issues: reading it needs the database.
SESSION_COOKIE = "sessionid=" + "a1" * 16


def closed_port() -> int:
    return free_port()  # bound and released: nothing listens on it


@pytest.fixture(scope="module", params=["postgresql", "sqlite"])
def web(request, tmp_path_factory) -> Iterator[WebProcess]:
    folder = tmp_path_factory.mktemp("web")
    url = (f"postgres://postgres@127.0.0.1:{closed_port()}/llm" if request.param == "postgresql"
           else f"sqlite:///{folder}/gone/db.sqlite3")
    process = WebProcess(url, folder / "daphne.log").wait_up()
    yield process
    process.stop()


def assert_database_outage(exc: openai.APIStatusError) -> None:
    assert exc.status_code == 503
    assert exc.response.headers["Retry-After"] == "1"
    assert exc.code == "service_unavailable" and "database" in exc.message
    assert exc.body["details"] == {"dependency": "database"}


def test_the_rest_api_answers_the_openai_client_a_retryable_503(web):
    client = openai.OpenAI(base_url=f"{web.url}/v1", api_key="sk-" + "x" * 43, max_retries=0,
                           timeout=30)
    for call in (lambda: client.models.list(),
                 lambda: client.models.retrieve(MODEL),
                 lambda: client.chat.completions.create(
                     model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3),
                 lambda: client.completions.create(model=MODEL, prompt="Hi", max_tokens=3,
                                                   stream=True)):
        with pytest.raises(openai.APIStatusError) as raised:
            call()
        assert_database_outage(raised.value)


def test_stats_metrics_and_readyz_say_the_database_is_down(web):
    auth = {"Authorization": "Bearer sk-" + "x" * 43}
    for path in ("/scheduler/stats", "/metrics"):
        reply = httpx.get(f"{web.url}{path}", headers=auth, timeout=30)
        assert reply.status_code == 503 and reply.headers["Retry-After"] == "1"
        assert reply.json()["error"]["code"] == "service_unavailable"
    ready = httpx.get(f"{web.url}/readyz", timeout=30)
    assert ready.status_code == 503 and ready.headers["Retry-After"] == "1"
    assert ready.json()["checks"]["database"].startswith("error: ")


def test_the_pages_answer_a_plain_503_page(web):
    html = {"Accept": "text/html,*/*;q=0.8"}
    with httpx.Client(base_url=web.url, headers=html, timeout=30) as browser:
        login = browser.get("/chat/login/")  # the form needs no database
        assert login.status_code == 200
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', login.text).group(1)
        pages = [
            browser.post("/chat/login/", data={"csrfmiddlewaretoken": token,
                                               "username": "someone", "password": "secret"}),
            browser.get("/chat/", headers={"Cookie": SESSION_COOKIE}),
            browser.get("/admin/", headers={"Cookie": SESSION_COOKIE}),
        ]
    for page in pages:
        assert page.status_code == 503 and page.headers["Retry-After"] == "1"
        assert page.headers["Content-Type"].startswith("text/html")
        assert "The database is unavailable" in page.text and "Traceback" not in page.text


def test_the_chat_socket_gets_an_error_frame_and_a_close_to_retry(web):
    ws = websocket.create_connection(f"ws://127.0.0.1:{web.port}/ws/chat/", timeout=30,
                                     origin=web.url, cookie=SESSION_COOKIE)
    try:
        frame = json.loads(ws.recv())
        assert frame["type"] == "error" and frame["closing"] is True
        assert frame["code"] == "service_unavailable" and frame["retryable"] is True
        # The raw frame: recv_data would answer the close itself, and that reply races the
        # server's end of the connection (a reset on a correct close).
        close = ws.recv_frame()
        assert close.opcode == websocket.ABNF.OPCODE_CLOSE
        assert int.from_bytes(close.data[:2], "big") == 4503
    finally:
        ws.close()


@pytest.fixture
def silent_database() -> Iterator[int]:
    """A port that accepts connections and never answers (a host that hangs)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join(5)
    for conn in held:
        conn.close()
    server.close()


def test_a_database_that_never_answers_costs_a_request_the_connect_timeout(silent_database,
                                                                          tmp_path):
    web = WebProcess(f"postgres://postgres@127.0.0.1:{silent_database}/llm",
                     tmp_path / "daphne.log", DATABASE_CONNECT_TIMEOUT_S="2").wait_up()
    try:
        client = openai.OpenAI(base_url=f"{web.url}/v1", api_key="sk-" + "x" * 43,
                               max_retries=0, timeout=60)
        started = time.monotonic()
        with pytest.raises(openai.APIStatusError) as raised:
            client.models.list()
        waited = time.monotonic() - started
    finally:
        web.stop()
    assert_database_outage(raised.value)
    assert 1.5 < waited < 10, waited


def manage(database_url: str, *args: str) -> str:
    done = subprocess.run([sys.executable, "manage.py", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300,
                          env={**os.environ, "DATABASE_URL": database_url,
                               "DJANGO_SETTINGS_MODULE": "llm_platform.settings"})
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_a_sqlite_file_moved_away_is_an_outage_never_an_empty_database(tmp_path):
    """The file goes (moved, deleted, its disk gone): a retryable 503 and not ready, with no
    empty database created in its place; once it is back, it serves as before."""
    path = tmp_path / "db.sqlite3"
    url = f"sqlite:///{path}"
    manage(url, "migrate", "--no-input")  # creates the file: no connection would
    key = manage(url, "create_tenant", "Moved").strip().splitlines()[-1]
    web = WebProcess(url, tmp_path / "daphne.log").wait_up()
    client = openai.OpenAI(base_url=f"{web.url}/v1", api_key=key, max_retries=0, timeout=30)
    away = tmp_path / "away"
    away.mkdir()
    try:
        assert MODEL in [m.id for m in client.models.list()]
        assert httpx.get(f"{web.url}/readyz", timeout=30).json()["checks"]["database"] == "ok"
        for file in tmp_path.glob("db.sqlite3*"):  # with its WAL and shared-memory files
            # (a WAL file may be gone by now: the web process's last connection removes it as
            # it closes, its pages written into the database file)
            with contextlib.suppress(FileNotFoundError):
                file.rename(away / file.name)
        with pytest.raises(openai.APIStatusError) as raised:
            client.models.list()
        assert_database_outage(raised.value)
        ready = httpx.get(f"{web.url}/readyz", timeout=30)
        assert ready.status_code == 503 and ready.json()["checks"]["database"].startswith("error")
        assert not path.exists(), "a connection created an empty database in its place"
        for file in away.iterdir():
            file.rename(tmp_path / file.name)
        assert MODEL in [m.id for m in client.models.list()]
        assert httpx.get(f"{web.url}/readyz", timeout=30).json()["checks"]["database"] == "ok"
    finally:
        web.stop()


def test_readyz_says_not_ready_on_a_database_without_the_platform_tables(tmp_path):
    """A file in its place that is not the platform's database (empty, never migrated)."""
    path = tmp_path / "db.sqlite3"
    path.touch()
    web = WebProcess(f"sqlite:///{path}", tmp_path / "daphne.log").wait_up()
    try:
        ready = httpx.get(f"{web.url}/readyz", timeout=30)
    finally:
        web.stop()
    assert ready.status_code == 503 and "no such table" in ready.json()["checks"]["database"]
