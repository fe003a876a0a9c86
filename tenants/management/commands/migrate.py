"""``manage.py migrate``, which also creates the SQLite database file when it is missing: the
platform's connections open it without creating it (:mod:`llm_platform.sqlite.base`)."""

from __future__ import annotations

from typing import Any

from django.core.management.commands import migrate
from django.db import DEFAULT_DB_ALIAS, connections


class Command(migrate.Command):
    def execute(self, *args: Any, **options: Any) -> str | None:
        # Before the system checks, which already connect.
        connection = connections[options.get("database") or DEFAULT_DB_ALIAS]
        create_file = getattr(connection, "create_file", None)
        if create_file is not None:
            create_file(connection.settings_dict["NAME"])
        return super().execute(*args, **options)
