"""A NUL character (``%00``) in a request's path or query string is read as U+FFFD, before any
view runs.

PostgreSQL refuses a NUL in any text it compares, so a view that looked one up (the admin's
searches and filters, the API's ids in paths and cursors) would fail with a 500. No id, search or
filter of this platform holds a NUL, and none holds U+FFFD either: with it replaced, a lookup
finds nothing (the view's own 404, an empty list) on SQLite and PostgreSQL alike, and a parameter
a view ignores stays ignored. Text in a body is the view's to make storable
(:mod:`gateway.storable`).
"""

from __future__ import annotations

from django.core.exceptions import SuspiciousOperation
from django.http import HttpRequest, QueryDict
from django.utils.deprecation import MiddlewareMixin

from gateway.storable import NUL, storable_text


def storable_query(query: QueryDict) -> QueryDict:
    """``query`` with every name and value :func:`~gateway.storable.storable_text` (itself
    when none holds a NUL)."""
    if not any(NUL in name or any(NUL in value for value in values)
               for name, values in query.lists()):
        return query
    replaced = QueryDict(mutable=True)
    for name, values in query.lists():
        replaced.setlist(storable_text(name), [storable_text(value) for value in values])
    replaced._mutable = False
    return replaced


class NulCharacterMiddleware(MiddlewareMixin):
    """``MIDDLEWARE``: the path and query parameters with their NULs replaced (the module
    docstring)."""

    def process_request(self, request: HttpRequest) -> None:
        if NUL in request.path_info:
            request.path_info = storable_text(request.path_info)
            request.path = storable_text(request.path)
        try:
            query = request.GET
        except SuspiciousOperation:  # too many parameters: the view answers it, as without this
            return
        request.GET = storable_query(query)
