"""Django's middlewares as ``MIDDLEWARE`` names them, without a thread hand-over each on an async
request.

On an async request (every request daphne serves) Django runs a ``MiddlewareMixin`` middleware's
``process_request`` and ``process_response`` through ``sync_to_async``: each a hand-over to the
thread of sync code and back (``django.utils.deprecation.MiddlewareMixin.__acall__``). Ten such
calls a request cost daphne about 3-4 ms of CPU a request (``docs/benchmarks.md``, "The web
tier's CPU time per streamed token"). So:

- :class:`InlineMixin`: the middlewares that read and write nothing but the request and the
  response (security headers, ``APPEND_SLASH``, CSP, ``X-Frame-Options``, the NUL replacement)
  run on the event loop, for every request, as they would on a thread.
- :class:`PagesOnlyMixin`: those of the pages (sessions, CSRF, the logged-in user, messages), which
  may read or write the database, run as Django runs them for every request but the REST API's
  (``/v1`` and below: :func:`is_rest_api`), which authenticates by API key alone, never reads
  a session or ``request.user``, and whose views are exempt from CSRF. Those pass straight on.

Each class is a subclass of Django's own (the admin's checks and anything else that looks for
them by class still find them).
"""

from __future__ import annotations

from typing import Any

from asgiref.sync import sync_to_async
from csp.middleware import CSPMiddleware as _CSPMiddleware
from django.contrib.auth.middleware import AuthenticationMiddleware as _AuthenticationMiddleware
from django.contrib.messages.middleware import MessageMiddleware as _MessageMiddleware
from django.contrib.sessions.middleware import SessionMiddleware as _SessionMiddleware
from django.http import HttpRequest, HttpResponseBase
from django.middleware.clickjacking import XFrameOptionsMiddleware as _XFrameOptionsMiddleware
from django.middleware.common import CommonMiddleware as _CommonMiddleware
from django.middleware.csrf import CsrfViewMiddleware as _CsrfViewMiddleware
from django.middleware.security import SecurityMiddleware as _SecurityMiddleware

from llm_platform.request_text import NulCharacterMiddleware as _NulCharacterMiddleware

# The REST API's paths: ``/v1`` and everything under it.
REST_API_PATH = "/v1"


def is_rest_api(request: HttpRequest) -> bool:
    """Whether ``request`` is to the REST API (``/v1`` or below it)."""
    path = request.path_info
    return path == REST_API_PATH or path.startswith(REST_API_PATH + "/")


class InlineMixin:
    """Runs a ``MiddlewareMixin`` middleware's ``process_request`` and ``process_response`` on
    the event loop of an async request, not on the sync thread: for a middleware that does no
    I/O (no database, no file, no network)."""

    get_response: Any

    async def __acall__(self, request: HttpRequest) -> HttpResponseBase:
        response = None
        if hasattr(self, "process_request"):
            response = self.process_request(request)
        response = response or await self.get_response(request)
        if hasattr(self, "process_response"):
            response = self.process_response(request, response)
        return response


class PagesOnlyMixin:
    """Skips a ``MiddlewareMixin`` middleware for the REST API's requests (:func:`is_rest_api`);
    runs it as Django does for every other request."""

    get_response: Any

    def __call__(self, request: HttpRequest) -> Any:
        # The next handler's response, or in async mode its coroutine (awaited by the caller).
        if is_rest_api(request):
            return self.get_response(request)
        return super().__call__(request)  # type: ignore[misc]


class SecurityMiddleware(InlineMixin, _SecurityMiddleware):
    """Django's ``SecurityMiddleware``, on the event loop."""


class NulCharacterMiddleware(InlineMixin, _NulCharacterMiddleware):
    """:class:`llm_platform.request_text.NulCharacterMiddleware`, on the event loop."""


class CSPMiddleware(InlineMixin, _CSPMiddleware):
    """django-csp's ``CSPMiddleware``, on the event loop."""


class CommonMiddleware(InlineMixin, _CommonMiddleware):
    """Django's ``CommonMiddleware``, on the event loop (its ``APPEND_SLASH`` check resolves the
    URL in memory)."""


class XFrameOptionsMiddleware(InlineMixin, _XFrameOptionsMiddleware):
    """Django's ``XFrameOptionsMiddleware``, on the event loop."""


class SessionMiddleware(PagesOnlyMixin, _SessionMiddleware):
    """Django's ``SessionMiddleware``, for every request but the REST API's."""


class AuthenticationMiddleware(PagesOnlyMixin, _AuthenticationMiddleware):
    """Django's ``AuthenticationMiddleware``, for every request but the REST API's."""


class MessageMiddleware(PagesOnlyMixin, _MessageMiddleware):
    """Django's ``MessageMiddleware``, for every request but the REST API's."""


class CsrfViewMiddleware(PagesOnlyMixin, _CsrfViewMiddleware):
    """Django's ``CsrfViewMiddleware``, for every request but the REST API's (whose views are
    all exempt): its ``process_view`` is a coroutine, so Django calls it on the event loop, and
    it hands over to the sync thread only for a page."""

    async def process_view(self, request: HttpRequest, callback: Any, callback_args: Any,
                           callback_kwargs: Any) -> HttpResponseBase | None:
        if is_rest_api(request):
            return None
        return await sync_to_async(super().process_view, thread_sensitive=True)(
            request, callback, callback_args, callback_kwargs)
