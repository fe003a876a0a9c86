"""A database that cannot serve answers every page a retryable 503, never a 500 with a traceback.

The REST API, ``/scheduler/stats`` and ``/metrics`` answer their own errors as JSON
(:func:`gateway.errors.unexpected_error`); the pages (the chat, the admin, the dashboard) raise
theirs to Django, which would answer 500. :class:`DatabaseOutageMiddleware` answers a database
outage (:func:`gateway.errors.database_unavailable`) raised by any view with 503 and
``Retry-After``: a plain page for a browser, the platform's JSON error body for a client that does
not take HTML and under the API's paths. The page is built here, without templates, the session
or the user, none of which can be read while the database is down.
"""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse
from django.utils.deprecation import MiddlewareMixin

from api.views import API_PATH_PREFIXES
from gateway.errors import database_unavailable, unexpected_error

PAGE = """<!doctype html>
<html lang="en">
<head><meta charset="utf-8"><title>Service unavailable</title></head>
<body>
<h1>Service unavailable</h1>
<p>The database is unavailable right now. Try again in a moment.</p>
</body>
</html>
"""


def wants_json(request: HttpRequest) -> bool:
    """Whether an error to ``request`` is answered as JSON: under the API's paths, or for a
    client that does not take HTML."""
    return request.path.startswith(API_PATH_PREFIXES) or not request.accepts("text/html")


def outage_response(request: HttpRequest, exc: Exception) -> HttpResponse:
    """The 503 of a database outage ``exc`` (logged occasionally), as ``request`` takes it."""
    error = unexpected_error(exc)
    if wants_json(request):
        return error.response()
    return HttpResponse(PAGE, status=error.status, headers=error.headers(),
                        content_type="text/html; charset=utf-8")


class DatabaseOutageMiddleware(MiddlewareMixin):
    """``MIDDLEWARE``: a view's database outage becomes :func:`outage_response`; any other
    exception goes on to Django's handling."""

    def process_exception(self, request: HttpRequest,
                          exception: Exception) -> HttpResponse | None:
        if not database_unavailable(exception):
            return None
        return outage_response(request, exception)
