"""Static files, served in every run mode by the ASGI application (``llm_platform.asgi``).

Django's handler (``ASGIStaticFilesHandler``) raises ``SuspiciousFileOperation`` for a path that
leads outside the static folders (``/static/%2e%2e/settings.py``), which nothing catches below
the server: a 500 and a traceback in the log for each such request. Here it is what it is to a
client, a file that is not there: 404, one ``Not Found`` line in the log.
"""

from __future__ import annotations

from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler
from django.core.exceptions import SuspiciousFileOperation
from django.http import Http404, HttpRequest, HttpResponse


class StaticFiles(ASGIStaticFilesHandler):
    """Django's static files handler, a path outside the static folders being a 404."""

    def serve(self, request: HttpRequest) -> HttpResponse:
        """The static file of ``request.path``.

        Raises:
            Http404: no such file, or a path outside the static folders (answered 404).
        """
        try:
            return super().serve(request)
        except SuspiciousFileOperation as exc:
            raise Http404("No such static file.") from exc
