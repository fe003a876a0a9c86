"""The Files API: ``POST`` and ``GET /v1/files``, ``GET`` and ``DELETE /v1/files/{id}``,
``GET /v1/files/{id}/content``.

An upload is ``multipart/form-data`` (``file``, ``purpose``; optionally ``expires_after``), parsed
by Django's upload handlers (a file over ``FILE_UPLOAD_MAX_MEMORY_SIZE`` goes to a temporary
file), checked line by line (:mod:`api.file_checks`) and stored (:mod:`api.file_store`). The web
process reads a body over ``MAX_BODY_BYTES`` on this path only once the API key of its headers
is valid (:mod:`llm_platform.http_guard`; ``MAX_BODY_BYTES_BY_PATH``, by default
``FILES_MAX_BYTES`` and the multipart framing). A tenant may have
``FILES_MAX_CONCURRENT_UPLOADS`` uploads in progress at once, over all web processes (leases in
Redis, each ending with its request or after ``FILES_UPLOAD_LEASE_S``); one more gets a 429. A
body over ``MAX_BODY_BYTES`` takes its lease in the web process before it is read (named to the
view by :data:`UPLOAD_LEASE_HEADER`); a smaller one here.
"""

from __future__ import annotations

import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, TypeVar

import redis.exceptions
from asgiref.sync import sync_to_async
from django.core.exceptions import RequestDataTooBig, SuspiciousOperation
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.http.multipartparser import MultiPartParserError
from django.utils.http import content_disposition_header

from api import file_checks, file_store
from api.views import api_view, authenticate
from gateway.clients import aredis
from gateway.conf import platform_settings
from gateway.errors import APIError
from gateway.scripts import LuaScript

log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_LIST_LIMIT = 10_000
# The lease of an upload the web process took before it read the body
# (:mod:`llm_platform.http_guard`), which it ends with the request.
UPLOAD_LEASE_HEADER = "X-Platform-Upload-Lease"

# Takes a lease of one of a tenant's upload slots: KEYS[1] the tenant's leases (a sorted set,
# member: upload id, score: when the lease ends), ARGV: now, the lease's end, the most leases
# (0: any number), the upload id. Drops the ended leases first; 1 when taken, else 0.
TAKE_LEASE = LuaScript("""
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
local most = tonumber(ARGV[3])
if most > 0 and redis.call('ZCARD', KEYS[1]) >= most then
  return 0
end
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[4])
redis.call('EXPIREAT', KEYS[1], math.ceil(tonumber(ARGV[2])) + 1)
return 1
""")


def _leases_key(tenant_id: int) -> str:
    return f"{platform_settings()['REDIS_PREFIX']}:files:uploads:{tenant_id}"


async def take_upload_lease(tenant_id: int) -> str:
    """A lease of one of the tenant's ``FILES_MAX_CONCURRENT_UPLOADS`` upload slots; returns its
    id (for :func:`end_upload_lease`).

    Raises:
        APIError: 429 ``concurrency_limit_exceeded`` (retryable) when all are taken.
    """
    conf = platform_settings()
    lease_id = uuid.uuid4().hex
    now = time.time()
    most = conf["FILES_MAX_CONCURRENT_UPLOADS"]
    taken = await TAKE_LEASE.arun(aredis(), 1, _leases_key(tenant_id), now,
                                now + conf["FILES_UPLOAD_LEASE_S"], most, lease_id)
    if not taken:
        raise APIError(429, f"Too many uploads in progress: this tenant may upload {most} files "
                            f"at once (FILES_MAX_CONCURRENT_UPLOADS); retry when one has ended.",
                       code="concurrency_limit_exceeded", retry_after_s=1,
                       details={"limit": most})
    return lease_id


async def end_upload_lease(tenant_id: int, lease_id: str) -> None:
    """End a lease of :func:`take_upload_lease`; when Redis cannot be reached it is logged and
    left to run out (``FILES_UPLOAD_LEASE_S``): the upload's answer stands."""
    try:
        await aredis().zrem(_leases_key(tenant_id), lease_id)
    except redis.exceptions.RedisError as exc:
        log.warning("could not end the upload lease %s of tenant %s: %s", lease_id, tenant_id,
                    exc)


async def leased(request: HttpRequest, tenant_id: int, upload: Callable[[], Awaitable[T]]) -> T:
    """Run ``upload`` (the storing of an upload's body) holding one of the tenant's upload
    leases: the one the web process took before it read the body (named by
    :data:`UPLOAD_LEASE_HEADER`), else one taken here and ended after.

    Raises:
        APIError: 429 ``concurrency_limit_exceeded`` (:func:`take_upload_lease`).
    """
    held = request.headers.get(UPLOAD_LEASE_HEADER)
    if held and await aredis().zscore(_leases_key(tenant_id), held) is not None:
        return await upload()
    lease = await take_upload_lease(tenant_id)
    try:
        return await upload()
    finally:
        await end_upload_lease(tenant_id, lease)


def _form(request: HttpRequest) -> tuple[dict[str, list[str]], Any]:
    """The request's form fields and its files (Django's multipart parser).

    Raises:
        APIError: 400 for a body that is not a form Django can parse.
    """
    try:
        fields = {name: request.POST.getlist(name) for name in request.POST}
        return fields, request.FILES
    except RequestDataTooBig as exc:
        raise APIError(400, "The form's fields other than 'file' are too large.",
                       code="invalid_request") from exc
    except (MultiPartParserError, SuspiciousOperation) as exc:
        raise APIError(400, f"The request body is not a multipart/form-data form this server "
                            f"can read: {exc}", code="invalid_request") from exc


def _upload(request: HttpRequest, tenant_id: int, api_key_id: int) -> dict[str, Any]:
    fields, files = _form(request)
    checked = file_checks.upload_fields(fields, [name for name in files for _ in
                                                 files.getlist(name)],
                                        file_store.retention_s("batch"))
    row = file_store.create_upload(files[file_checks.FILE_FIELD], tenant_id=tenant_id,
                                   api_key_id=api_key_id, purpose=checked.purpose,
                                   expires_after_s=checked.expires_after_s)
    return file_store.file_object(row)


# The purposes a list may filter by: OpenAI's (a purpose this server does not store lists
# nothing) and the output files' own; another value is a 400 naming it.
LISTED_PURPOSES = (*file_checks.OPENAI_PURPOSES, file_checks.OUTPUT_PURPOSE, "assistants_output",
                   "fine-tune-results")


def _list_params(request: HttpRequest) -> dict[str, Any]:
    raw = request.GET.get("limit")
    try:
        limit = int(raw) if raw is not None else MAX_LIST_LIMIT
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_LIST_LIMIT:
        raise APIError(400, f"Invalid value for 'limit': expected an integer from 1 to "
                            f"{MAX_LIST_LIMIT}.", param="limit", code="invalid_value")
    order = request.GET.get("order", "desc")
    if order not in ("asc", "desc"):
        raise APIError(400, "Invalid value for 'order': expected 'asc' or 'desc'.",
                       param="order", code="invalid_value")
    purpose = request.GET.get("purpose") or None
    if purpose is not None and purpose not in LISTED_PURPOSES:
        raise APIError(400, f"Invalid value for 'purpose': expected one of "
                            f"{', '.join(LISTED_PURPOSES)}.", param="purpose", code="invalid_value")
    return {"purpose": purpose, "limit": limit, "order": order,
            "after": request.GET.get("after") or None}


@api_view("GET", "POST")
async def files(request: HttpRequest) -> HttpResponse:
    """``POST /v1/files`` (upload: the File object) and ``GET /v1/files`` (the tenant's files:
    ``purpose``, ``limit`` 1 to 10000, default 10000, ``order`` ``desc`` (default, newest first)
    or ``asc``, ``after`` a file id; OpenAI's list: ``data``, ``first_id``, ``last_id``,
    ``has_more``)."""
    key = await authenticate(request)
    if request.method == "POST":
        return JsonResponse(await leased(request, key.tenant_id, functools.partial(
            sync_to_async(_upload), request, key.tenant_id, key.pk)))
    params = _list_params(request)
    rows, has_more = await sync_to_async(file_store.page)(key.tenant_id, **params)
    data = [file_store.file_object(row) for row in rows]
    return JsonResponse({"object": "list", "data": data,
                         "first_id": data[0]["id"] if data else None,
                         "last_id": data[-1]["id"] if data else None, "has_more": has_more})


@api_view("GET", "DELETE")
async def file_detail(request: HttpRequest, file_id: str) -> HttpResponse:
    """``GET /v1/files/{id}`` (the File object) and ``DELETE`` (``{"id", "object": "file",
    "deleted": true}``). Another tenant's file is a 404."""
    key = await authenticate(request)
    found = await file_store.get(key.tenant_id, file_id)
    if request.method == "DELETE":
        await sync_to_async(file_store.delete)(found)
        return JsonResponse({"id": found.pk, "object": "file", "deleted": True})
    return JsonResponse(file_store.file_object(found))


async def _chunks(chunks: Iterator[bytes]) -> AsyncIterator[bytes]:
    read = sync_to_async(next, thread_sensitive=False)
    try:
        while (chunk := await read(chunks, None)) is not None:
            yield chunk
    finally:
        await sync_to_async(chunks.close, thread_sensitive=False)()


@api_view("GET")
async def file_content(request: HttpRequest, file_id: str) -> HttpResponse:
    """``GET /v1/files/{id}/content``: the file's bytes as stored (``application/jsonl``, with
    ``Content-Length`` and an attachment's ``Content-Disposition`` naming its filename).

    Raises:
        APIError: 404 for another tenant's file, or one whose bytes are gone from the storage.
    """
    key = await authenticate(request)
    found = await file_store.get(key.tenant_id, file_id)
    chunks = file_store.content_chunks(found)
    try:
        first = await sync_to_async(next, thread_sensitive=False)(chunks, b"")
    except FileNotFoundError as exc:
        raise file_store.not_found(file_id) from exc
    response = StreamingHttpResponse(_chunks_after(first, chunks),
                                     content_type=file_store.CONTENT_TYPES[found.purpose])
    response["Content-Length"] = str(found.bytes)
    response["Content-Disposition"] = content_disposition_header(True, found.filename)
    return response


async def _chunks_after(first: bytes, chunks: Iterator[bytes]) -> AsyncIterator[bytes]:
    if first:
        yield first
    async for chunk in _chunks(chunks):
        yield chunk
