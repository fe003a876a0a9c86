"""The Responses API: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``,
``GET /v1/responses/{id}/input_items``.

A response is a chat completion in another shape (:mod:`api.response_chat`): the same request
lifecycle (:mod:`gateway.lifecycle`: limits, budgets, fairness, billing what the client got, the
abort when the client leaves), its output and stream events built by
:mod:`api.response_events`, and, with ``store`` (the default), kept per tenant
(:mod:`api.response_store`).

A stored response is written ``in_progress`` once its request is admitted and ended once:
``completed``, ``incomplete`` (``max_output_tokens``), ``failed`` (its error in ``error``) or
``cancelled`` (its client left; the output it was sent is kept, a whole answer it never got is
not). A request answered with an HTTP error (refused, or failed before any output) leaves none.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from asgiref.sync import sync_to_async
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse

from api import response_store
from api.answers import AnswerResponse
from api.bodies import parse_json_body
from api.models import StoredResponse
from api.response_chat import Turn, as_chat, chat_messages, chat_request
from api.response_events import (
    END_EVENTS,
    OutputShape,
    ResponseOutput,
    ended,
    error_object,
    merged_deltas,
    outcome,
)
from api.response_fields import ResponsesRequest, input_items, parse_request
from api.responses import failed
from api.sse import KEEPALIVE, sse_event
from api.views import api_view, authenticate, read_body, worker_error
from gateway import lifecycle, monitor, ratelimits
from gateway.adapters import Target, resolve_target
from gateway.admission import Principal
from gateway.conf import platform_settings
from gateway.errors import APIError, unexpected_error
from gateway.events import Waiting
from gateway.lifecycle import Generation
from gateway.tokenizer_folders import use_tokenizer
from inference.protocol.events import ErrorInfo, FinalEvent, TokenEvent
from inference.protocol.messages import Sampling
from tenants.models import ApiKey

log = logging.getLogger(__name__)

MAX_LIST_LIMIT = 100


def _tools_echo(req: ResponsesRequest) -> list[Any]:
    return [{"type": "function", "description": None, "parameters": None, "strict": None,
             **tool} for tool in req.tools or ()]


def _created(req: ResponsesRequest, response_id: str, model: str) -> dict[str, Any]:
    """The response object as created (``in_progress``, no output yet)."""
    return {"id": response_id, "object": "response", "created_at": int(time.time()),
            "status": "in_progress", "error": None, "incomplete_details": None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "model": model, "output": [], "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "temperature": req.temperature, "top_p": req.top_p,
            "text": {"format": req.text_format}, "tool_choice": req.tool_choice or "auto",
            "tools": _tools_echo(req), "truncation": "disabled", "usage": None,
            "metadata": req.metadata or {}, "store": req.store, "user": req.user,
            "background": False, "completed_at": None}


class Relay:
    """One response being answered: its generation, output, and stored row (when ``store``)."""

    def __init__(self, generation: Generation, body: dict[str, Any], shape: OutputShape,
                 stored: bool, turns: list[Turn], chat: Any):
        self.generation = generation
        self.body = body
        self.output = ResponseOutput(shape)
        self.stored = stored
        self.ended = False
        self._error = functools.partial(worker_error, chat)
        self._turns = turns

    @property
    def id(self) -> str:
        return self.body["id"]

    def error(self, info: ErrorInfo) -> APIError:
        """The client's error for a worker's error, naming the Responses request's field."""
        return as_chat(self._error(info), self._turns)

    def end(self, final: FinalEvent | None, failure: APIError | None = None
            ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The ended response and the stream events closing its output."""
        if final is None:
            status, incomplete, error = "failed", None, error_object(failure) if failure else None
        else:
            status, incomplete, error = outcome(final, failure)
        events = self.output.finish(status)
        usage = final.usage if final is not None and failure is None else None
        return ended(self.body, status, self.output.items, usage=usage,
                     incomplete=incomplete, error=error), events

    async def store(self, body: dict[str, Any]) -> None:
        self.ended = True
        if not self.stored:
            return
        try:
            await response_store.finish(self.id, body)
        except Exception as exc:  # noqa: BLE001 - the client is answered; the sweep ends it
            unexpected_error(exc)

    async def cancelled(self, sent: bool) -> None:
        """The client left: abort, and store what it was sent (``sent``: a stream's output)."""
        try:
            await self.generation.close()
        finally:
            if not self.ended:
                self.output.finish("cancelled")
                output = self.output.items if sent else []
                await self.store(ended(self.body, "cancelled", output))


@api_view("POST")
async def create_response(request: HttpRequest) -> HttpResponse:
    """``POST /v1/responses`` (see the module docstring)."""
    key = await authenticate(request)
    req = parse_request(parse_json_body(read_body(request)))
    target = await resolve_target(key, req.model)
    previous = (await response_store.previous(key.tenant_id, req.previous_response_id)
                if req.previous_response_id else None)
    items = input_items(req.input)
    history = (await sync_to_async(_chain_messages)(previous)) if previous else []
    chat, turns = chat_request(req, history + chat_messages(items, "input"))
    shape = OutputShape(tools=chat.prompt_tools is not None, calls_only=chat.calls_only)
    generation = await _start(key, chat, req, target)
    body = _created(req, f"resp_{generation.request_id}", target.name)
    relay = Relay(generation, body, shape, req.store, turns, chat)
    limits = ratelimits.response_headers(generation.meta)
    try:
        if req.store:
            try:
                await response_store.create(
                    body["id"], tenant_id=key.tenant_id, api_key_id=key.pk, previous=previous,
                    request_id=generation.request_id, web_id=monitor.WEB_ID, body=body,
                    input_items=items, shape=shape)
            except BaseException:
                await asyncio.shield(generation.close())
                raise
        response = await (_stream(relay) if req.stream else _complete(relay))
    except APIError as exc:
        exc.extra_headers.update(limits)
        raise
    for name, value in limits.items():
        response[name] = value
    return response


def _chain_messages(previous: StoredResponse) -> list[Turn]:
    return chat_messages(response_store.chain_items(previous), "previous_response_id")


async def _start(key: ApiKey, chat: Any, req: ResponsesRequest, target: Target) -> Generation:
    request_id = uuid.uuid4().hex
    with use_tokenizer(target.model.tokenizer_folder):  # counted with its base model's
        return await lifecycle.start(
            Principal.for_api_key(key), request_id=request_id,
            messages=[m.as_dict() for m in chat.messages], tools=chat.prompt_tools,
            sampling=Sampling(**chat.sampling(chat.requested_max_tokens)),
            default_max_tokens=platform_settings()["DEFAULT_MAX_TOKENS"], user=chat.user,
            meta={"model": target.model.name, "public_id": f"resp_{request_id}",
                  "stream": bool(req.stream)}, adapter=target.adapter)


async def _refused(relay: Relay, exc: APIError) -> APIError:
    """A request answered with an HTTP error leaves no stored response."""
    relay.ended = True
    if relay.stored:
        await asyncio.shield(response_store.forget(relay.id))
    return exc


async def _complete(relay: Relay) -> HttpResponse:
    generation = relay.generation
    try:
        async for event in generation.events():
            relay.output.feed(event)
    except asyncio.CancelledError:  # the client left: nothing was sent
        await asyncio.shield(relay.cancelled(sent=False))
        raise
    except BaseException as exc:  # answered with an error (api_view's for any other)
        await asyncio.shield(generation.close())
        await _refused(relay, exc if isinstance(exc, APIError) else unexpected_error(exc))
        raise
    final = generation.final
    assert final is not None
    if failed(final):
        await generation.close()
        assert final.error is not None
        raise await _refused(relay, relay.error(final.error))
    try:
        body, _ = relay.end(final)
        await relay.store(body)
    except BaseException:
        await asyncio.shield(generation.close())
        raise
    # Ended once the answer was handed to the server, not before (api.answers).
    return AnswerResponse(body, generation.close)


async def _stream(relay: Relay) -> HttpResponse:
    conf = platform_settings()
    generation = relay.generation
    # What each read of the worker's events found goes out in one write (as the completions'
    # stream: api.views).
    batches = generation.event_batches(first_timeout_s=conf["STREAM_DECISION_TIMEOUT_S"],
                                       keepalive_s=conf["SSE_KEEPALIVE_S"])
    try:
        first = await anext(batches)
    except asyncio.CancelledError:
        await asyncio.shield(relay.cancelled(sent=False))
        raise
    except BaseException as exc:
        await asyncio.shield(generation.close())
        await _refused(relay, exc if isinstance(exc, APIError) else unexpected_error(exc))
        raise
    if (not isinstance(first, Waiting) and isinstance(first[0], FinalEvent)
            and first[0].error is not None and failed(first[0])):
        await generation.close()
        raise await _refused(relay, relay.error(first[0].error))
    response = StreamingHttpResponse(_sse(relay, first, batches),
                                     content_type="text/event-stream")
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"
    return response


class _Sequence:
    def __init__(self) -> None:
        self.next = 0

    def frame(self, event: dict[str, Any]) -> str:
        event = {"type": event["type"], "sequence_number": self.next,
                 **{k: v for k, v in event.items() if k != "type"}}
        self.next += 1
        return sse_event(event["type"], event)


async def _sse(relay: Relay, first: Any, batches: AsyncIterator[Any]) -> AsyncIterator[str]:
    generation, seq = relay.generation, _Sequence()
    try:
        yield (seq.frame({"type": "response.created", "response": relay.body})
               + seq.frame({"type": "response.in_progress", "response": relay.body}))
        batch = first
        while batch is not None:
            if isinstance(batch, Waiting):
                yield KEEPALIVE
            elif isinstance(batch[-1], TokenEvent):  # a final comes alone (event_batches)
                if text := "".join(seq.frame(out) for out in merged_deltas(
                        [out for event in batch for out in relay.output.feed(event)])):
                    yield text.encode()  # bytes: Django would look its charset up for each one
                generation.sent(batch[-1].seq)  # resumed once its events were handed over
            else:
                event = batch[-1]
                failure = relay.error(event.error) if event.error is not None and failed(
                    event) else None
                if failure is None and (text := "".join(
                        seq.frame(out) for out in relay.output.feed(event))):
                    yield text
                yield "".join(await _end_frames(relay, seq, event, failure))
                return
            batch = await anext(batches, None)
    except APIError as exc:
        yield "".join(await _end_frames(relay, seq, None, exc))
    except Exception as exc:  # noqa: BLE001 - the status is sent: end with response.failed
        yield "".join(await _end_frames(relay, seq, None, unexpected_error(exc)))
    finally:
        await asyncio.shield(relay.cancelled(sent=True))


async def _end_frames(relay: Relay, seq: _Sequence, final: FinalEvent | None,
                      failure: APIError | None) -> list[str]:
    body, closing = relay.end(final, failure)
    await relay.store(body)
    frames = [seq.frame(out) for out in closing]
    frames.append(seq.frame({"type": END_EVENTS[body["status"]], "response": body}))
    return frames


@api_view("GET", "DELETE")
async def response_detail(request: HttpRequest, response_id: str) -> HttpResponse:
    """``GET /v1/responses/{id}`` (the response as stored) and ``DELETE`` (forgets it)."""
    key = await authenticate(request)
    found = await response_store.get(key.tenant_id, response_id)
    if request.method == "DELETE":
        await StoredResponse.objects.filter(pk=found.pk).adelete()
        return JsonResponse({"id": found.pk, "object": "response.deleted", "deleted": True})
    if request.GET.get("stream") not in (None, "false"):
        raise APIError(400, "'stream' is not supported here: a stored response is read whole.",
                       param="stream", code="unsupported_parameter")
    return JsonResponse(found.body)


def _list_limit(raw: str | None) -> int:
    try:
        limit = int(raw) if raw is not None else 20
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_LIST_LIMIT:
        raise APIError(400, f"Invalid value for 'limit': expected an integer from 1 to "
                            f"{MAX_LIST_LIMIT}.", param="limit", code="invalid_value")
    return limit


@api_view("GET")
async def response_input_items(request: HttpRequest, response_id: str) -> HttpResponse:
    """``GET /v1/responses/{id}/input_items``: the items its request sent, newest first unless
    ``order=asc``, ``limit`` (1 to 100, default 20) at a time after the item ``after``."""
    key = await authenticate(request)
    found = await response_store.get(key.tenant_id, response_id)
    order = request.GET.get("order", "desc")
    if order not in ("asc", "desc"):
        raise APIError(400, "Invalid value for 'order': expected 'asc' or 'desc'.",
                       param="order", code="invalid_value")
    limit = _list_limit(request.GET.get("limit"))
    items = list(found.input_items)
    if order == "desc":
        items.reverse()
    after = request.GET.get("after")
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise APIError(404, f"No input item with id '{after[:80]}' in this response.",
                           param="after", code="not_found")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return JsonResponse({"object": "list", "data": page,
                         "first_id": page[0]["id"] if page else None,
                         "last_id": page[-1]["id"] if page else None,
                         "has_more": len(items) > limit})
