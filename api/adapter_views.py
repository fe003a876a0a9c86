"""LoRA adapters over the API: ``POST`` and ``GET /v1/adapters``, ``GET`` and
``DELETE /v1/adapters/{base}:{adapter}`` (``docs/platform.md``, "LoRA adapters").

An upload (:mod:`api.adapter_uploads`) holds one of the tenant's upload leases, as a file
upload does (:func:`api.file_views.leased`). A key sees its tenant's adapters and the shared
ones over the base models it may call; another tenant's adapter is a 404, the same as one that
does not exist.
"""

from __future__ import annotations

from typing import Any

from asgiref.sync import sync_to_async
from django.db.models import Q
from django.http import HttpRequest, HttpResponse, JsonResponse

from api import adapter_uploads
from api.file_views import leased
from api.views import api_view, authenticate
from gateway.adapters import SHARED_OWNER, own_first
from gateway.errors import APIError
from gateway.model_registry import MAX_ECHOED_NAME, Access
from tenants.models import ApiKey, LoraAdapter


def adapter_object(row: LoraAdapter) -> dict[str, Any]:
    """An adapter as the API shows it: ``id`` (what a request sends as ``model``), ``name``,
    ``model`` (its base model), ``owned_by`` (its tenant's slug, ``system`` when shared),
    ``state`` (``pending``, ``ready``, ``refused``) and ``refusal`` (why; None unless refused),
    what its check found (``rank``, ``target_modules``, ``size_bytes``, ``digest``: None until
    ready), ``enabled``, and ``created_at``, ``validated_at`` (unix times; None before its
    check)."""
    ready = row.state == LoraAdapter.State.READY
    return {
        "id": row.api_name, "object": "adapter", "name": row.name, "model": row.base_model,
        "owned_by": row.owner.slug if row.owner is not None else SHARED_OWNER,
        "state": row.state, "refusal": row.refusal or None,
        "rank": row.rank if ready else None,
        "target_modules": row.target_modules.split(",") if ready and row.target_modules
        else None,
        "size_bytes": row.size_bytes if ready else None, "digest": row.digest if ready else None,
        "enabled": row.enabled, "created_at": int(row.created_at.timestamp()),
        "validated_at": int(row.validated_at.timestamp()) if row.validated_at else None,
    }


def adapter_not_found(name: str) -> APIError:
    """404 for an adapter that does not exist or that the key may not see (the same)."""
    shown = name if len(name) <= MAX_ECHOED_NAME else name[:MAX_ECHOED_NAME] + "..."
    return APIError(404, f"The adapter '{shown}' does not exist or you do not have access to "
                         "it.", code="adapter_not_found")


def _visible(key: ApiKey) -> list[LoraAdapter]:
    """``key``'s tenant's adapters and the shared ones, over base models it may call."""
    access = Access.of_key(key)
    rows = (LoraAdapter.objects.filter(Q(owner_id=key.tenant_id) | Q(owner__isnull=True))
            .select_related("owner").order_by("base_model", "name"))
    return [row for row in rows if access.permits(row.base_model)]


def _find(key: ApiKey, name: str) -> LoraAdapter:
    """The tenant's own adapter of that name, else the shared one (names are per tenant)."""
    found = [row for row in _visible(key) if row.api_name == name]
    if not found:
        raise adapter_not_found(name)
    return own_first(found)


def _create(request: HttpRequest, key: ApiKey) -> dict[str, Any]:
    # Its files (temporary files on disk, for a large upload) are closed and deleted when the
    # block ends, stored or refused: never left for the request's garbage collection.
    with adapter_uploads.received_form(request) as (fields, files):
        upload = adapter_uploads.check_form(fields, files)
        return adapter_object(adapter_uploads.store(upload, key))


@api_view("GET", "POST")
async def adapters(request: HttpRequest) -> HttpResponse:
    """``POST /v1/adapters`` (upload: the adapter object, ``pending``) and
    ``GET /v1/adapters`` (``{"object": "list", "data": [...]}``: the tenant's adapters and the
    shared ones, by base model and name)."""
    key = await authenticate(request)
    if request.method == "POST":
        return JsonResponse(await leased(request, key.tenant_id,
                                         lambda: sync_to_async(_create)(request, key)))
    rows = await sync_to_async(_visible)(key)
    return JsonResponse({"object": "list", "data": [adapter_object(row) for row in rows]})


def _delete(key: ApiKey, name: str) -> None:
    row = _find(key, name)
    if row.owner_id != key.tenant_id:
        raise APIError(403, "A shared adapter is managed by the platform's operator; it cannot "
                            "be deleted through the API.", code="permission_denied")
    row.delete()  # its files once committed (tenants.adapters.remove_files_of)


@api_view("GET", "DELETE")
async def adapter_detail(request: HttpRequest, adapter: str) -> HttpResponse:
    """``GET /v1/adapters/{base}:{adapter}`` (the adapter object) and ``DELETE`` (its owner's
    only: its row and files; ``{"id", "object": "adapter", "deleted": true}``).

    Raises:
        APIError: 404 ``adapter_not_found`` for one that does not exist or that the key may not
            see; 403 ``permission_denied`` deleting a shared one.
    """
    key = await authenticate(request)
    if request.method == "DELETE":
        await sync_to_async(_delete)(key, adapter)
        return JsonResponse({"id": adapter, "object": "adapter", "deleted": True})
    return JsonResponse(adapter_object(await sync_to_async(_find)(key, adapter)))
