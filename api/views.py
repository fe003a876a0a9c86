"""The OpenAI-compatible REST API and the health and stats endpoints.

Views translate HTTP to calls and back: validation lives in :mod:`api.schemas`, admission (rate
limits, budget, gate 1) in :mod:`api.admission`, response shapes in :mod:`api.responses`.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import redis.exceptions
from asgiref.sync import sync_to_async
from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.db import connection
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt

from api import admission, responses
from api.conf import platform_settings, redis_keys
from api.errors import APIError
from api.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerationRequest,
    parse_json_body,
    validate,
)
from api.sse import DONE, KEEPALIVE, sse_data
from api.tokens import count_chat_tokens, count_text_tokens
from inference.protocol import RequestMessage
from tenants.models import ApiKey
from tenants.selectors import aauthenticate_key

log = logging.getLogger(__name__)

View = Callable[..., Awaitable[HttpResponse]]

ANY_METHOD = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


def unexpected_error(exc: Exception) -> APIError:
    """The client-facing error for an exception that is not an :class:`APIError` (logged here).

    Redis trouble (connection lost, connection pool exhausted under a burst) is transient: 503
    with ``Retry-After``. Anything else is a 500 that names nothing internal.
    """
    if isinstance(exc, redis.exceptions.RedisError):
        log.exception("Redis is unavailable: %s", exc)
        return APIError(503, "The server is temporarily unable to handle the request; retry "
                        "shortly.", code="service_unavailable", retry_after_s=1)
    log.exception("Unexpected error while serving a request")
    return APIError(500, "The server had an error while processing your request.",
                    code="internal_error")


def api_view(*methods: str) -> Callable[[View], View]:
    """Allow ``methods`` only, skip CSRF (bearer auth), and answer every error as a JSON body.

    :class:`APIError` becomes its own body; any other exception goes through
    :func:`unexpected_error` (503 for Redis trouble, else 500), never Django's HTML page.
    """

    def decorate(view: View) -> View:
        @csrf_exempt
        @functools.wraps(view)
        async def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
            if request.method not in methods:
                return APIError(405, f"Method {request.method} is not allowed here.",
                                code="method_not_allowed", type="invalid_request_error").response()
            try:
                return await view(request, *args, **kwargs)
            except APIError as exc:
                return exc.response()
            except Exception as exc:  # noqa: BLE001 - answered as JSON and logged
                return unexpected_error(exc).response()

        return wrapper

    return decorate


def read_body(request: HttpRequest) -> bytes:
    """The request body.

    Raises:
        APIError: 413 for a body over ``DATA_UPLOAD_MAX_MEMORY_SIZE``.
    """
    try:
        return request.body
    except RequestDataTooBig as exc:
        limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        raise APIError(413, f"The request body is larger than the limit of {limit} bytes.",
                       code="request_too_large", should_retry=False) from exc


def _bearer(request: HttpRequest) -> str:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


async def authenticate(request: HttpRequest) -> ApiKey:
    """The API key of a request's ``Authorization: Bearer`` header.

    Raises:
        APIError: 401 for a missing, unknown or revoked key.
    """
    raw = _bearer(request)
    if not raw:
        raise APIError(401, "Missing API key: send 'Authorization: Bearer <key>'.",
                       code="missing_api_key")
    key = await aauthenticate_key(raw)
    if key is None:
        raise APIError(401, "Incorrect or revoked API key.", code="invalid_api_key")
    return key


def _check_model(name: str) -> str:
    served = platform_settings()["SERVED_MODEL_NAME"]
    if name != served:
        raise APIError(404, f"The model '{name}' does not exist; this server serves '{served}'.",
                       param="model", code="model_not_found")
    return served


def _fairness_key(key: ApiKey, user: str | None) -> str:
    mode = platform_settings()["FAIRNESS_KEY"]
    tenant = key.tenant.slug
    if mode == "api_key":
        return f"{tenant}/key-{key.pk}"
    if mode == "user" and user:
        return f"{tenant}/user-{user}"
    return tenant


@api_view("POST")
async def chat_completions(request: HttpRequest) -> HttpResponse:
    """``POST /v1/chat/completions``."""
    key = await authenticate(request)
    req = validate(ChatCompletionRequest, parse_json_body(read_body(request)))
    model = _check_model(req.model)
    messages = [m.as_dict() for m in req.messages]
    return await _generate(request, key, req, model, messages=messages)


@api_view("POST")
async def completions(request: HttpRequest) -> HttpResponse:
    """``POST /v1/completions``."""
    key = await authenticate(request)
    req = validate(CompletionRequest, parse_json_body(read_body(request)))
    model = _check_model(req.model)
    return await _generate(request, key, req, model, prompt=req.prompt)


async def _generate(
    request: HttpRequest,
    key: ApiKey,
    req: GenerationRequest,
    model: str,
    *,
    messages: list[dict[str, str]] | None = None,
    prompt: str | None = None,
) -> HttpResponse:
    conf = platform_settings()
    tenant = key.tenant
    request_id = uuid.uuid4().hex
    kind = "chat" if messages is not None else "text"
    shape = responses.ResponseShape(
        kind=kind, id=f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{request_id}",
        model=model, created=int(time.time()), include_usage=req.include_usage,
    )
    prompt_tokens = count_chat_tokens(messages) if messages is not None else count_text_tokens(
        prompt or "")
    max_tokens = req.requested_max_tokens
    message = RequestMessage(
        request_id=request_id,
        tenant=tenant.slug,
        fairness_key=_fairness_key(key, req.user),
        priority=tenant.tier.priority,
        fairness_weight=tenant.fairness_weight,
        messages=messages,
        prompt=prompt,
        sampling=req.sampling(max_tokens),
        default_max_tokens=conf["DEFAULT_MAX_TOKENS"],
        queue_deadline_s=conf["MAX_QUEUE_WAIT_S"],
        meta={"tenant_id": tenant.pk, "api_key_id": key.pk, "model": model,
              "public_id": shape.id},
    )
    await admission.admit(key, message, prompt_tokens + (max_tokens or conf["DEFAULT_MAX_TOKENS"]))
    worker_error = functools.partial(_worker_error, req)
    if req.stream:
        return await _stream(request_id, message.meta, shape, worker_error)
    return await _complete(request_id, message.meta, shape, worker_error)


def _worker_error(req: GenerationRequest, error: dict[str, Any]) -> APIError:
    """The client-facing error for a worker's error, naming the field the client wrote.

    The worker does not know the API's field names: a context overflow names the field that set
    max_tokens when the client gave one, else the prompt's field.
    """
    exc = APIError.from_worker(error)
    if exc.code == "context_length_exceeded":
        exc.param = req.max_tokens_param or req.prompt_param
    return exc


WorkerError = Callable[[dict[str, Any]], APIError]


async def _end(request_id: str, meta: dict[str, Any], finished: bool) -> None:
    """Abort an unfinished request in its worker and give back its concurrency lease."""
    try:
        if not finished:
            await admission.abort(request_id)
    finally:
        await admission.release(meta)


async def _complete(request_id: str, meta: dict[str, Any], shape: responses.ResponseShape,
                    worker_error: WorkerError) -> HttpResponse:
    idle = platform_settings()["REQUEST_IDLE_TIMEOUT_S"]
    parts: list[str] = []
    final: dict[str, Any] | None = None
    try:
        async for event in admission.events(request_id, idle):
            if event["type"] == "token":
                parts.append(event["text"])
            elif event["type"] == "final":
                final = event
    finally:
        # Also runs when the client disconnects: the view is cancelled and the worker aborts.
        await asyncio.shield(_end(request_id, meta, finished=final is not None))
    assert final is not None
    if final["finish_reason"] == "error":
        raise worker_error(final["error"])
    text = "".join(parts) + final["text"]
    return JsonResponse(responses.full_response(shape, text, final))


async def _stream(request_id: str, meta: dict[str, Any], shape: responses.ResponseShape,
                  worker_error: WorkerError) -> HttpResponse:
    conf = platform_settings()
    events = admission.events(request_id, conf["REQUEST_IDLE_TIMEOUT_S"],
                              first_timeout_s=conf["STREAM_DECISION_TIMEOUT_S"])
    # The status is decided before the first byte: wait (bounded) for the worker's first event.
    try:
        first = await anext(events)
    except BaseException:
        await asyncio.shield(_end(request_id, meta, finished=False))
        raise
    if first["type"] == "final" and first["finish_reason"] == "error":
        await _end(request_id, meta, finished=True)
        raise worker_error(first["error"])
    response = StreamingHttpResponse(
        _sse_events(request_id, meta, shape, first, events, worker_error),
        content_type="text/event-stream",
    )
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"
    return response


async def _sse_events(
    request_id: str,
    meta: dict[str, Any],
    shape: responses.ResponseShape,
    first: dict[str, Any],
    events: AsyncIterator[dict[str, Any]],
    worker_error: WorkerError,
) -> AsyncIterator[str]:
    finished = False
    try:
        opening = responses.opening_chunk(shape)
        if opening is not None:
            yield sse_data(opening)
        event: dict[str, Any] | None = first
        while event is not None:
            if event["type"] == "waiting":
                yield KEEPALIVE
            elif event["type"] == "token":
                if event["text"]:
                    yield sse_data(responses.text_chunk(shape, event["text"]))
            elif event["type"] == "final":
                finished = True
                if event["finish_reason"] == "error":
                    yield sse_data(worker_error(event["error"]).body())
                    return
                if event["text"]:
                    yield sse_data(responses.text_chunk(shape, event["text"]))
                yield sse_data(responses.finish_chunk(shape, event["finish_reason"]))
                if shape.include_usage:
                    yield sse_data(responses.usage_chunk(shape, event))
                yield DONE
                return
            event = await anext(events, None)
    except APIError as exc:
        yield sse_data(exc.body())
    except Exception as exc:  # noqa: BLE001 - the status is sent: end with an error event
        yield sse_data(unexpected_error(exc).body())
    finally:
        try:
            await asyncio.shield(_end(request_id, meta, finished))
        except Exception:  # noqa: BLE001 - the response is over; the lease expires on its own
            log.exception("Could not end request %s", request_id)


@api_view(*ANY_METHOD)
async def not_found(request: HttpRequest, path: str = "") -> HttpResponse:
    """Any other path under ``/v1/``: a JSON 404."""
    raise APIError(404, f"Invalid URL ({request.method} {request.path}): no such endpoint.",
                   code="not_found")


@api_view("GET")
async def list_models(request: HttpRequest) -> HttpResponse:
    """``GET /v1/models``: the one served model."""
    await authenticate(request)
    served = platform_settings()["SERVED_MODEL_NAME"]
    return JsonResponse({"object": "list", "data": [responses.model_object(served)]})


@api_view("GET")
async def retrieve_model(request: HttpRequest, model: str) -> HttpResponse:
    """``GET /v1/models/{model}``."""
    await authenticate(request)
    return JsonResponse(responses.model_object(_check_model(model)))


async def _is_staff(request: HttpRequest) -> bool:
    user = await request.auser()
    return bool(user.is_authenticated and user.is_staff)


@api_view("GET")
async def scheduler_stats(request: HttpRequest) -> HttpResponse:
    """``GET /scheduler/stats``: each live worker's stats snapshot and their sum.

    For staff users (session) and operator keys only: 401 without credentials, 403 otherwise.
    """
    if not await _is_staff(request):
        key = await authenticate(request)
        if not key.is_operator:
            raise APIError(403, "Only operator keys and staff users may read scheduler stats.",
                           code="forbidden")
    client = admission.aredis()
    keys = redis_keys()
    workers = await admission.live_workers()
    raw = await client.mget([keys.stats(w) for w in workers]) if workers else []
    snapshots = {w: json.loads(r) for w, r in zip(workers, raw, strict=True) if r}
    queued = int(await client.get(keys.queue) or 0)
    return JsonResponse({
        "gate1": {"queued": queued, "max_queue_size": platform_settings()["MAX_QUEUE_SIZE"]},
        "workers": snapshots,
        "total": responses.sum_stats(list(snapshots.values())),
    })


@api_view("GET")
async def healthz(request: HttpRequest) -> HttpResponse:
    """``GET /healthz``: the web process is up."""
    return JsonResponse({"status": "ok"})


def _ping_database() -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")


@api_view("GET")
async def readyz(request: HttpRequest) -> HttpResponse:
    """``GET /readyz``: the database, Redis and at least one worker answer (else 503)."""
    checks: dict[str, Any] = {}
    try:
        await sync_to_async(_ping_database)()
        checks["database"] = "ok"
    except Exception as exc:  # noqa: BLE001 - any failure means not ready
        checks["database"] = f"error: {exc}"
    try:
        await admission.aredis().ping()
        checks["redis"] = "ok"
        workers = await admission.live_workers()
        checks["workers"] = len(workers) if workers else "error: no live worker"
    except Exception as exc:  # noqa: BLE001
        checks["redis"] = f"error: {exc}"
        checks["workers"] = "unknown"
    ready = all(v == "ok" or isinstance(v, int) for v in checks.values())
    return JsonResponse({"status": "ok" if ready else "unavailable", "checks": checks},
                        status=200 if ready else 503)
