"""Files that hold secrets are their owner's only: the SQLite database and the files SQLite keeps
beside it, the install's secret key, var/ and what is in it; a looser mode found when a process
starts is tightened."""

from __future__ import annotations

import os
import sqlite3
import stat
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from llm_platform import private_files
from llm_platform.secret_key import load_secret_key
from llm_platform.sqlite.base import DatabaseWrapper

REPO = Path(__file__).resolve().parents[2]


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_new_database_and_its_wal_files_are_the_owners_only(tmp_path):
    path = tmp_path / "data" / "db.sqlite3"
    DatabaseWrapper.create_file(str(path))
    assert mode(path) == 0o600 and mode(path.parent) == 0o700
    # SQLite gives the files it makes beside a database the database's own mode.
    db = sqlite3.connect(path)
    try:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("CREATE TABLE session (data TEXT)")
        db.execute("INSERT INTO session VALUES ('a signed-in session')")
        db.commit()
        side = [Path(f"{path}-wal"), Path(f"{path}-shm")]
        assert all(p.exists() for p in side)
        assert [mode(p) for p in side] == [0o600, 0o600]
    finally:
        db.close()


def test_creating_an_existing_database_keeps_it_and_tightens_its_files(tmp_path):
    path = tmp_path / "db.sqlite3"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE t (x)")
    db.commit()
    db.close()
    wal = Path(f"{path}-wal")
    wal.write_bytes(b"")
    for p in (path, wal):
        p.chmod(0o644)
    DatabaseWrapper.create_file(str(path))
    assert mode(path) == 0o600 and mode(wal) == 0o600
    assert mode(tmp_path) == stat.S_IMODE(tmp_path.stat().st_mode)  # a folder it found: as is
    with sqlite3.connect(path) as again:
        assert again.execute("SELECT name FROM sqlite_master").fetchall() == [("t",)]


def test_the_secret_key_gets_a_folder_of_its_own_owners(tmp_path):
    path = tmp_path / "keys" / "secret_key"
    load_secret_key("", debug=False, path=path)
    assert mode(path) == 0o600 and mode(path.parent) == 0o700


def test_make_private_tightens_a_folder_and_the_files_in_it_and_leaves_links(tmp_path):
    folder = tmp_path / "var"
    folder.mkdir(mode=0o755)
    folder.chmod(0o755)
    log = folder / "daphne.log"
    log.write_text("GET /v1/models 200\n")
    log.chmod(0o644)
    private = folder / "secret_key"
    private.write_text("k" * 64)
    private.chmod(0o600)
    outside = tmp_path / "elsewhere.txt"
    outside.write_text("not a secret")
    outside.chmod(0o644)
    (folder / "link").symlink_to(outside)
    db = tmp_path / "db.sqlite3"
    db.write_bytes(b"")
    db.chmod(0o664)
    private_files.make_private(folder, private_files.sqlite_files(db))
    assert mode(folder) == 0o700
    assert mode(log) == 0o600 and mode(private) == 0o600 and mode(db) == 0o600
    assert mode(outside) == 0o644  # a link's target is not the folder's
    private_files.make_private(tmp_path / "missing")  # nothing to do, no error


@pytest.mark.process
def test_a_process_that_starts_tightens_what_it_finds_looser(tmp_path):
    """As the run script and every process start: the settings tighten var/ and its files, and
    a SQLite database kept elsewhere with its -wal and -shm files."""
    var = REPO / "var"
    var.mkdir(exist_ok=True)
    var.chmod(0o755)  # as an older version made it
    log = var / f"test-{uuid.uuid4().hex[:8]}.log"
    log.write_text("a log line\n")
    log.chmod(0o644)
    db = tmp_path / "db.sqlite3"
    sqlite3.connect(db).close()
    side = [Path(f"{db}-wal"), Path(f"{db}-shm")]
    for p in (db, *side):
        p.touch()
        p.chmod(0o644)
    try:
        env = {**os.environ, "DJANGO_SETTINGS_MODULE": "llm_platform.settings",
               "DATABASE_URL": f"sqlite:///{db}"}
        started = subprocess.run([sys.executable, "-c", "import django; django.setup()"],
                                 cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        assert started.returncode == 0, started.stderr[-2000:]
        assert mode(var) == 0o700 and mode(log) == 0o600
        assert [mode(p) for p in (db, *side)] == [0o600, 0o600, 0o600]
    finally:
        log.unlink()
