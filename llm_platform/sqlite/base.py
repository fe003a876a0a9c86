"""Django's SQLite backend, except that a connection never creates the database file.

A plain ``sqlite3.connect`` creates an empty database where the file is missing (moved, deleted,
its disk unmounted and the folder left): every query then fails with ``no such table``, which
reads as a bug (500) rather than an outage, and writes land in a file nobody reads. Here each
connection opens the file read-write without creating it (an SQLite URI filename with
``mode=rw``, https://www.sqlite.org/uri.html), so a missing file is ``SQLITE_CANTOPEN``: a
database outage, answered 503 with ``Retry-After`` (:func:`gateway.errors.database_unavailable`),
and ``/readyz`` says not ready.

The file is created by whoever sets a database up: ``manage.py migrate``
(:mod:`tenants.management.commands.migrate`) and the test runner
(:meth:`DatabaseCreation._create_test_db`), both through :meth:`DatabaseWrapper.create_file`,
readable by its owner only (mode 0600; :mod:`llm_platform.private_files`).
An in-memory database (``:memory:`` or a ``mode=memory`` URI) and a URI given in ``NAME`` are
passed through as they are.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any
from urllib.parse import quote

from django.db.backends.sqlite3 import base, creation

from llm_platform import private_files


def _file_path(name: Any) -> Path | None:
    """The file a database ``NAME`` names, or None (in memory, or a URI given as is)."""
    text = str(name)
    if not text or text == ":memory:" or text.startswith("file:"):
        return None
    return Path(text).absolute()


class DatabaseCreation(creation.DatabaseCreation):
    def _create_test_db(self, verbosity: int, autoclobber: bool, keepdb: bool = False) -> str:
        name = super()._create_test_db(verbosity, autoclobber, keepdb)
        if not self.is_in_memory_db(name):
            DatabaseWrapper.create_file(name)
        return name


class DatabaseWrapper(base.DatabaseWrapper):
    creation_class = DatabaseCreation

    @staticmethod
    def create_file(name: Any) -> None:
        """Create the (empty) database file ``name`` with mode 0600, and its folder (0700) if
        missing; an existing file keeps its content and loses any permission of the group and
        of others.

        The file holds every session and conversation: its owner's only. SQLite creates the
        ``-wal``, ``-shm`` and ``-journal`` files with the database file's permissions.

        Raises:
            OSError: the file or its folder cannot be created.
        """
        path = _file_path(name)
        if path is not None:
            private_files.private_folder(path.parent)
            with contextlib.suppress(FileExistsError):  # kept as it is, its mode tightened
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL,
                                 private_files.FILE_MODE))
            for file in private_files.sqlite_files(path):
                private_files.tighten(file)

    def get_connection_params(self) -> dict[str, Any]:
        params = super().get_connection_params()
        path = _file_path(params["database"])
        if path is not None:
            # Django connects with uri=True; a URI path needs '%', '?' and '#' escaped.
            params["database"] = f"file:{quote(str(path))}?mode=rw"
            params["uri"] = True
        return params
