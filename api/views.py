"""The OpenAI-compatible REST API (chat and text completions) and the health and stats
endpoints.

Views translate HTTP to calls and back: validation lives in :mod:`api.schemas`, the request's life
(admission, events, abort, release) in :mod:`gateway.lifecycle`, response shapes in
:mod:`api.responses`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.views import defaults
from django.views.decorators.csrf import csrf_exempt

from api import responses
from api.answers import AnswerResponse
from api.bodies import parse_json_body
from api.schemas import ChatCompletionRequest, CompletionRequest, GenerationRequest, validate
from api.sse import DONE, KEEPALIVE, sse_data
from gateway import lifecycle, monitor, ratelimits, workers
from gateway.adapters import Target, resolve_target
from gateway.admission import Principal
from gateway.clients import aredis
from gateway.conf import platform_settings, redis_keys
from gateway.credentials import authenticate_headers
from gateway.errors import APIError, request_too_large, unexpected_error
from gateway.events import Waiting
from gateway.lifecycle import Generation
from gateway.tokenizer_folders import use_tokenizer
from inference.protocol.events import ErrorInfo, Event, FinalEvent
from inference.protocol.messages import Sampling
from tenants.models import ApiKey

log = logging.getLogger(__name__)

View = Callable[..., Awaitable[HttpResponse]]

ANY_METHOD = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")
# Paths whose errors are JSON bodies (the API, the stats and health endpoints).
API_PATH_PREFIXES = ("/v1", "/scheduler/", "/healthz", "/readyz", "/metrics")


def api_view(*methods: str) -> Callable[[View], View]:
    """Allow ``methods`` only (and ``HEAD`` wherever ``GET`` is: the same status and headers, the
    server sends no body), skip CSRF (bearer auth), and answer every error as a JSON body.

    Another method gets 405 ``method_not_allowed`` with ``Allow``. :class:`APIError` becomes its
    own body; any other exception goes through :func:`unexpected_error` (503 for Redis trouble,
    else 500), never Django's HTML page.
    """
    allowed = (*methods, "HEAD") if "GET" in methods and "HEAD" not in methods else methods

    def decorate(view: View) -> View:
        @csrf_exempt
        @functools.wraps(view)
        async def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
            if request.method not in allowed:
                return APIError(405, f"Method {request.method} is not allowed here.",
                                code="method_not_allowed", type="invalid_request_error",
                                extra_headers={"Allow": ", ".join(allowed)}).response()
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

    The web process refuses a body over ``MAX_BODY_BYTES`` before reading it
    (:mod:`llm_platform.http_guard`); Django's ``DATA_UPLOAD_MAX_MEMORY_SIZE``, the same number,
    refuses one that reaches Django another way.

    Raises:
        APIError: 413 :func:`~gateway.errors.request_too_large` for a body over
            ``DATA_UPLOAD_MAX_MEMORY_SIZE``.
    """
    try:
        return request.body
    except RequestDataTooBig as exc:
        raise request_too_large(settings.DATA_UPLOAD_MAX_MEMORY_SIZE) from exc


async def authenticate(request: HttpRequest) -> ApiKey:
    """The API key of a request's ``Authorization: Bearer`` header
    (:func:`gateway.credentials.authenticate_headers`).

    Raises:
        APIError: 401 for a missing, malformed, unknown or revoked key.
    """
    return await authenticate_headers(request.headers)


@api_view("POST")
async def chat_completions(request: HttpRequest) -> HttpResponse:
    """``POST /v1/chat/completions``.

    Special-token text inside a message's content is ordinary text (several tokens), never a
    control token of the chat template (``inference.tokenization.Tokenizer.chat_ids``).
    """
    key = await authenticate(request)
    req = validate(ChatCompletionRequest, parse_json_body(read_body(request)))
    target = await resolve_target(key, req.model)
    messages = [m.as_dict() for m in req.messages]
    return await _generate(request, key, req, target, messages=messages, tools=req.prompt_tools)


@api_view("POST")
async def completions(request: HttpRequest) -> HttpResponse:
    """``POST /v1/completions``.

    The raw ``prompt`` is the client's own text, given to the model as is: special-token text
    in it (``<|im_end|>``, ``<|endoftext|>``) is the control token, as OpenAI and vLLM parse it
    (``docs/design.md``, section 9).
    """
    key = await authenticate(request)
    req = validate(CompletionRequest, parse_json_body(read_body(request)))
    return await _generate(request, key, req, await resolve_target(key, req.model),
                           prompt=req.prompt)


async def _generate(
    request: HttpRequest,
    key: ApiKey,
    req: GenerationRequest,
    target: Target,
    *,
    messages: list[dict[str, Any]] | None = None,
    prompt: str | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> HttpResponse:
    request_id = uuid.uuid4().hex
    shape = response_shape(req, target.name, request_id, chat=messages is not None,
                           tools=tools is not None)
    with use_tokenizer(target.model.tokenizer_folder):  # counted with its base model's
        generation = await lifecycle.start(
            Principal.for_api_key(key), request_id=request_id, messages=messages, prompt=prompt,
            tools=tools, sampling=Sampling(**req.sampling(req.requested_max_tokens)),
            default_max_tokens=platform_settings()["DEFAULT_MAX_TOKENS"], user=req.user,
            meta={"model": target.model.name, "public_id": shape.id, "stream": bool(req.stream)},
            adapter=target.adapter)
    on_error = functools.partial(worker_error, req)
    limits = ratelimits.response_headers(generation.meta)
    try:
        if req.stream:
            response = await _stream(generation, shape, on_error)
        else:
            response = await _complete(generation, shape, on_error)
    except APIError as exc:  # admitted, so it counted against the limits too
        exc.extra_headers.update(limits)
        raise
    for name, value in limits.items():
        response[name] = value
    return response


def response_shape(req: GenerationRequest, model: str, request_id: str, *, chat: bool,
                   tools: bool) -> responses.ResponseShape:
    """The shape of the answer to ``req`` (a chat's when ``chat``; ``tools``: it offers tools),
    its id ``chatcmpl-{request_id}`` or ``cmpl-{request_id}``."""
    return responses.ResponseShape(
        kind="chat" if chat else "text", id=f"{'chatcmpl' if chat else 'cmpl'}-{request_id}",
        model=model, created=int(time.time()), include_usage=req.include_usage,
        logprobs=req.token_logprobs is not None, echo=req.echoed_prompt, tools=tools,
        calls_only=getattr(req, "calls_only", False), n=req.n)


def worker_error(req: GenerationRequest, error: ErrorInfo) -> APIError:
    """The client-facing error for a worker's error, naming the field the client wrote.

    The worker does not know the API's field names: a context overflow names the prompt's field
    when the prompt alone fills the context, else the field that set max_tokens when the client
    gave one, else the prompt's field.
    """
    exc = APIError.from_worker(error)
    if exc.code == "context_length_exceeded":
        prompt_tokens = error.details.get("prompt_tokens")
        context = error.details.get("max_model_len")
        prompt_alone = (isinstance(prompt_tokens, int) and isinstance(context, int)
                        and prompt_tokens >= context)
        exc.param = (req.prompt_param if prompt_alone
                     else req.max_tokens_param or req.prompt_param)
    return exc


WorkerError = Callable[[ErrorInfo], APIError]


async def _complete(generation: Generation, shape: responses.ResponseShape,
                    worker_error: WorkerError) -> HttpResponse:
    answer = responses.Choices(shape)
    try:
        async for event in generation.events():
            answer.add(event)
        final = generation.final
        assert final is not None
        if responses.failed(final):
            assert final.error is not None
            raise worker_error(final.error)
        # Ended once the answer was handed to the server, not before (api.answers).
        return AnswerResponse(answer.body(final), generation.close)
    except BaseException:
        # Also when the client disconnects: the view is cancelled and the worker aborts.
        await asyncio.shield(generation.close())
        raise


async def _stream(generation: Generation, shape: responses.ResponseShape,
                  worker_error: WorkerError) -> HttpResponse:
    conf = platform_settings()
    # The status waits (bounded) for the worker's first event; then a comment keeps a quiet
    # stream open through proxies with an idle timeout. The events each read found go out in
    # one write (a worker sends a stream's tokens two at a time: inference.worker.publisher).
    batches = generation.event_batches(first_timeout_s=conf["STREAM_DECISION_TIMEOUT_S"],
                                       keepalive_s=conf["SSE_KEEPALIVE_S"])
    # The status is decided before the first byte: wait (bounded) for the worker's first event.
    try:
        first = await anext(batches)
    except BaseException:
        await generation.close()
        raise
    if (not isinstance(first, Waiting) and isinstance(first[0], FinalEvent)
            and first[0].error is not None and responses.failed(first[0])):
        await generation.close()
        raise worker_error(first[0].error)
    response = StreamingHttpResponse(
        _sse_events(generation, shape, first, batches, worker_error),
        content_type="text/event-stream",
    )
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"
    return response


async def _sse_events(
    generation: Generation,
    shape: responses.ResponseShape,
    first: list[Event] | Waiting,
    batches: AsyncIterator[list[Event] | Waiting],
    worker_error: WorkerError,
) -> AsyncIterator[str]:
    """The SSE body: what each read of the worker's events found, in one write, its text
    chunks of a choice merged into one (:func:`api.responses.merged_text_chunks`)."""
    answer = responses.Choices(shape)
    try:
        for opening in responses.opening_chunks(shape):
            yield sse_data(opening)
        batch: list[Event] | Waiting | None = first
        while batch is not None:
            if isinstance(batch, Waiting):
                yield KEEPALIVE
                batch = await anext(batches, None)
                continue
            event = batch[-1]
            if isinstance(event, FinalEvent):  # alone in its batch (Generation.event_batches)
                if event.error is not None and responses.failed(event):
                    yield sse_data(worker_error(event.error).stream_body())
                    return
                out = [*answer.chunks(event), *answer.finish_chunks(event)]
                if shape.include_usage:
                    out.append(responses.usage_chunk(shape, event))
                yield "".join([*map(sse_data, out), DONE])
                return
            chunks = [c for e in batch for c in answer.chunks(e)]
            if batch[0].seq > 0:  # the first event's (an echo, then the first token) stay apart
                chunks = responses.merged_text_chunks(chunks)
            if text := "".join(map(sse_data, chunks)):
                yield text.encode()  # bytes: Django would look its charset up for each write
            generation.sent(event.seq)  # resumed once its chunks were handed to the client
            batch = await anext(batches, None)
    except APIError as exc:
        yield sse_data(exc.stream_body())
    except Exception as exc:  # noqa: BLE001 - the status is sent: end with an error event
        yield sse_data(unexpected_error(exc).stream_body())
    finally:
        try:
            await generation.close()
        except Exception:  # noqa: BLE001 - the response is over; the lease expires on its own
            log.exception("Could not end request %s", generation.request_id)


def bad_request(request: HttpRequest, exception: Exception) -> HttpResponse:
    """Django's 400 handler (``handler400``): JSON under the API's paths, else Django's page.

    Django answers this way when it refuses a request before any view runs, e.g. a ``Host``
    header not in ``ALLOWED_HOSTS``.
    """
    if request.path.startswith(API_PATH_PREFIXES):
        return APIError(400, "Bad request: the request was refused before reaching the API "
                        "(check the Host header).", code="bad_request").response()
    return defaults.bad_request(request, exception)


@api_view(*ANY_METHOD)
async def not_found(request: HttpRequest, path: str = "") -> HttpResponse:
    """Any other path under ``/v1/``: a JSON 404."""
    raise APIError(404, f"Invalid URL ({request.method} {request.path}): no such endpoint.",
                   code="not_found")


async def _is_staff(request: HttpRequest) -> bool:
    user = await request.auser()
    return bool(user.is_authenticated and user.is_staff)


@api_view("GET")
async def scheduler_stats(request: HttpRequest) -> HttpResponse:
    """``GET /scheduler/stats``: gate 1, the shared queue (per fairness key: its shared counter and
    requests in flight), each live worker's stats snapshot and their aggregate; the same per
    base model under ``models`` (each model's queue, gate 1 and workers are its own). The
    top-level ``gate1`` counts every model's requests; ``queue`` is the default model's.

    For staff users (session) and operator keys only: 401 without credentials, 403 otherwise.
    """
    if not await _is_staff(request):
        key = await authenticate(request)
        if not key.is_operator:
            raise APIError(403, "Only operator keys and staff users may read scheduler stats.",
                           code="forbidden")
    snapshots = await workers.worker_snapshots()
    models = await workers.per_model(snapshots)
    return JsonResponse({
        "gate1": workers.gate1(sum(m["gate1"]["queued"] for m in models.values())),
        "queue": await workers.queue_state(),
        "models": models,
        # Requests ended whose usage record is not written yet (gateway.usage).
        "usage_pending": await aredis().hlen(redis_keys().usage_pending),
        "workers": snapshots,
        "total": workers.aggregate(list(snapshots.values())),
    })


@api_view("GET")
async def healthz(request: HttpRequest) -> HttpResponse:
    """``GET /healthz``: the web process is up."""
    return JsonResponse({"status": "ok"})


def _ping_database() -> None:
    """Read a table every request reads (API keys): a database that answers ``SELECT 1`` but
    lost its tables (an empty file in place of the real one) is not ready."""
    ApiKey.objects.only("pk").first()


@api_view("GET")
async def readyz(request: HttpRequest) -> HttpResponse:
    """``GET /readyz``: the database, Redis and at least one worker answer, and this web process is
    not draining (else 503, with ``Retry-After``, and what failed in ``checks``)."""
    checks: dict[str, Any] = {}
    try:
        await sync_to_async(_ping_database)()
        checks["database"] = "ok"
    except Exception as exc:  # noqa: BLE001 - any failure means not ready
        checks["database"] = f"error: {exc}"
    try:
        await aredis().ping()
        checks["redis"] = "ok"
        alive = await workers.beating_workers()
        checks["workers"] = len(alive) if alive else "error: no live worker"
    except Exception as exc:  # noqa: BLE001
        checks["redis"] = f"error: {exc}"
        checks["workers"] = "unknown"
    if monitor.DRAINING.is_set():
        checks["web"] = "error: draining (shutting down)"
    ready = all(v == "ok" or isinstance(v, int) for v in checks.values())
    return JsonResponse({"status": "ok" if ready else "unavailable", "checks": checks},
                        status=200 if ready else 503,
                        headers=None if ready else {"Retry-After": "1"})
