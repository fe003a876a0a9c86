"""The Batch API: ``POST`` and ``GET /v1/batches``, ``GET /v1/batches/{id}``,
``POST /v1/batches/{id}/cancel``.

A batch runs the requests of one of its tenant's ``batch`` files as batch work; its Celery
steps (:mod:`api.batch_runner`) write its output and error files, read back through the Files
API. Another tenant's batch is a 404.
"""

from __future__ import annotations

from asgiref.sync import sync_to_async
from django.http import HttpRequest, HttpResponse, JsonResponse

from api import batch_store
from api.bodies import parse_json_body
from api.views import api_view, authenticate, read_body
from gateway.errors import APIError


def _limit(request: HttpRequest) -> int:
    raw = request.GET.get("limit")
    try:
        limit = int(raw) if raw is not None else 20
    except ValueError:
        limit = 0
    if not 1 <= limit <= batch_store.MAX_LIST_LIMIT:
        raise APIError(400, f"Invalid value for 'limit': expected an integer from 1 to "
                            f"{batch_store.MAX_LIST_LIMIT}.", param="limit",
                       code="invalid_value")
    return limit


@api_view("GET", "POST")
async def batches(request: HttpRequest) -> HttpResponse:
    """``POST /v1/batches`` (``input_file_id``, ``endpoint``, ``completion_window``,
    ``metadata``: the Batch object, ``validating``) and ``GET /v1/batches`` (the tenant's
    batches, newest first: ``limit`` 1 to 100, default 20, ``after`` a batch id; OpenAI's list:
    ``data``, ``first_id``, ``last_id``, ``has_more``)."""
    key = await authenticate(request)
    if request.method == "POST":
        body = parse_json_body(read_body(request))
        row = await sync_to_async(batch_store.create)(body, tenant_id=key.tenant_id,
                                                      api_key_id=key.pk)
        return JsonResponse(batch_store.batch_object(row))
    limit = _limit(request)
    rows, has_more = await sync_to_async(batch_store.page)(
        key.tenant_id, limit=limit, after=request.GET.get("after") or None)
    data = [batch_store.batch_object(row) for row in rows]
    return JsonResponse({"object": "list", "data": data,
                         "first_id": data[0]["id"] if data else None,
                         "last_id": data[-1]["id"] if data else None, "has_more": has_more})


@api_view("GET")
async def batch_detail(request: HttpRequest, batch_id: str) -> HttpResponse:
    """``GET /v1/batches/{id}``: the Batch object."""
    key = await authenticate(request)
    row = await sync_to_async(batch_store.get)(key.tenant_id, batch_id)
    return JsonResponse(batch_store.batch_object(row))


@api_view("POST")
async def batch_cancel(request: HttpRequest, batch_id: str) -> HttpResponse:
    """``POST /v1/batches/{id}/cancel``: the Batch object, ``cancelling`` (409 for a batch that
    is finalizing or ended)."""
    key = await authenticate(request)
    row = await sync_to_async(batch_store.cancel)(key.tenant_id, batch_id)
    return JsonResponse(batch_store.batch_object(row))
