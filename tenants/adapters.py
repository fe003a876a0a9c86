"""LoRA adapters' files and their validation's queue: where an uploaded adapter is kept, how its
files are written (readable by their owner only) and removed, and the Celery task that checks
one (``docs/platform.md``, "LoRA adapters").

Every path handled here lies under ``ADAPTER_ROOT`` (:func:`root_folder`); nothing is written or
removed outside it.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from celery import current_app
from django.conf import settings
from django.db import transaction

from inference.protocol.models import adapter_root, under_adapter_root

log = logging.getLogger(__name__)

# The Celery task that checks an adapter (registered by the web tier's ``gateway.tasks``).
VALIDATE_TASK = "gateway.tasks.validate_adapter"
# What stands for '/' of a base model's name in an upload's folder name.
SLASH_IN_FOLDER = "__"
# What comes between an adapter's name and the random part of its upload's folder name.
UPLOAD_SUFFIX_SEPARATOR = "."


def root_folder() -> Path:
    """``ADAPTER_ROOT`` resolved (symlinks followed; empty: ``<repo>/.cache/adapters``)."""
    return adapter_root(settings.LLM_PLATFORM.get("ADAPTER_ROOT", ""))


def inside_root(path: str | Path) -> Path | None:
    """``path`` resolved when it lies inside ``ADAPTER_ROOT`` (symlinks followed), else None."""
    return under_adapter_root(path, root_folder())


def new_upload_folder(tenant_slug: str, base_model: str, name: str) -> Path:
    """Make the folder of one upload, a new one that no row names:
    ``ADAPTER_ROOT/<tenant slug>/<base model, '/' as '__'>/<name>.<16 hex digits>`` (random),
    mode 0700, as are the folders above it. A folder that exists is never taken (the name is
    drawn again), so an upload never writes into a folder that another row, of any tenant,
    deleted or not, may still name: a re-upload of a deleted adapter's name, whose folder a
    shared adapter registered from it keeps, gets a folder of its own.

    Raises:
        OSError: the folder could not be made.
    """
    parent = private_folder(root_folder() / tenant_slug
                            / base_model.replace("/", SLASH_IN_FOLDER))
    while True:
        folder = parent / f"{name}{UPLOAD_SUFFIX_SEPARATOR}{uuid.uuid4().hex[:16]}"
        try:
            folder.mkdir(mode=0o700)  # fails on a folder (or anything) that exists
        except FileExistsError:
            continue
        except FileNotFoundError:  # its parent, left empty, was removed meanwhile
            private_folder(parent)
            continue
        folder.chmod(0o700)  # whatever the process's umask
        return folder


def private_folder(folder: Path) -> Path:
    """Create ``folder`` and each missing folder above it (``ADAPTER_ROOT`` included) with mode
    0700; returns it.

    Raises:
        ValueError: ``folder`` is not inside ``ADAPTER_ROOT``.
        OSError: a folder could not be made.
    """
    root = root_folder()
    if folder == root or not folder.is_relative_to(root):
        raise ValueError(f"{folder} is not inside ADAPTER_ROOT ({root})")
    for level in [*reversed(folder.relative_to(root).parents), folder.relative_to(root)]:
        path = root / level
        if not path.is_dir():
            path.mkdir(mode=0o700, parents=level == Path("."), exist_ok=True)
            path.chmod(0o700)  # whatever the process's umask
    return folder


def write_private_file(folder: Path, filename: str, chunks: Iterable[bytes]) -> int:
    """Write ``chunks`` to ``folder/filename`` with mode 0600 from the first byte: to a
    temporary name in ``folder``, then renamed over ``filename``. Returns the bytes written.

    Raises:
        OSError: the file could not be written (no temporary file is left behind).
    """
    temporary = folder / f".{filename}.{uuid.uuid4().hex}.part"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    written = 0
    try:
        os.fchmod(fd, 0o600)  # whatever the process's umask
        with os.fdopen(fd, "wb") as out:
            for chunk in chunks:
                out.write(chunk)
                written += len(chunk)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, folder / filename)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return written


def remove_files_of(sender: type, instance: Any, **_: Any) -> None:
    """``post_delete`` receiver of :class:`tenants.models.LoraAdapter`: a tenant's adapter's
    folder goes with its row, however the row goes (the API, the admin's delete or "delete
    selected", its tenant's deletion), once the deletion is committed and when no other row names
    the folder. A shared adapter's folder is the operator's and stays (it is registered from a
    folder the operator placed; the API never deletes one)."""
    if instance.owner_id is None:
        return
    folder = instance.folder

    def remove() -> None:
        if not sender.objects.filter(folder=folder).exists():
            remove_folder(folder)

    transaction.on_commit(remove)


def remove_folder(folder: str | Path) -> bool:
    """Remove an adapter's folder and what it holds, then the folders above it that it leaves
    empty, up to (not including) ``ADAPTER_ROOT``; nothing outside ``ADAPTER_ROOT`` is ever
    removed. Returns whether the folder was removed."""
    root = root_folder()
    path = Path(folder)
    inside = under_adapter_root(path, root)
    if inside is None or path.is_symlink() or not inside.is_dir():
        return False
    shutil.rmtree(inside)
    for parent in inside.parents:
        if parent == root or not parent.is_relative_to(root):
            break
        try:
            parent.rmdir()
        except OSError:  # not empty
            break
    return True


def send_validation(adapter_id: int) -> None:
    """Queue the Celery task that checks the adapter ``adapter_id`` (:data:`VALIDATE_TASK`)."""
    current_app.send_task(VALIDATE_TASK, args=[adapter_id])


def queue_validation(adapter_id: int) -> None:
    """Queue the check of the adapter ``adapter_id`` once the current transaction commits (at
    once outside one); a broker that cannot take it is logged (the adapter stays pending)."""

    def send() -> None:
        try:
            send_validation(adapter_id)
        except Exception:  # noqa: BLE001 - the admin's "validate again" queues it later
            log.exception("could not queue the validation of LoRA adapter %s", adapter_id)

    transaction.on_commit(send)
