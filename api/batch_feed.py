"""Feeding a batch's waiting lines to the workers (a step of :mod:`api.batch_runner`).

A line is checked as its endpoint checks a request (a 400 naming the field, or the 404 of a
model or LoRA adapter its batch's tenant or creating key may not call, goes to the error file),
counted with its base model's tokenizer, and admitted through the same lifecycle as an
interactive request (:func:`gateway.lifecycle.start`) as batch work. A refusal that a later
step may not meet leaves the line waiting: one of the tenant's limits (rate, concurrency;
:data:`HOLD_CODES`) stops the feeding until the next step; one of its base model's (no live
worker of it, its queue full: :data:`MODEL_HOLD_CODES`) leaves that model's later lines (its
adapters' too) waiting, while the lines of the other models go on.
"""

from __future__ import annotations

import time
from typing import Any

from django.utils import timezone

from api import batch_store, views
from api.batch_lines import output_line
from api.models import Batch, BatchLine
from api.schemas import ChatCompletionRequest, CompletionRequest, GenerationRequest, validate
from gateway import adapters, admission, lifecycle, model_registry
from gateway.admission import Principal
from gateway.clients import run_sync
from gateway.errors import APIError
from gateway.tokens import measure_here
from inference.protocol.messages import ADAPTER_SEPARATOR, Sampling

# Refusals that leave a line waiting for a later step (a limit that frees up, no worker now).
HOLD_CODES = frozenset({"rate_limit_exceeded", "concurrency_limit_exceeded", "queue_full",
                        "no_worker_available", "service_unavailable"})
# Those of one base model (its workers, its queue): its lines wait, the other models' go on.
MODEL_HOLD_CODES = frozenset({"queue_full", "no_worker_available"})


def line_request(row: Batch, body: dict[str, Any]) -> GenerationRequest:
    """A line's body checked as its endpoint (``row.endpoint``) checks a request (its model
    apart).

    Raises:
        APIError: as the endpoint answers (400 naming the field).
    """
    chat = row.endpoint == "/v1/chat/completions"
    req = validate(ChatCompletionRequest if chat else CompletionRequest, body)
    if req.stream:
        raise APIError(400, "Invalid value for 'stream': a batch's requests are answered "
                            "whole; leave it out or send false.", param="stream",
                       code="invalid_value")
    return req


def feed(step: Any) -> None:
    """Send ``step``'s waiting lines (an ``api.batch_runner._Step``), in order, until the lines
    in flight fill their ``BATCH_LINES_IN_FLIGHT`` slots or its time is up; sets its
    ``fed_all`` once every slot is filled or every waiting line was tried."""
    limit = step.conf["BATCH_LINES_IN_FLIGHT"]
    step.running = step.lines.filter(state=BatchLine.State.RUNNING).count()
    waiting = _waiting(step, -1, limit - step.running)
    if not waiting:
        step.fed_all = True
        return
    principal = batch_store.principal(step.row)
    if principal is None:  # its tenant is deactivated: its lines wait (the window runs)
        return
    access = batch_store.model_access(step.row)
    held: set[str] = set()  # models whose lines wait for a later step
    try:
        while waiting:
            for line in waiting:
                name = line.body.get("model") if isinstance(line.body, dict) else None
                if isinstance(name, str) and name.partition(ADAPTER_SEPARATOR)[0] in held:
                    continue  # its base model's lines wait
                if time.monotonic() > step.until or not send(step, line, principal, access,
                                                             held):
                    return
            waiting = _waiting(step, waiting[-1].index, limit - step.running)
        step.fed_all = True
    finally:
        step.save_lines()


def _waiting(step: Any, after: int, room: int) -> list[BatchLine]:
    """Up to ``room`` waiting lines of ``step``'s batch after index ``after``, in order."""
    return (list(step.lines.filter(state=BatchLine.State.WAITING, index__gt=after)
                 .order_by("index")[:room]) if room > 0 else [])


def send(step: Any, line: BatchLine, principal: Principal, access: model_registry.Access,
         held: set[str]) -> bool:
    """Admit ``line``'s request (a line of ``step``'s batch); False when the tenant's limits
    held it back (try again later); a model that held it back (:data:`MODEL_HOLD_CODES`) is
    added to ``held``."""
    row = step.row
    line.request_id = f"{row.pk}-{line.index}-{line.attempt}"
    model = None
    try:
        req = line_request(row, line.body)
        target = adapters.read_target(access, req.model)
        model = target.model
        context = run_sync(lifecycle.served_context(model.name))
        chat = isinstance(req, ChatCompletionRequest)
        messages = [m.as_dict() for m in req.messages] if chat else None
        tools, prompt = (req.prompt_tools, None) if chat else (None, req.prompt)
        try:
            count = measure_here(messages, prompt, None if context is None else context - 1,
                                 tools, folder=model.tokenizer_folder)
        except ValueError as exc:
            raise APIError(400, f"Invalid value for 'messages': {exc}", param="messages",
                           code="invalid_value") from exc
        refusal = lifecycle.context_refusal(count, req.requested_max_tokens, context,
                                            req.prompt_param)
        if refusal is not None:
            raise views.worker_error(req, refusal)
        public_id = f"{'chatcmpl' if chat else 'cmpl'}-{line.request_id}"
        generation = run_sync(lifecycle.start(
            principal, request_id=line.request_id, messages=messages, prompt=prompt,
            tools=tools, sampling=Sampling(**req.sampling(req.requested_max_tokens)),
            default_max_tokens=step.conf["DEFAULT_MAX_TOKENS"], user=req.user,
            meta={"model": model.name, "public_id": public_id, "stream": False,
                  "batch_id": row.pk}, adapter=target.adapter,
            prompt_tokens=count.tokens, batch_deadline_at=row.expires_at.timestamp()))
    except APIError as exc:
        if exc.code in MODEL_HOLD_CODES and model is not None:
            held.add(model.name)
            return True
        if exc.code in HOLD_CODES and exc.should_retry is not False:
            return False
        line.request_id = ""  # refused before it ran: no request
        line.state = BatchLine.State.FAILED
        line.result = output_line(line, exc.status, exc.body())
        step.changed(line)
        return True
    line.state = BatchLine.State.RUNNING
    step.running += 1
    # Its id may be in the ended set from a step that sent it and died before its commit:
    # left there for the next step to collect it.
    step.signalled.discard(line.request_id)
    line.epoch = str(generation.meta.get(admission.EPOCH_META_KEY) or "")
    line.sent_at = timezone.now()
    step.changed(line)
    return True

