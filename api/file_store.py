"""Files of the Files API (:class:`api.models.StoredFile`): stored, read back, listed, deleted and
purged.

The bytes are kept through Django's storage API, in the ``files`` storage (``STORAGES["files"]``:
by default local files under ``FILES_ROOT``, the folders 0700 and the files 0600; any Django
storage back end may be configured), each under a generated name (``{tenant id}/{random hex}``),
never the client's filename. A file is stored before its row is written, so a row never names
missing bytes. A row deleted (:func:`delete`, the admin, its tenant deleted) has its bytes deleted
once that is committed (:func:`delete_bytes_of`); :func:`purge` deletes an expired file's bytes
(no route shows it) before its row, so that bytes the storage would not delete are tried again.

Every read is scoped to the caller's tenant: another tenant's file, or one past its
``expires_at``, is a 404. The tenant's quota (``FILES_TENANT_QUOTA_BYTES``) counts the bytes of
all its files, those the platform wrote (``batch_output``) too, and is checked under a lock on
the tenant's row, so uploads at once do not both pass it.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

from django.core.files import File
from django.core.files.base import ContentFile
from django.core.files.storage import Storage, storages
from django.db import transaction
from django.db.models import Q, Sum
from django.utils import timezone

from api import file_checks
from api.models import StoredFile
from gateway.conf import platform_settings
from gateway.errors import APIError
from gateway.storable import holds_nul, storable_text
from tenants.models import Tenant

log = logging.getLogger(__name__)

STORAGE_ALIAS = "files"
# The content type of a file's bytes, by purpose (both are JSONL).
CONTENT_TYPES = {StoredFile.Purpose.BATCH: "application/jsonl",
                 StoredFile.Purpose.BATCH_OUTPUT: "application/jsonl"}
# Bytes per read when a file's content is sent.
CHUNK_BYTES = 256 * 1024
PURGE_BATCH = 500


def storage() -> Storage:
    """The ``files`` storage (``STORAGES["files"]``)."""
    return storages[STORAGE_ALIAS]


def new_id() -> str:
    """A file id: ``file-`` and 24 hex digits."""
    return "file-" + uuid.uuid4().hex[:24]


def file_object(row: StoredFile) -> dict[str, Any]:
    """The file as OpenAI's File object: ``id``, ``object`` (``"file"``), ``bytes``,
    ``created_at`` and ``expires_at`` (Unix seconds; ``expires_at`` null when it is kept until
    deleted), ``filename``, ``purpose``, ``status`` (``"processed"``: checked and stored) and
    ``status_details`` (null)."""
    return {"id": row.id, "object": "file", "bytes": row.bytes,
            "created_at": int(row.created_at.timestamp()),
            "expires_at": int(row.expires_at.timestamp()) if row.expires_at else None,
            "filename": row.filename, "purpose": row.purpose, "status": "processed",
            "status_details": None}


def not_found(file_id: str, param: str | None = None) -> APIError:
    shown = file_id if len(file_id) <= 80 else file_id[:80] + "..."
    return APIError(404, f"No such File object: '{shown}'.", param=param, code="not_found",
                    type="invalid_request_error")


def live_files(tenant_id: int) -> Any:
    """The tenant's files not yet expired."""
    return StoredFile.objects.filter(tenant_id=tenant_id).filter(
        Q(expires_at__isnull=True) | Q(expires_at__gt=timezone.now()))


async def get(tenant_id: int, file_id: str, param: str | None = None) -> StoredFile:
    """The tenant's file ``file_id``.

    Raises:
        APIError: 404 when there is none (also another tenant's, or one expired).
    """
    found = (None if holds_nul(file_id)
             else await live_files(tenant_id).filter(pk=file_id).afirst())
    if found is None:
        raise not_found(file_id, param)
    return found


def retention_s(purpose: str) -> float:
    """How long a file of ``purpose`` is kept (seconds; 0: until deleted)."""
    conf = platform_settings()
    return conf["FILES_OUTPUT_RETENTION_S" if purpose == file_checks.OUTPUT_PURPOSE
                else "FILES_RETENTION_S"]


def quota_error(quota: int, used: int, size: int) -> APIError:
    return APIError(400, f"Invalid value for 'file': storing its {size} bytes would put this "
                         f"tenant's files at {used + size} bytes, over its storage quota of "
                         f"{quota} bytes ({used} bytes are stored now; delete files to make "
                         f"room).",
                    param="file", code="storage_quota_exceeded", should_retry=False,
                    details={"quota_bytes": quota, "used_bytes": used, "file_bytes": size})


def used_bytes(tenant_id: int) -> int:
    """The bytes of all the tenant's stored files (expired ones not yet purged included)."""
    return StoredFile.objects.filter(tenant_id=tenant_id).aggregate(
        total=Sum("bytes"))["total"] or 0


def check_quota(tenant_id: int, size: int) -> None:
    """Raises :func:`quota_error` (400 naming ``file``, ``details`` with the quota, the bytes
    used and the file's) when ``size`` more bytes would put the tenant over
    ``FILES_TENANT_QUOTA_BYTES`` (0: no quota)."""
    quota = platform_settings()["FILES_TENANT_QUOTA_BYTES"]
    if quota > 0:
        used = used_bytes(tenant_id)
        if used + size > quota:
            raise quota_error(quota, used, size)


def _store(content: File, *, tenant_id: int, api_key_id: int | None, purpose: str,
           filename: str, size: int, lines: int, expires_after_s: float | None,
           quota: bool) -> StoredFile:
    name = storage().save(f"{tenant_id}/{uuid.uuid4().hex}", content)
    try:
        with transaction.atomic():
            if quota:
                # Uploads of one tenant at once take turns here: the quota holds for all.
                Tenant.objects.select_for_update().filter(pk=tenant_id).first()
                check_quota(tenant_id, size)
            now = timezone.now()
            keep = retention_s(purpose) if expires_after_s is None else expires_after_s
            return StoredFile.objects.create(
                id=new_id(), tenant_id=tenant_id, api_key_id=api_key_id, purpose=purpose,
                filename=storable_text(filename), bytes=size, lines=lines, storage_name=name,
                created_at=now,
                expires_at=now + timedelta(seconds=keep) if keep > 0 else None)
    except BaseException:
        storage().delete(name)
        raise


def create_upload(upload: File, *, tenant_id: int, api_key_id: int, purpose: str,
                  expires_after_s: int | None = None) -> StoredFile:
    """Check an uploaded batch file (:func:`api.file_checks.check_jsonl`, read line by line) and
    store it as the tenant's, uploaded by the key ``api_key_id``; ``expires_after_s`` (None: the
    purpose's retention) sets its ``expires_at``.

    Raises:
        APIError: 400 naming ``file``: its checks', and the tenant's quota (:func:`quota_error`).
    """
    conf = platform_settings()
    size = upload.size or 0
    if size > conf["FILES_MAX_BYTES"]:
        raise file_checks.invalid("file", f"Invalid file: its {size} bytes are over "
                                          f"{conf['FILES_MAX_BYTES']}, the largest a batch "
                                          f"file may be (FILES_MAX_BYTES).",
                                  code="file_too_large",
                                  details={"limit_bytes": conf["FILES_MAX_BYTES"]})
    check_quota(tenant_id, size)  # early, before the file is read; again when it is stored
    upload.seek(0)
    lines = file_checks.check_jsonl(upload.file, max_lines=conf["FILES_MAX_LINES"],
                                    max_bytes=conf["FILES_MAX_BYTES"])
    upload.seek(0)
    return _store(upload, tenant_id=tenant_id, api_key_id=api_key_id, purpose=purpose,
                  filename=upload.name or "file", size=size, lines=lines,
                  expires_after_s=expires_after_s, quota=True)


def create_from_bytes(data: bytes, *, tenant_id: int, filename: str,
                      purpose: str = file_checks.OUTPUT_PURPOSE,
                      api_key_id: int | None = None) -> StoredFile:
    """Store ``data``, a file the platform wrote (by default ``batch_output``: a batch's output or
    errors, JSONL), as the tenant's file ``filename``, kept ``FILES_OUTPUT_RETENTION_S``.

    The tenant's quota is not applied (its batch was accepted), but the file counts in it. The
    bytes are not checked.
    """
    return _store(ContentFile(data), tenant_id=tenant_id, api_key_id=api_key_id,
                  purpose=purpose, filename=filename, size=len(data),
                  lines=file_checks.count_lines(data), expires_after_s=None, quota=False)


def page(tenant_id: int, *, purpose: str | None, limit: int, order: str,
         after: str | None) -> tuple[list[StoredFile], bool]:
    """Up to ``limit`` of the tenant's files (of ``purpose`` when given), newest first
    (``order`` ``desc``) or oldest first (``asc``), after the file ``after``; and whether more
    follow.

    Raises:
        APIError: 404 naming ``after`` when it is not one of the tenant's files.
    """
    rows = live_files(tenant_id)
    if purpose is not None:
        rows = rows.filter(purpose=storable_text(purpose))
    if after is not None:
        cursor = None if holds_nul(after) else live_files(tenant_id).filter(pk=after).first()
        if cursor is None:
            raise not_found(after, "after")
        at, key = cursor.created_at, cursor.pk
        if order == "desc":
            rows = rows.filter(Q(created_at__lt=at) | Q(created_at=at, id__lt=key))
        else:
            rows = rows.filter(Q(created_at__gt=at) | Q(created_at=at, id__gt=key))
    ordering = ("-created_at", "-id") if order == "desc" else ("created_at", "id")
    found = list(rows.order_by(*ordering)[:limit + 1])
    return found[:limit], len(found) > limit


def content_chunks(row: StoredFile) -> Iterator[bytes]:
    """The file's bytes, :data:`CHUNK_BYTES` at a time.

    Raises:
        FileNotFoundError: its bytes are gone from the storage.
    """
    with storage().open(row.storage_name, "rb") as handle:
        while chunk := handle.read(CHUNK_BYTES):
            yield chunk


def _delete_bytes(name: str) -> bool:
    """Delete stored bytes; False (logged) when the storage refused."""
    try:
        storage().delete(name)
    except Exception:  # noqa: BLE001 - logged; the caller decides what is left
        log.exception("could not delete the stored file %s", name)
        return False
    return True


def delete(row: StoredFile) -> None:
    """Delete the file: its row, then (:func:`delete_bytes_of`) its bytes."""
    StoredFile.objects.filter(pk=row.pk).delete()


def delete_bytes_of(sender: type, instance: StoredFile, **_: Any) -> None:
    """``post_delete`` receiver of :class:`StoredFile`: its bytes are deleted once the row's
    deletion is committed, however the row went (the API, the admin, its tenant deleted)."""
    name = instance.storage_name
    transaction.on_commit(lambda: _delete_bytes(name))


def purge(now: float | None = None) -> int:
    """Delete the files past their ``expires_at`` (bytes, then rows; a file whose bytes the
    storage refused to delete keeps its row for the next round); returns how many."""
    cutoff = datetime.fromtimestamp(time.time() if now is None else now, tz=UTC)
    count = 0
    last = ""
    while True:
        rows = list(StoredFile.objects.filter(expires_at__lte=cutoff, pk__gt=last)
                    .order_by("pk").values_list("pk", "storage_name")[:PURGE_BATCH])
        if not rows:
            return count
        last = rows[-1][0]
        gone = [pk for pk, name in rows if _delete_bytes(name)]
        deleted, _ = StoredFile.objects.filter(pk__in=gone).delete()
        count += deleted
