"""A batch's lines: its input file read into :class:`~api.models.BatchLine` rows (validation,
``BATCH_VALIDATE_LINES`` lines per step), and the lines of its output and error files in
OpenAI's format.

A line must be a JSON object holding exactly ``custom_id`` (a non-empty string, unique in the
file), ``method`` (``POST``), ``url`` (the batch's endpoint) and ``body`` (a JSON object: the
request); a line that is not goes to the error file with a 400 naming the field. A
``custom_id`` given twice fails the batch (OpenAI's rule: the output could not be matched to its
requests), as does a file whose bytes are gone or that is not JSONL (``errors`` says why).
Text holding U+0000 is kept with it replaced by U+FFFD (:mod:`gateway.storable`: PostgreSQL
refuses it).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterable, Iterator
from typing import Any

from django.db import connection
from django.utils import timezone

from api import file_store
from api.fields import NOT_UNICODE_MESSAGE
from api.file_checks import JSON_KINDS
from api.models import Batch, BatchLine, StoredFile
from gateway.errors import APIError
from gateway.storable import holds_lone_surrogate, storable, storable_text

LINE_FIELDS = frozenset({"custom_id", "method", "url", "body"})
# Lines validation reads at least per step, and between two looks at the clock (read_some).
MIN_READ = 100
# The fields of a line that a batch step changes (:func:`save`).
STEP_FIELDS = ("state", "attempt", "request_id", "epoch", "sent_at", "result")


def output_line(line: BatchLine, status: int, body: dict[str, Any]) -> dict[str, Any]:
    """A line of the output or error file as OpenAI writes it: the endpoint's answer (its HTTP
    status and body); ``custom_id`` null for a line that had none, ``request_id`` null for one
    whose request never ran."""
    return storable({"id": f"batch_req_{uuid.uuid4().hex[:24]}",
                     "custom_id": line.custom_id or None,
                     "response": {"status_code": status, "request_id": line.request_id or None,
                                  "body": body},
                     "error": None})


def error_line(line: BatchLine, code: str, message: str) -> dict[str, Any]:
    """A line of the error file for a request that got no answer (expired, cancelled)."""
    return {"id": f"batch_req_{uuid.uuid4().hex[:24]}", "custom_id": line.custom_id or None,
            "response": None, "error": {"code": code, "message": message}}


def save(lines: Iterable[BatchLine]) -> None:
    """Write the :data:`STEP_FIELDS` of ``lines`` (in the caller's transaction): one prepared
    ``UPDATE`` run for each (``executemany``). Measured per line in CPU: Django's
    ``bulk_update`` (a ``CASE`` per field and line) about five times a ``save()``; this about a
    fifth of one."""
    meta = BatchLine._meta
    fields = [meta.get_field(name) for name in STEP_FIELDS]
    rows = [[field.get_db_prep_save(getattr(line, field.attname), connection)
             for field in fields] + [line.pk] for line in lines]
    if not rows:
        return
    quote = connection.ops.quote_name
    sql = (f"UPDATE {quote(meta.db_table)} SET "
           + ", ".join(f"{quote(field.column)} = %s" for field in fields)
           + f" WHERE {quote(meta.pk.column)} = %s")
    with connection.cursor() as cursor:
        cursor.executemany(sql, rows)


def write_files(row: Batch) -> None:
    """Store the output file (the lines done) and the error file (the lines failed) of the batch
    ``row`` that are not stored yet, as its tenant's files, each line's result in input order,
    and set their ids on ``row`` (not saved), and its usage (:func:`set_usage`) if not set."""
    if row.input_tokens is None:
        set_usage(row)
    for state, field, name in ((BatchLine.State.DONE, "output_file_id", "output"),
                               (BatchLine.State.FAILED, "error_file_id", "error")):
        if getattr(row, field):
            continue
        results = (BatchLine.objects.filter(batch=row, state=state).order_by("index")
                   .values_list("result", flat=True))
        data = b"".join(json.dumps(r, separators=(",", ":")).encode() + b"\n"
                        for r in results.iterator(chunk_size=2000))
        if data:
            made = file_store.create_from_bytes(data, tenant_id=row.tenant_id,
                                                filename=f"{row.pk}_{name}.jsonl")
            setattr(row, field, made.pk)


def set_usage(row: Batch) -> None:
    """Set the batch ``row``'s usage (not saved): the sums of its answered lines' usage (each
    response body's ``usage``: prompt, cached prompt and completion tokens)."""
    row.input_tokens = row.cached_tokens = row.output_tokens = 0
    results = (BatchLine.objects.filter(batch=row, state=BatchLine.State.DONE)
               .values_list("result", flat=True))
    for result in results.iterator(chunk_size=2000):
        response = result.get("response") if isinstance(result, dict) else None
        body = response.get("body") if isinstance(response, dict) else None
        usage = body.get("usage") if isinstance(body, dict) else None
        if not isinstance(usage, dict):
            continue
        details = usage.get("prompt_tokens_details")
        row.input_tokens += int(usage.get("prompt_tokens") or 0)
        row.output_tokens += int(usage.get("completion_tokens") or 0)
        row.cached_tokens += int((details or {}).get("cached_tokens") or 0)


def _refused(message: str, param: str, code: str = "invalid_value") -> dict[str, Any]:
    return APIError(400, message, param=param, code=code).body()


def file_lines(found: StoredFile) -> Iterator[bytes]:
    """The non-empty lines of a stored file, as :func:`api.file_checks.check_jsonl` counts them.

    Raises:
        FileNotFoundError: its bytes are gone from the storage.
    """
    rest = b""
    first = True
    for chunk in file_store.content_chunks(found):
        if first and chunk.startswith(b"\xef\xbb\xbf"):
            chunk = chunk[3:]
        first = False
        *whole, rest = (rest + chunk).split(b"\n")
        for raw in whole:
            if raw.strip():
                yield raw
    if rest.strip():
        yield rest


def fail(row: Batch, code: str, message: str, line: int | None = None) -> None:
    """End the batch ``failed`` (``errors`` holds why), its lines dropped."""
    row.status = Batch.Status.FAILED
    row.failed_at = timezone.now()
    row.errors = {"object": "list", "data": [{"code": code, "message": message,
                                               "param": None, "line": line}]}
    row.save(update_fields=["status", "failed_at", "errors"])
    BatchLine.objects.filter(batch=row).delete()


def parse_line(row: Batch, index: int, value: Any) -> BatchLine:
    """The line ``index`` (from 0) of the batch's input file: waiting, or failed with its 400."""
    line = BatchLine(batch=row, index=index, custom_id="", body=None)
    if not isinstance(value, dict):
        problem = _refused(f"Line {index + 1} is not a JSON object.", "line")
    elif "custom_id" not in value:
        problem = _refused(f"Line {index + 1}: missing required parameter 'custom_id' (a "
                           f"non-empty string, unique in the file).", "custom_id",
                           "missing_required_parameter")
    elif not isinstance(value["custom_id"], str) or not value["custom_id"]:
        kind = ("an empty string" if value["custom_id"] == ""
                else f"a JSON {JSON_KINDS.get(type(value['custom_id']), 'value')}")
        problem = _refused(f"Line {index + 1}: invalid type for 'custom_id': expected a "
                           f"non-empty string, but got {kind}.", "custom_id")
    elif not _storable_id(value["custom_id"]):
        # Stored as it is or not at all: a NUL (which the database cannot keep) would be
        # stored as U+FFFD, and the answer's custom_id would then not be the one sent.
        problem = _refused(f"Line {index + 1}: invalid value for 'custom_id': it must not hold "
                           f"U+0000 (NUL) or a lone UTF-16 surrogate.", "custom_id")
    elif value.get("method") != "POST":
        problem = _refused(f"Line {index + 1}: invalid value for 'method': expected 'POST'.",
                           "method")
    elif value.get("url") != row.endpoint:
        problem = _refused(f"Line {index + 1}: invalid value for 'url': expected "
                           f"'{row.endpoint}', the batch's endpoint.", "url")
    elif not isinstance(value.get("body"), dict):
        problem = _refused(f"Line {index + 1}: invalid value for 'body': expected a JSON object "
                           f"(the request).", "body")
    elif holds_lone_surrogate(value["body"]):
        # Refused here, as its endpoint refuses such a request: stored, it would be changed.
        problem = _refused(f"Line {index + 1}: invalid value for 'body': {NOT_UNICODE_MESSAGE}.",
                           "body")
    elif extra := sorted(set(value) - LINE_FIELDS):
        problem = _refused(f"Line {index + 1}: unknown parameter "
                           f"'{storable_text(extra[0])[:80]}'.", storable_text(extra[0])[:80])
    else:
        problem = None
    if isinstance(value, dict) and isinstance(value.get("custom_id"), str) and _storable_id(
            value["custom_id"]):
        line.custom_id = value["custom_id"]
    if problem is None:
        line.body = storable(value["body"])
    else:
        line.state = BatchLine.State.FAILED
        line.result = output_line(line, 400, problem)
    return line


def _storable_id(custom_id: str) -> bool:
    """Whether ``custom_id`` can be stored and written back exactly (no NUL, no lone
    surrogate)."""
    return storable_text(custom_id) == custom_id


def _duplicate(row: Batch, index: int, custom_id: str, first: int) -> None:
    fail(row, "duplicate_custom_id",
         f"Line {index + 1} has the custom_id '{custom_id[:80]}' of line {first + 1}; each "
         f"custom_id must be unique in a batch.", index + 1)


def read_some(row: Batch, most: int, until: float | None = None, *,
              gone_fails: bool = True) -> bool:
    """Read the next ``most`` lines of the batch's input file into its lines, fewer once
    ``time.monotonic()`` passes ``until`` (at least :data:`MIN_READ` of them); once the whole
    file is read its ``total`` is set and the batch goes ``in_progress`` (one cancelled
    meanwhile stays ``cancelling``), or ends ``failed``; returns whether the file is read whole.
    A file deleted (or whose bytes are gone) before it was read whole fails the batch, or, with
    ``gone_fails`` False (a batch cancelled meanwhile), ends its reading with the lines read so
    far (``total``; True)."""
    found = StoredFile.objects.filter(tenant_id=row.tenant_id, pk=row.input_file_id).first()
    if found is None:
        if not gone_fails:
            return _read_so_far(row)
        fail(row, "invalid_file", f"The input file '{row.input_file_id}' was deleted before the "
                                  f"batch read {'all of ' if row.read_lines else ''}it.")
        return False
    start = row.read_lines
    made: list[BatchLine] = []
    seen: dict[str, int] = {}
    whole = True  # the file's end was reached
    try:
        for index, raw in enumerate(file_lines(found)):
            if index < start:
                continue
            if index >= start + most or (
                    until is not None and len(made) >= MIN_READ
                    and len(made) % MIN_READ == 0 and time.monotonic() > until):
                whole = False
                break
            try:
                value = json.loads(raw)
            except (ValueError, RecursionError):
                fail(row, "invalid_json", f"Line {index + 1} is not valid JSON.", index + 1)
                return False
            line = parse_line(row, index, value)
            if line.custom_id in seen:
                _duplicate(row, index, line.custom_id, seen[line.custom_id])
                return False
            if line.custom_id:
                seen[line.custom_id] = index
            made.append(line)
    except FileNotFoundError:
        if not gone_fails:
            return _read_so_far(row)
        fail(row, "invalid_file", "The input file's bytes are gone from the storage.")
        return False
    earlier = (BatchLine.objects.filter(batch=row, custom_id__in=list(seen))
               .values_list("custom_id", "index").first())
    if earlier is not None:
        _duplicate(row, seen[earlier[0]], earlier[0], earlier[1])
        return False
    BatchLine.objects.bulk_create(made)
    row.read_lines = start + len(made)
    if whole:
        row.total = row.read_lines
        if row.total == 0 and gone_fails:
            fail(row, "empty_file", "The input file holds no request.")
            return False
        if row.status == Batch.Status.VALIDATING:
            row.status = Batch.Status.IN_PROGRESS
            row.in_progress_at = timezone.now()
    row.save(update_fields=["read_lines", "total", "status", "in_progress_at"])
    return whole


def _read_so_far(row: Batch) -> bool:
    """End the reading of a cancelled batch's input file that is gone: its lines are those read
    so far."""
    row.total = row.read_lines
    row.save(update_fields=["total"])
    return True


def begin_finalizing(row: Batch, ends_as: str) -> None:
    """The batch ``row`` goes ``finalizing``, to end as ``ends_as`` once its files are written."""
    row.status = Batch.Status.FINALIZING
    row.ends_as = ends_as
    row.finalizing_at = timezone.now()
    row.save(update_fields=["status", "ends_as", "finalizing_at"])


def finalize(row: Batch) -> None:
    """Write the batch ``row``'s output and error files (:func:`write_files`), then end it as
    it was to (``completed``, ``expired`` or ``cancelled``)."""
    write_files(row)
    row.status = row.ends_as or Batch.Status.COMPLETED
    field = {Batch.Status.COMPLETED: "completed_at", Batch.Status.EXPIRED: "expired_at",
             Batch.Status.CANCELLED: "cancelled_at"}[row.status]
    setattr(row, field, timezone.now())
    row.save(update_fields=["output_file_id", "error_file_id", "input_tokens", "cached_tokens",
                            "output_tokens", "status", field])
