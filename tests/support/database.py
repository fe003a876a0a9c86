"""A database that stops serving, for the tests of what clients get meanwhile: real refusals of
the database the suite runs on (SQLite, or PostgreSQL through ``DATABASE_URL``), no mocked
database.

:class:`DatabaseFault` turns the test database into

- a database that cannot be reached (:meth:`~DatabaseFault.down`): SQLite's connections are
  pointed at a file in a folder that does not exist, as when the disk or folder holding it went
  away (``OperationalError: unable to open database file``); PostgreSQL's at a local port nothing
  listens on, as when its server is down (``OperationalError: connection refused``);
- a read-only database (:meth:`~DatabaseFault.read_only`): every connection refuses writes, reads
  still work: SQLite's with ``PRAGMA query_only`` (as for a file it may not write), PostgreSQL's
  with ``default_transaction_read_only`` (as a standby answers: SQLSTATE 25006);

and :meth:`~DatabaseFault.restore` brings it back. The fixture ``database_fault`` restores it at
the test's end, before the test database is flushed (it takes ``transactional_db``: a fault must
not break a test transaction).

A connection is per thread: these calls close the calling thread's, and every other thread's
connection follows at its next connect (Django closes request and Channels connections after each
use). An async test calls them through ``sync_to_async`` to reach the thread its views and
consumers use.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

__all__ = ["DatabaseFault", "database_fault"]


def _refuse_writes(sender: Any, connection: Any, **kwargs: Any) -> None:
    if connection.vendor == "sqlite":
        connection.connection.execute("PRAGMA query_only = ON")
    else:
        with connection.connection.cursor() as cursor:
            cursor.execute("SET default_transaction_read_only = on")


def _unused_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class DatabaseFault:
    """Faults of the default database (SQLite or PostgreSQL); see the module docstring."""

    def __init__(self, missing: Path):
        from django.db import connection

        assert connection.vendor in ("sqlite", "postgresql"), connection.vendor
        self.vendor = connection.vendor
        self.missing = missing
        self.settings = connection.settings_dict  # shared by every thread's connection
        self.saved = {k: self.settings.get(k) for k in ("NAME", "HOST", "PORT")}

    def down(self) -> None:
        """Every query fails: the database's file cannot be opened, or its server refuses."""
        from django.db import connections

        if self.vendor == "sqlite":
            self.settings["NAME"] = str(self.missing)
        else:
            self.settings.update(HOST="127.0.0.1", PORT=str(_unused_port()))
        connections.close_all()

    def read_only(self) -> None:
        """Every write fails; reads work."""
        from django.db import connections
        from django.db.backends.signals import connection_created

        connection_created.connect(_refuse_writes, dispatch_uid="tests.read_only_database")
        connections.close_all()

    def restore(self) -> None:
        """Serve as before (idempotent)."""
        from django.db import connections
        from django.db.backends.signals import connection_created

        connection_created.disconnect(dispatch_uid="tests.read_only_database")
        self.settings.update(self.saved)
        connections.close_all()


@pytest.fixture
def database_fault(transactional_db, tmp_path) -> Iterator[DatabaseFault]:
    """A :class:`DatabaseFault` of the test database, restored at the test's end."""
    from asgiref.sync import SyncToAsync

    fault = DatabaseFault(tmp_path / "gone" / "db.sqlite3")
    yield fault
    fault.restore()
    # And in the thread that an async test's database calls ran in (no connection it holds may
    # keep refusing writes in the next test).
    SyncToAsync.single_thread_executor.submit(fault.restore).result(timeout=30)
