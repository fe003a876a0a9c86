"""The Batch API's Celery step: each active batch is validated, fed to the workers, collected and
finalized a bounded amount at a time (:func:`advance_all`, every ``BATCH_STEP_INTERVAL_S``, a
batch in progress when enough of its lines ended: :mod:`api.batch_pace`).

- **Validating.** The input file is read ``BATCH_VALIDATE_LINES`` lines per step into
  :class:`~api.models.BatchLine` rows. A line must hold a string ``custom_id`` (unique in the
  file: a duplicate fails the batch, as OpenAI's), ``method`` ``POST``, the batch's ``url`` and
  a ``body`` object; a line that does not goes to the error file (HTTP 400 naming the field).
  A file that cannot be read as JSONL fails the batch, its reason in ``errors``.
- **In progress.** At most ``BATCH_LINES_IN_FLIGHT`` lines of a batch are in Redis and the workers
  at once (fed by :mod:`api.batch_feed`). A line is checked as its endpoint checks a request (a
  400 naming the field, or the 404 of a model its batch's key may not call, goes to the error
  file), counted with its model's tokenizer, and admitted through the same lifecycle as an
  interactive request (:func:`gateway.lifecycle.start`) as *batch work*: its own class in the fair
  order, its own fairness key, no ``MAX_QUEUE_WAIT_S``, and the batch's ``expires_at`` as its
  deadline (``docs/design.md``, "The batch service class"). A refusal by a rate or concurrency
  limit (429) or no live worker of its model (503) leaves the line waiting for a later step (the
  other models' lines go on); a token-budget refusal goes to the error file. A line's answer is
  read from its request's event stream once its final event is there, and becomes its output line
  (the body the endpoint would have answered) or its error line.
- **Finalizing.** The output and error files are written (``batch_output`` files of the
  tenant), then the batch ends ``completed``, ``expired`` (its window ran out: the lines not
  finished are aborted and go to the error file, ``batch_expired``) or ``cancelled`` (the same,
  ``batch_cancelled``).

**Exactly once.** Each step works on one batch under its row's lock (``SELECT ... FOR UPDATE
SKIP LOCKED``: steps running at once never share a batch) in one transaction; the lines it
changed are written together (one ``UPDATE`` after feeding, one after collecting). A line's request
id is fixed by the batch, the line and its attempt, and admission is idempotent per request id
(``admit.lua``'s marker), so a step that dies after admitting a line and before its commit sends
the same request again and gets the first verdict: the line runs once. An answer stays in its
event stream (``EVENTS_TTL_S``) until a step reads it. A line whose request ended with a
retryable error (its worker died, the server interrupted it) or that Redis lost (a new epoch)
is sent again under its next attempt, up to ``BATCH_MAX_ATTEMPTS``.

**Billing.** A batch line has no web process: its usage is recorded as its worker counted it
(its client gets the whole answer, in the output file), by the step that read its answer,
with the step's other lines in one go (:func:`gateway.usage.record_many`). A line that failed
is billed nothing, and one aborted by a cancel or its window's end is billed its prompt only
(its client got none of it), as an interactive request whose client left. Its tokens are charged
``BATCH_TOKEN_PRICE`` of a token in the token budget and the record's ``billed_tokens``
(:mod:`gateway.pricing`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import redis
from django.db import DatabaseError, transaction
from django.utils import timezone

from api import batch_feed, batch_lines, batch_pace, batch_store, responses, views
from api.batch_lines import error_line, output_line
from api.models import Batch, BatchLine
from api.schemas import ChatCompletionRequest, GenerationRequest
from gateway import delivery, grace, lifecycle, usage
from gateway.clients import run_sync, sync_redis
from gateway.conf import platform_settings, redis_keys
from gateway.errors import APIError
from inference.protocol.events import ErrorInfo, Event, FinalEvent, decode_event
from tenants.models import UsageRecord

log = logging.getLogger(__name__)

# Each batch gets at least this long of a step (seconds), however many are active.
MIN_SHARE_S = 0.05
# How long the lines aborted at a cancel or an expiry may take to send their final event before
# they are given up (seconds).
STOP_WAIT_S = 10.0

def advance_all() -> int:
    """One step of every active batch that is due (:func:`api.batch_pace.plan`), oldest first,
    each within its share of ``BATCH_STEP_BUDGET_S``; returns how many batches were stepped."""
    rows = list(Batch.objects.filter(status__in=batch_store.ACTIVE)
                .order_by("created_at", "id").values_list("pk", "status"))
    if not rows:
        return 0
    try:
        due = batch_pace.plan(rows, sync_redis())
    except redis.RedisError as exc:  # those in progress wait for it; the others go on
        log.warning("batches in progress wait for Redis: %s", exc)
        due = {pk: True for pk, status in rows if status != Batch.Status.IN_PROGRESS}
    share = max(platform_settings()["BATCH_STEP_BUDGET_S"] / max(len(due), 1), MIN_SHARE_S)
    for pk, full in due.items():
        try:
            advance(pk, until=time.monotonic() + share, full=full)
        except redis.RedisError as exc:
            log.warning("batch %s: Redis unreachable, its step waits: %s", pk, exc)
    return len(due)


def advance(batch_id: str, until: float, full: bool = True) -> None:
    """One step of the batch ``batch_id`` (module docstring); nothing when another step holds
    it or it has ended. ``until``: the ``time.monotonic()`` by which it takes on no more work;
    ``full``: its running lines are all looked at, else only those its ended set names
    (:mod:`api.batch_pace`)."""
    step = None
    with transaction.atomic():
        row = (Batch.objects.select_for_update(skip_locked=True)
               .filter(pk=batch_id, status__in=batch_store.ACTIVE).first())
        if row is not None:
            step = _Step(row, until, full)
            step.run()
    if step is None:
        return
    if step.ended:
        # Once the lines' results are committed: their usage, all in one go (the worker sends
        # no usage task for a batch line). What this misses, the reconciliation records.
        try:
            usage.record_many(step.ended)
        except (redis.RedisError, DatabaseError) as exc:
            log.warning("batch %s: the usage of %d line(s) waits for the reconciliation: %s",
                        batch_id, len(step.ended), exc)
    if step.row.status == Batch.Status.IN_PROGRESS or step.signalled:
        batch_pace.settled(batch_id, step.signalled, full=step.full, fed_all=step.fed_all,
                           running=step.running, client=sync_redis())


class _Step:
    """One step of one batch, under its row's lock."""

    def __init__(self, row: Batch, until: float, full: bool = True):
        self.row = row
        self.until = until
        self.full = full or row.status != Batch.Status.IN_PROGRESS
        self.conf = platform_settings()
        self.lines = BatchLine.objects.filter(batch=row)
        self.ended: list[str] = []  # the lines whose final event it read: their usage next
        self.signalled: set[str] = set()  # the ids its batch's ended set held (batch_pace)
        self.fed_all = False  # True once it fed every line it could (feed ran to its end)
        self.running = 0  # its lines running once it fed them
        self._changed: dict[int, BatchLine] = {}  # lines changed and not yet written

    def changed(self, line: BatchLine) -> None:
        """``line`` changed (its :data:`api.batch_lines.STEP_FIELDS`): written by the next
        :meth:`save_lines`."""
        self._changed[line.pk] = line

    def save_lines(self) -> None:
        """Write the lines changed since the last call (before any query that reads their
        states), in one go (:func:`api.batch_lines.save`)."""
        batch_lines.save(self._changed.values())
        self._changed.clear()

    def run(self) -> None:
        status = self.row.status
        if status == Batch.Status.VALIDATING:
            batch_lines.read_some(self.row, self.conf["BATCH_VALIDATE_LINES"], self.until)
        # A step goes on to the next phase while its time lasts: the first lines are fed, and
        # the files written, without waiting for the next step.
        if self.row.status == Batch.Status.IN_PROGRESS and (
                status == Batch.Status.IN_PROGRESS or time.monotonic() < self.until):
            if timezone.now() >= self.row.expires_at:
                self.stop(Batch.Status.EXPIRED, "batch_expired",
                          "This request could not be executed before the completion window "
                          "expired.",
                          "This request was stopped before it finished: the completion window "
                          "expired (billed its prompt only).")
            else:
                self.collect()
                self.feed()
                if not self.lines.filter(state__in=(BatchLine.State.WAITING,
                                                    BatchLine.State.RUNNING)).exists():
                    batch_lines.begin_finalizing(self.row, Batch.Status.COMPLETED)
        elif status == Batch.Status.CANCELLING:
            # Cancelled while validating: the rest of the file is read first, as many lines a
            # step, so that each of its lines ends in one of the two files (a file deleted
            # meanwhile: those read so far).
            read = self.row.total > 0 or batch_lines.read_some(
                self.row, self.conf["BATCH_VALIDATE_LINES"], self.until, gone_fails=False)
            if self.row.status == Batch.Status.CANCELLING and read:
                self.stop(Batch.Status.CANCELLED, "batch_cancelled",
                          "This request was not executed: its batch was cancelled.",
                          "This request was stopped before it finished: its batch was "
                          "cancelled (billed its prompt only).")
        if self.row.status == Batch.Status.FINALIZING and (
                status == Batch.Status.FINALIZING or time.monotonic() < self.until):
            batch_lines.finalize(self.row)
        batch_store.count(self.row)

    # -- in progress ------------------------------------------------------------------------

    def _request(self, body: dict[str, Any]) -> GenerationRequest:
        return batch_feed.line_request(self.row, body)

    def feed(self) -> None:
        batch_feed.feed(self)

    def collect(self, aborted: bool = False) -> int:
        """Read the answers of the running lines that ended; returns how many are left running.
        Two Redis round trips (every line's last event, the ended ones' streams), the lines'
        bodies read for the ended ones only, their changes written in one go."""
        try:
            return self._collect(aborted)
        finally:
            self.save_lines()

    def _collect(self, aborted: bool) -> int:
        client = sync_redis()
        epoch = (client.get(redis_keys().epoch) or b"").decode()
        self.signalled |= batch_pace.ended(self.row.pk, client)
        lines = self.lines.filter(state=BatchLine.State.RUNNING)
        if not self.full and not aborted:
            lines = lines.filter(request_id__in=self.signalled)
        running = list(lines.order_by("index").defer("body"))
        if not running:
            return 0
        with client.pipeline(transaction=False) as pipe:
            for line in running:
                pipe.xrevrange(redis_keys().events(line.request_id), count=1)
            lasts = pipe.execute()
        # A line with no event yet waits in the queue, or its answer's stream expired unread.
        recorded = set(UsageRecord.objects.filter(
            request_id__in=[line.request_id for line, last in zip(running, lasts, strict=True)
                            if not last]).values_list("request_id", flat=True))
        # A whole stream is read only once its last entry is the final event (one round trip).
        ended = [bool(last) and isinstance(decode_event(last[0][1]), FinalEvent) for last in lasts]
        done_lines = [line for line, done in zip(running, ended, strict=True) if done]
        bodies = dict(BatchLine.objects.filter(pk__in=[line.pk for line in done_lines])
                      .values_list("pk", "body"))
        for line in done_lines:
            line.body = bodies[line.pk]
        streams = iter(grace.streams_events([line.request_id for line in done_lines], client))
        left = 0
        for line, done in zip(running, ended, strict=True):
            events = next(streams) if done else []
            final = events[-1] if events and isinstance(events[-1], FinalEvent) else None
            if final is not None:
                self.ended.append(line.request_id)
                try:
                    self.settle(line, events, final, aborted)
                except APIError as exc:  # its body no longer passes (the settings changed)
                    line.state = BatchLine.State.FAILED
                    line.result = output_line(line, exc.status, exc.body())
                    self.changed(line)
            elif (line.epoch and epoch and epoch != line.epoch) or line.request_id in recorded:
                # Redis lost the request, or its answer's stream expired unread.
                self.again(line, "the request was lost")
            else:
                left += 1
        return left

    def again(self, line: BatchLine, why: str) -> None:
        if line.attempt + 1 >= self.conf["BATCH_MAX_ATTEMPTS"]:
            line.state = BatchLine.State.FAILED
            line.result = output_line(line, 503, APIError(
                503, f"The request failed {line.attempt + 1} times ({why}).",
                code="service_unavailable").body())
            self.changed(line)
            return
        log.info("batch %s line %d: %s; sending it again", self.row.pk, line.index, why)
        line.attempt += 1
        line.state = BatchLine.State.WAITING
        line.request_id = ""
        self.changed(line)

    def settle(self, line: BatchLine, events: list[Event], final: FinalEvent,
               aborted: bool) -> None:
        error: ErrorInfo | None = final.error
        if error is not None and error.retryable and not aborted:
            self.again(line, f"{error.code.value}: {error.message}")
            return
        if aborted and final.finish_reason.value == "abort":
            return  # ended by stop(): written there
        req = self._request(line.body)
        chat = isinstance(req, ChatCompletionRequest)
        shape = views.response_shape(req, req.model, line.request_id, chat=chat,
                                     tools=chat and req.prompt_tools is not None)
        if responses.failed(final):
            assert error is not None
            exc = views.worker_error(req, error)
            line.state = BatchLine.State.FAILED
            line.result = output_line(line, exc.status, exc.body())
        else:
            answer = responses.Choices(shape)
            for event in events:
                answer.add(event)
            line.state = BatchLine.State.DONE
            line.result = output_line(line, 200, answer.body(final))
        self.changed(line)

    # -- ending -----------------------------------------------------------------------------

    def stop(self, ends_as: str, code: str, message: str, stopped: str) -> None:
        """End the batch's unfinished lines (``code``), then finalize it as ``ends_as``: the
        waiting ones go to the error file (``message``), the running ones are aborted (each
        step until its final event, :data:`STOP_WAIT_S` at most) and go there too
        (``stopped``)."""
        row = self.row
        for line in self.lines.filter(state=BatchLine.State.WAITING).defer("body"):
            line.state = BatchLine.State.FAILED
            line.result = error_line(line, code, message)
            self.changed(line)
        self.save_lines()
        self.collect(aborted=True)
        client = sync_redis()
        since = row.cancelling_at if ends_as == Batch.Status.CANCELLED else row.expires_at
        late = (timezone.now() - since).total_seconds() > STOP_WAIT_S
        running = list(self.lines.filter(state=BatchLine.State.RUNNING).defer("body"))
        ids = [line.request_id for line in running]
        for line, finals in zip(running, grace.streams_events(ids, client), strict=True):
            ended = bool(finals) and isinstance(finals[-1], FinalEvent)
            if not ended:
                # What its client got: none of it (billed its prompt, as a client that left).
                run_sync(lifecycle.end_request(
                    line.request_id, {}, finished=False,
                    delivered=delivery.Delivery(tokens=0, end=delivery.LEFT, status=499)))
            if ended or late:
                self.ended += [line.request_id] if ended else []  # its usage: this step's
                line.state = BatchLine.State.FAILED
                line.result = error_line(line, code, stopped)
                self.changed(line)
        self.save_lines()
        if not self.lines.filter(state=BatchLine.State.RUNNING).exists():
            batch_lines.begin_finalizing(self.row, ends_as)
