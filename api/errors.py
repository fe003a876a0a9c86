"""Errors in the OpenAI body shape: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import math
from typing import Any

from django.http import JsonResponse

TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "timeout_error",
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

    def body(self) -> dict[str, Any]:
        error: dict[str, Any] = {"message": self.message, "type": self.type,
                                 "param": self.param, "code": self.code}
        if self.details:
            error["details"] = self.details
        return {"error": error}

    def headers(self) -> dict[str, str]:
        headers: dict[str, str] = {}
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after_s)))
            headers["retry-after-ms"] = str(max(1, int(self.retry_after_s * 1000)))
        if self.should_retry is False:
            headers["x-should-retry"] = "false"
        return headers

    def response(self) -> JsonResponse:
        return JsonResponse(self.body(), status=self.status, headers=self.headers())

    @classmethod
    def from_worker(cls, error: dict[str, Any]) -> APIError:
        """The client-facing error for a worker's ``ErrorInfo`` dict."""
        status = int(error.get("status") or 500)
        details = dict(error.get("details") or {})
        if error.get("gate") is not None:
            details["gate"] = error["gate"]
        retryable = bool(error.get("retryable"))
        return cls(
            status,
            error.get("message") or "the request failed",
            code=error.get("code"),
            param=details.pop("param", None),
            retry_after_s=1.0 if (retryable and status in (429, 503)) else None,
            should_retry=None if retryable else False,
            details=details or None,
        )
