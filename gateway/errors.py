"""Client-facing errors, and the HTTP status of each worker error code.

Errors are answered in the OpenAI body shape: ``{"error": {"message", "type", "param", "code"}}``.
The engine and the workers give errors a code (:class:`inference.protocol.events.ErrorCode`) and no
status: which HTTP status a code means is decided here, for every part of the web tier (the REST
API's responses, the chat's messages, the usage records).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import redis.exceptions
from django import db
from django.http import JsonResponse

from inference.protocol.events import ErrorCode, ErrorInfo, FinishReason
from tenants.best_effort import OccasionalLog

log = logging.getLogger(__name__)

# HTTP status of each worker error code. Refusals by the KV gates are 429 (with
# ``x-should-retry: false``: they can never fit); a deadline or a stopping worker is 503.
STATUS_BY_CODE: dict[ErrorCode, int] = {
    ErrorCode.QUEUE_FULL: 429,
    ErrorCode.KV_BUDGET_EXCEEDED: 429,
    ErrorCode.KV_POOL_EXCEEDED: 429,
    ErrorCode.QUEUE_TIMEOUT: 503,
    ErrorCode.BATCH_EXPIRED: 504,
    ErrorCode.CONTEXT_LENGTH_EXCEEDED: 400,
    ErrorCode.INVALID_REQUEST: 400,
    ErrorCode.ENGINE_ERROR: 500,
    ErrorCode.WORKER_SHUTDOWN: 503,
    ErrorCode.WORKER_LOST: 503,
    ErrorCode.STATE_LOST: 503,
    ErrorCode.INTERRUPTED: 503,
    ErrorCode.GRAMMAR_BUSY: 429,
    ErrorCode.ADAPTER_UNAVAILABLE: 503,
}
# Recorded for a request whose client went away (nginx's convention).
CLIENT_CLOSED_STATUS = 499

TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "timeout_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    499: "client_closed_request",
    500: "server_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class APIError(Exception):
    """An error answered to the client.

    ``retry_after_s`` adds ``Retry-After`` (and ``retry-after-ms``); ``should_retry=False`` adds
    ``x-should-retry: false``, which the ``openai`` client honours (a retry can never succeed).
    ``extra_headers`` are sent too (the ``x-ratelimit-*`` figures of an admission).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        type: str | None = None,
        retry_after_s: float | None = None,
        should_retry: bool | None = None,
        details: dict[str, Any] | None = None,
        extra_headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.type = type or TYPE_BY_STATUS.get(status, "server_error")
        self.retry_after_s = retry_after_s
        self.should_retry = should_retry
        self.details = details
        self.extra_headers = dict(extra_headers or {})

    def body(self) -> dict[str, Any]:
        """The JSON error body: OpenAI's fields (``message``, ``type``, ``param``, ``code``),
        ``details`` when set, and the retry hints that the headers also carry (a body read
        without its headers, an error inside a stream, says the same): ``retryable``, and
        ``retry_after_ms`` when set."""
        error: dict[str, Any] = {"message": self.message, "type": self.type,
                                 "param": self.param, "code": self.code}
        if self.details:
            error["details"] = self.details
        error["retryable"] = self.should_retry is not False and (
            self.retry_after_s is not None or self.status >= 500)
        if self.retry_after_s is not None:
            error["retry_after_ms"] = max(1, int(self.retry_after_s * 1000))
        return {"error": error}

    def stream_body(self) -> dict[str, Any]:
        """:meth:`body` for an error sent inside a stream (an SSE event, a websocket frame), where
        no header can carry the retry hints."""
        return self.body()

    def headers(self) -> dict[str, str]:
        headers: dict[str, str] = dict(self.extra_headers)
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after_s)))
            headers["retry-after-ms"] = str(max(1, int(self.retry_after_s * 1000)))
        if self.should_retry is False:
            headers["x-should-retry"] = "false"
        return headers

    def response(self) -> JsonResponse:
        return JsonResponse(self.body(), status=self.status, headers=self.headers())

    @classmethod
    def from_worker(cls, error: ErrorInfo) -> APIError:
        """The client-facing error for a worker's :class:`~inference.protocol.events.ErrorInfo`."""
        status = STATUS_BY_CODE[error.code]
        details = dict(error.details)
        if error.gate is not None:
            details["gate"] = error.gate
        return cls(
            status,
            error.message or "the request failed",
            code=error.code.value,
            param=details.pop("param", None),
            retry_after_s=1.0 if (error.retryable and status in (429, 503)) else None,
            should_retry=None if error.retryable else False,
            details=details or None,
        )


def final_status(finish_reason: FinishReason, error: ErrorInfo | None) -> int:
    """The HTTP status a finished request is recorded with (usage records, metrics)."""
    if finish_reason is FinishReason.ERROR and error is not None:
        return STATUS_BY_CODE[error.code]
    if finish_reason is FinishReason.ABORT:
        return CLIENT_CLOSED_STATUS
    return 200


# SQLite's primary result codes of a database that cannot serve now: BUSY, LOCKED, NOMEM,
# READONLY, IOERR, CORRUPT, FULL ("database or disk is full"), CANTOPEN, PROTOCOL, NOTADB.
SQLITE_OUTAGE_CODES = frozenset({5, 6, 7, 8, 10, 11, 13, 14, 15, 26})
# PostgreSQL's SQLSTATEs (or their classes) of one: connection exceptions (08), insufficient
# resources (53: disk full, out of memory, too many connections), operator intervention (57: a
# shutdown, a cancelled statement), system errors (58: I/O), a read-only transaction (25006: a
# standby), a serialization failure or deadlock (40001, 40P01), a lock not available (55P03).
POSTGRES_OUTAGE_STATES = ("08", "53", "57", "58", "25006", "40001", "40P01", "55P03")
# A database outage fails every request at once: one line a minute, not one per request.
DATABASE_OUTAGE_LOG = OccasionalLog(log)


def database_unavailable(exc: BaseException) -> bool:
    """Whether ``exc`` is a database that cannot serve now (unreachable, locked, read-only, out
    of disk), which a retry can get past; not a query it refuses (a constraint, a missing column).

    Told by the driver's code where it gives one (:data:`SQLITE_OUTAGE_CODES`,
    :data:`POSTGRES_OUTAGE_STATES`); without one (no connection could be made), by Django's class:
    ``OperationalError`` or ``InterfaceError``.
    """
    if not isinstance(exc, db.DatabaseError):
        return False
    cause = exc.__cause__
    code = getattr(cause, "sqlite_errorcode", None)
    if isinstance(code, int):
        return code & 0xFF in SQLITE_OUTAGE_CODES
    state = getattr(cause, "sqlstate", None) or getattr(cause, "pgcode", None)
    if isinstance(state, str) and state:
        return state.startswith(POSTGRES_OUTAGE_STATES)
    return isinstance(exc, db.OperationalError | db.InterfaceError)


def request_too_large(limit: int) -> APIError:
    """413 ``request_too_large``: a request body over ``limit`` bytes (named in the message and
    in ``details.limit_bytes``); never retried, as the same body can never fit."""
    return APIError(413, f"The request body is larger than the limit of {limit} bytes.",
                    code="request_too_large", should_retry=False,
                    details={"limit_bytes": limit})


def database_outage() -> APIError:
    """503 ``service_unavailable`` naming the database (``details.dependency``), to retry."""
    return APIError(503, "The database is unavailable; retry shortly.",
                    code="service_unavailable", retry_after_s=1,
                    details={"dependency": "database"})


def unexpected_error(exc: Exception) -> APIError:
    """The client-facing error for an exception that is not an :class:`APIError` (logged here).

    Redis trouble (connection lost, connection pool exhausted under a burst) is transient: 503
    with ``Retry-After``; so is a database that cannot serve (:func:`database_unavailable`: 503
    :func:`database_outage`, logged once a minute). Anything else is a 500 that names nothing
    internal.
    """
    if database_unavailable(exc):
        DATABASE_OUTAGE_LOG.warning("The database is unavailable: %r", exc)
        return database_outage()
    if isinstance(exc, redis.exceptions.RedisError):
        log.exception("Redis is unavailable: %s", exc)
        return APIError(503, "The server is temporarily unable to handle the request; retry "
                        "shortly.", code="service_unavailable", retry_after_s=1)
    log.exception("Unexpected error while serving a request")
    return APIError(500, "The server had an error while processing your request.",
                    code="internal_error")
