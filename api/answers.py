"""The response of an answer not streamed, which ends its request once it was sent.

A request's end (:meth:`gateway.lifecycle.Generation.close`) writes what its client got (the
end note its usage record bills, :mod:`gateway.delivery`) and releases its leases. For a stream
that follows each write; an answer not streamed is one write, so its request ends after it:
ended before (as the view returned), a web process killed between the end and the write billed
an answer its client never got.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from asgiref.sync import async_to_sync
from django.http import JsonResponse

log = logging.getLogger(__name__)


class AnswerResponse(JsonResponse):
    """A :class:`~django.http.JsonResponse` that awaits ``end`` when the server closes it.

    Django closes a response once its body was handed to the server (``ASGIHandler`` after
    ``send_response``, also when the client left during the write), on a thread of its own:
    ``end`` runs there on the server's event loop (``async_to_sync``). A response the server
    never closes (one dropped by a middleware) leaves its request to the expiry of its leases
    and to the recorder's rule for a silent web process.
    """

    def __init__(self, data: dict[str, Any], end: Callable[[], Awaitable[None]], **kwargs: Any):
        super().__init__(data, **kwargs)
        self._end: Callable[[], Awaitable[None]] | None = end

    def close(self) -> None:
        try:
            super().close()
        finally:
            end, self._end = self._end, None
            if end is not None:
                try:
                    async_to_sync(end)()
                except Exception:  # noqa: BLE001 - the response is sent; the lease expires
                    log.exception("could not end the request of an answer not streamed")
