"""Files that hold secrets, readable by their owner only: files 0600, their folder 0700.

``var/`` holds only such files: the SQLite database (every session, the superuser's included,
and every conversation) with its ``-wal``, ``-shm`` and ``-journal`` files, the install's
``secret_key``, the demo tenant's key and the demo user's password, and the logs (request lines,
errors). Each is created private (:func:`private_folder`, and each writer's own mode
0600: :meth:`llm_platform.sqlite.base.DatabaseWrapper.create_file`,
:mod:`llm_platform.secret_key`, :func:`tenants.services.write_private`, the run script's
``umask 077``), and every process that loads the settings tightens what it finds looser
(:func:`make_private`): a file an older version made 0644, one copied in or made by hand.

SQLite creates a database's ``-wal``, ``-shm`` and ``-journal`` files with the database file's
own permissions, so a private database keeps them private.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger(__name__)

FILE_MODE = 0o600
FOLDER_MODE = 0o700
# The permission bits of the group and of others.
OPEN_BITS = 0o077
# The files SQLite keeps beside a database file.
SQLITE_SIDE_FILES = ("-wal", "-shm", "-journal")


def private_folder(path: str | os.PathLike) -> Path:
    """The folder ``path``, created with mode 0700 when missing (its missing parents get the
    usual mode); an existing one is left as it is.

    Raises:
        OSError: it cannot be created (a file of that name included).
    """
    path = Path(path)
    if not path.is_dir():
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            path.mkdir(mode=FOLDER_MODE)
        except FileExistsError:
            if not path.is_dir():  # a file of that name
                raise
            # else another process made it meanwhile
    return path


def tighten(path: str | os.PathLike) -> bool:
    """Take the group's and others' permissions off ``path`` (a file, a folder or a socket)
    when it has any; True when its mode changed. A missing path, or one this process may not
    change (another user's), is left as it is (the latter logged)."""
    path = Path(path)
    try:
        found = path.lstat().st_mode
        mode = stat.S_IMODE(found)
        if stat.S_ISLNK(found) or not mode & OPEN_BITS:
            return False  # a link's mode is not its own (chmod would change its target's)
        path.chmod(mode & ~OPEN_BITS)
    except FileNotFoundError:
        return False
    except OSError as exc:
        log.warning("could not make %s readable by its owner only: %s", path, exc)
        return False
    return True


def sqlite_files(name: str | os.PathLike) -> list[Path]:
    """A SQLite database file and the files SQLite keeps beside it."""
    path = Path(name)
    return [path, *(path.with_name(path.name + suffix) for suffix in SQLITE_SIDE_FILES)]


def make_private(folder: str | os.PathLike, files: Iterable[str | os.PathLike] = ()) -> None:
    """Make ``folder`` (when it exists) 0700 and every file in it, and each of ``files`` that
    exists, readable and writable by its owner only (see :func:`tighten`)."""
    folder = Path(folder)
    if folder.is_dir():
        tighten(folder)
        for entry in folder.iterdir():
            tighten(entry)
    for path in files:
        tighten(path)
