"""Batches of the Batch API (:class:`api.models.Batch`): created, read back, listed and cancelled.

A batch is created ``validating`` from one of its tenant's ``batch`` files; the Celery steps of
:mod:`api.batch_runner` take it from there. Every read is scoped to the caller's tenant: another
tenant's batch is a 404, as is an input file of another tenant.
"""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta
from typing import Any, Literal

from django.db import transaction
from django.db.models import Count, Q
from django.utils import timezone
from pydantic import Field, field_validator

from api import file_store
from api.bodies import parse_model
from api.fields import BodyObject, Text
from api.models import Batch, BatchLine, StoredFile
from api.schemas import metadata_bounds
from gateway import batch_metrics
from gateway.admission import Principal
from gateway.errors import APIError
from gateway.model_registry import Access
from gateway.storable import holds_nul, storable
from tenants.models import ApiKey, Tenant

# The endpoints a batch may run (each line's ``url`` must be its batch's).
ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
# OpenAI's completion windows (only 24 hours), in seconds.
COMPLETION_WINDOWS = {"24h": 86_400}
# The statuses a Celery step still works on.
ACTIVE = (Batch.Status.VALIDATING, Batch.Status.IN_PROGRESS, Batch.Status.FINALIZING,
          Batch.Status.CANCELLING)
TERMINAL = (Batch.Status.COMPLETED, Batch.Status.FAILED, Batch.Status.EXPIRED,
            Batch.Status.CANCELLED)
MAX_LIST_LIMIT = 100


class BatchCreate(BodyObject):
    """The body of ``POST /v1/batches``."""

    input_file_id: Text = Field(min_length=1, max_length=64)
    endpoint: Literal["/v1/chat/completions", "/v1/completions"]
    completion_window: Literal["24h"]
    metadata: dict[Text, Text] | None = None

    @field_validator("metadata")
    @classmethod
    def _metadata_bounds(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        return metadata_bounds(value)


def new_id() -> str:
    """A batch id: ``batch_`` and 24 hex digits."""
    return "batch_" + uuid.uuid4().hex[:24]


def _unix(moment: datetime | None) -> int | None:
    return int(moment.timestamp()) if moment is not None else None


def batch_object(row: Batch) -> dict[str, Any]:
    """The batch as OpenAI's Batch object (times in Unix seconds, null until reached; ``usage``
    null until its output file is written)."""
    return {
        "id": row.id, "object": "batch", "endpoint": row.endpoint,
        "errors": row.errors, "input_file_id": row.input_file_id,
        "completion_window": row.completion_window, "status": row.status,
        "output_file_id": row.output_file_id or None, "error_file_id": row.error_file_id or None,
        "created_at": _unix(row.created_at), "in_progress_at": _unix(row.in_progress_at),
        "expires_at": _unix(row.expires_at), "finalizing_at": _unix(row.finalizing_at),
        "completed_at": _unix(row.completed_at), "failed_at": _unix(row.failed_at),
        "expired_at": _unix(row.expired_at), "cancelling_at": _unix(row.cancelling_at),
        "cancelled_at": _unix(row.cancelled_at),
        "request_counts": {"total": row.total, "completed": row.completed,
                           "failed": row.failed},
        "metadata": row.metadata,
        "usage": None if row.input_tokens is None else {
            "input_tokens": row.input_tokens,
            "input_tokens_details": {"cached_tokens": row.cached_tokens or 0},
            "output_tokens": row.output_tokens or 0,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": row.input_tokens + (row.output_tokens or 0)},
    }


def not_found(batch_id: str, param: str | None = None) -> APIError:
    shown = batch_id if len(batch_id) <= 80 else batch_id[:80] + "..."
    return APIError(404, f"No such Batch object: '{shown}'.", param=param, code="not_found",
                    type="invalid_request_error")


def create(body: dict[str, Any], *, tenant_id: int, api_key_id: int) -> Batch:
    """A new batch of the tenant's ``batch`` file ``input_file_id``, ``validating``.

    Raises:
        APIError: 400 naming the field (an unknown field, an endpoint or completion window not
            served, metadata over OpenAI's bounds, a file whose purpose is not ``batch``); 404
            naming ``input_file_id`` for a file the tenant does not have.
    """
    req: BatchCreate = parse_model(BatchCreate, body)
    found = (None if holds_nul(req.input_file_id)
             else file_store.live_files(tenant_id).filter(pk=req.input_file_id).first())
    if found is None:
        raise file_store.not_found(req.input_file_id, "input_file_id")
    if found.purpose != StoredFile.Purpose.BATCH:
        raise APIError(400, f"Invalid value for 'input_file_id': the file's purpose is "
                            f"'{found.purpose}'; a batch runs a file uploaded with purpose "
                            f"'batch'.", param="input_file_id", code="invalid_value")
    now = timezone.now()
    return Batch.objects.create(
        id=new_id(), tenant_id=tenant_id, api_key_id=api_key_id, endpoint=req.endpoint,
        input_file_id=found.pk, completion_window=req.completion_window,
        metadata=storable(req.metadata), created_at=now,  # a NUL as U+FFFD, as all text stored
        expires_at=now + timedelta(seconds=COMPLETION_WINDOWS[req.completion_window]))


def get(tenant_id: int, batch_id: str) -> Batch:
    """The tenant's batch ``batch_id``.

    Raises:
        APIError: 404 when there is none (also another tenant's).
    """
    found = (None if holds_nul(batch_id)
             else Batch.objects.filter(tenant_id=tenant_id, pk=batch_id).first())
    if found is None:
        raise not_found(batch_id)
    return found


def page(tenant_id: int, *, limit: int, after: str | None) -> tuple[list[Batch], bool]:
    """Up to ``limit`` of the tenant's batches, newest first, after the batch ``after``; and
    whether more follow.

    Raises:
        APIError: 404 naming ``after`` when it is not one of the tenant's batches.
    """
    rows = Batch.objects.filter(tenant_id=tenant_id)
    if after is not None:
        cursor = None if holds_nul(after) else rows.filter(pk=after).first()
        if cursor is None:
            raise not_found(after, "after")
        rows = rows.filter(Q(created_at__lt=cursor.created_at)
                           | Q(created_at=cursor.created_at, id__lt=cursor.pk))
    found = list(rows.order_by("-created_at", "-id")[:limit + 1])
    return found[:limit], len(found) > limit


def cancel(tenant_id: int, batch_id: str) -> Batch:
    """Ask the batch to stop: ``cancelling`` (its step aborts the requests in flight, keeps the
    lines that finished and ends the rest; then ``cancelled``). A batch already cancelling is
    returned as it is.

    Raises:
        APIError: 404 as :func:`get`; 409 for a batch that is finalizing or ended.
    """
    with transaction.atomic():
        row = get(tenant_id, batch_id)
        row = Batch.objects.select_for_update().get(pk=row.pk)
        if row.status in (Batch.Status.VALIDATING, Batch.Status.IN_PROGRESS):
            row.status = Batch.Status.CANCELLING
            row.cancelling_at = timezone.now()
            row.save(update_fields=["status", "cancelling_at"])
        elif row.status != Batch.Status.CANCELLING:
            raise APIError(409, f"Cannot cancel a batch whose status is '{row.status}'.",
                           code="conflict", type="invalid_request_error")
    return row


def principal(batch: Batch) -> Principal | None:
    """Whom ``batch``'s lines are admitted as: the key that created it (its limits), or its
    tenant when that key is gone or revoked (a batch is its tenant's, as its files are: every
    key of the tenant sees it); None while the tenant is deactivated (no line of it is fed until
    it is active again or the batch's window ends)."""
    key = (ApiKey.objects.select_related("tenant__tier")
           .filter(pk=batch.api_key_id, revoked_at__isnull=True).first()
           if batch.api_key_id else None)
    tenant = key.tenant if key is not None else (
        Tenant.objects.select_related("tier").get(pk=batch.tenant_id))
    if not tenant.is_active:
        return None
    if key is not None:
        return Principal.for_api_key(key)
    return Principal(tenant=tenant, scope=f"batch-{batch.pk}")


def model_access(batch: Batch) -> Access:
    """The models ``batch``'s lines may name: those its tenant's and its creating key's
    ``allowed_models`` allow (the key's even once revoked; once deleted, the tenant's alone),
    and the LoRA adapters over them that its tenant owns or that are shared."""
    tenant_rules = Tenant.objects.filter(pk=batch.tenant_id).values_list(
        "allowed_models", flat=True).first()
    key_rules = (ApiKey.objects.filter(pk=batch.api_key_id).values_list(
        "allowed_models", flat=True).first() if batch.api_key_id else None)
    return Access(tenant_rules or "", key_rules or "", batch.tenant_id)


def count(row: Batch) -> None:
    """Set the batch ``row``'s ``request_counts`` from its lines now (a failed batch keeps its
    own), and publish the figures of :mod:`gateway.batch_metrics` once the transaction
    commits."""
    before = {"completed": row.completed, "failed": row.failed}
    if row.status != Batch.Status.FAILED:
        by_state = dict(BatchLine.objects.filter(batch=row).order_by().values("state")
                        .annotate(n=Count("id")).values_list("state", "n"))
        row.completed = by_state.get(BatchLine.State.DONE, 0)
        row.failed = by_state.get(BatchLine.State.FAILED, 0)
        row.save(update_fields=["completed", "failed"])
    ended = {"completed": row.completed - before["completed"],
             "failed": row.failed - before["failed"]}
    slug = Tenant.objects.filter(pk=row.tenant_id).values_list("slug", flat=True).first()
    figures = ({"tenant": slug, "status": row.status, "total": row.total,
                "completed": row.completed, "failed": row.failed}
               if row.status in ACTIVE else None)
    batch_metrics.publish_on_commit(row.pk, figures, ended)
