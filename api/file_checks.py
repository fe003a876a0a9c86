"""What ``POST /v1/files`` is sent: its form fields and its file, checked before the file is
stored.

A batch file (``purpose: "batch"``) must be UTF-8 JSONL: each non-empty line one JSON object, at
most ``FILES_MAX_LINES`` of them, at most ``FILES_MAX_BYTES`` bytes in all. The file is read line
by line from the upload (memory or its temporary file), never whole. Whether each line is a
valid batch request is not checked here: the batch that reads the file does it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gateway.errors import APIError

# The purposes OpenAI's Files API takes; this server serves the ones in SERVED_PURPOSES.
OPENAI_PURPOSES = ("assistants", "batch", "fine-tune", "vision", "user_data", "evals")
SERVED_PURPOSES = ("batch",)
# The purpose of the files the platform writes (a batch's output and errors): read and deleted
# by clients, never uploaded.
OUTPUT_PURPOSE = "batch_output"
# The form fields of an upload (the SDK writes expires_after as two bracketed fields).
FIELDS = ("purpose", "expires_after[anchor]", "expires_after[seconds]")
FILE_FIELD = "file"
# OpenAI's bounds of expires_after.seconds (1 hour to 30 days).
MIN_EXPIRES_AFTER_S, MAX_EXPIRES_AFTER_S = 3600, 30 * 86400
JSON_KINDS = {list: "array", str: "string", int: "number", float: "number", bool: "boolean",
              type(None): "null"}
# Longest part of a bad value repeated in an error.
MAX_ECHOED = 64


def _shown(value: str) -> str:
    return value if len(value) <= MAX_ECHOED else value[:MAX_ECHOED] + "..."


def invalid(param: str, message: str, code: str = "invalid_value",
            details: dict[str, Any] | None = None) -> APIError:
    """A 400 naming ``param``."""
    return APIError(400, message, param=param, code=code, details=details)


@dataclass(frozen=True)
class UploadFields:
    """The checked form fields of an upload: ``purpose`` and ``expires_after`` (seconds after
    its creation, or None for the platform's retention)."""

    purpose: str
    expires_after_s: int | None = None


def upload_fields(fields: Mapping[str, list[str]], files: Iterable[str],
                  retention_s: float) -> UploadFields:
    """The fields of an upload's form (``fields``: each name's values; ``files``: the names of
    its file parts), with ``retention_s`` (``FILES_RETENTION_S``; 0: none) bounding
    ``expires_after``.

    Raises:
        APIError: 400 naming the field: a field or file part this endpoint does not take
            (``unknown_parameter``), one given twice, a missing ``purpose`` or ``file``
            (``missing_required_parameter``), a purpose not served (``unsupported_value``: the
            other purposes of OpenAI's, and ``batch_output``, which only the platform writes),
            an ``expires_after`` whose ``anchor`` is not ``created_at`` or whose ``seconds`` is
            not an integer from 3600 to 2592000 (and at most ``retention_s``).
    """
    files = list(files)
    for name in [*fields, *files]:
        if name not in (*FIELDS, FILE_FIELD):
            raise invalid(_shown(name), f"Unknown parameter: '{_shown(name)}'. An upload takes "
                                        f"'file' and 'purpose' (and 'expires_after').",
                          code="unknown_parameter")
    for name, values in [*fields.items(), *((f, [f]) for f in files)]:
        if len(values) > 1 or files.count(name) > 1:
            raise invalid(name, f"'{name}' is given more than once.")
    if FILE_FIELD in fields:
        raise invalid(FILE_FIELD, "'file' must be a file part (with a filename), not a text "
                                  "field.")
    if FILE_FIELD not in files:
        raise invalid(FILE_FIELD, "Missing required parameter: 'file' (a multipart/form-data "
                                  "file part).", code="missing_required_parameter")
    purpose = (fields.get("purpose") or [None])[0]
    if purpose is None:
        raise invalid("purpose", "Missing required parameter: 'purpose'.",
                      code="missing_required_parameter")
    if purpose not in SERVED_PURPOSES:
        if purpose == OUTPUT_PURPOSE:
            why = "only the platform writes such files (a batch's output and errors)"
        elif purpose in OPENAI_PURPOSES:
            why = "this server serves the Files API for batches only"
        else:
            why = f"expected one of {', '.join(OPENAI_PURPOSES)}"
        raise invalid("purpose", f"Invalid value for 'purpose': '{_shown(purpose)}' is not "
                                 f"served ({why}); served: 'batch'.", code="unsupported_value")
    return UploadFields(purpose, _expires_after(fields, retention_s))


def _expires_after(fields: Mapping[str, list[str]], retention_s: float) -> int | None:
    anchor = (fields.get("expires_after[anchor]") or [None])[0]
    seconds = (fields.get("expires_after[seconds]") or [None])[0]
    if anchor is None and seconds is None:
        return None
    if anchor != "created_at":
        raise invalid("expires_after.anchor", "Invalid value for 'expires_after.anchor': "
                                              "expected 'created_at'.")
    most = MAX_EXPIRES_AFTER_S if retention_s <= 0 else min(MAX_EXPIRES_AFTER_S,
                                                             int(retention_s))
    most = max(most, MIN_EXPIRES_AFTER_S)
    try:
        value = int(seconds) if seconds is not None and seconds.strip().isdigit() else None
    except ValueError:
        value = None
    if value is None or not MIN_EXPIRES_AFTER_S <= value <= most:
        raise invalid("expires_after.seconds", f"Invalid value for 'expires_after.seconds': "
                                               f"expected an integer from "
                                               f"{MIN_EXPIRES_AFTER_S} to {most}.")
    return value


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _bad_file(message: str, code: str = "invalid_file", **details: Any) -> APIError:
    return invalid(FILE_FIELD, message, code=code, details=details or None)


def check_jsonl(lines: Iterable[bytes], *, max_lines: int, max_bytes: int) -> int:
    """Check a batch file read as ``lines`` (each with its ``\\n``, as a binary file iterates)
    and return how many non-empty lines (requests) it holds.

    Raises:
        APIError: 400 naming ``file``: over ``max_bytes`` bytes (``file_too_large``) or
            ``max_lines`` non-empty lines (``too_many_lines``), empty (``empty_file``), or a line
            (its number, from 1, in the message and ``details.line``) that is not UTF-8 or not a
            JSON object (``invalid_file``).
    """
    size = requests = 0
    number = 0
    for number, raw in enumerate(lines, start=1):
        size += len(raw)
        if size > max_bytes:
            raise _bad_file(f"Invalid file: it is over {max_bytes} bytes, the largest a batch "
                            f"file may be (FILES_MAX_BYTES).", code="file_too_large",
                            limit_bytes=max_bytes)
        if number == 1 and raw.startswith(b"\xef\xbb\xbf"):
            raw = raw[3:]  # a UTF-8 byte order mark
        if not raw.strip():
            continue
        requests += 1
        if requests > max_lines:
            raise _bad_file(f"Invalid file: it holds more than {max_lines} requests (non-empty "
                            f"lines), the most a batch file may (FILES_MAX_LINES).",
                            code="too_many_lines", limit_lines=max_lines)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise _bad_file(f"Invalid file: line {number} is not UTF-8 (byte {exc.start + 1}); "
                            f"a batch file is UTF-8 JSONL.", line=number) from exc
        try:
            value = json.loads(text, parse_constant=_refuse_constant)
        except RecursionError as exc:
            raise _bad_file(f"Invalid file: line {number} is nested too deeply.",
                            line=number) from exc
        except ValueError as exc:
            raise _bad_file(f"Invalid file: line {number} is not valid JSON ({exc}); a batch "
                            f"file holds one JSON object per line.", line=number) from exc
        if not isinstance(value, dict):
            kind = JSON_KINDS.get(type(value), "value")
            raise _bad_file(f"Invalid file: line {number} is a JSON {kind}, "
                            f"not an object; a batch file holds one JSON object per line.",
                            line=number)
    if requests == 0:
        raise _bad_file("Invalid file: it holds no request (no non-empty line).",
                        code="empty_file")
    return requests


def count_lines(data: bytes) -> int:
    """The non-empty lines of ``data`` (a file the platform writes: its requests' results)."""
    return sum(1 for line in data.split(b"\n") if line.strip())
