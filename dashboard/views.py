"""The admin dashboard (staff only, inside the Django admin) and ``GET /metrics``.

The data and ``/metrics`` answer every error as a JSON body in the API's shape (a bad query
parameter: 400 naming it; Redis unavailable: 503), never an HTML error page.
"""

from __future__ import annotations

import functools
import hmac
import math
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from asgiref.sync import sync_to_async
from django.contrib import admin
from django.core.exceptions import SuspiciousOperation
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render
from django.utils import timezone
from prometheus_client import CONTENT_TYPE_LATEST

from dashboard import metrics
from dashboard.conf import dashboard_settings
from dashboard.models import StatsSnapshot
from dashboard.stats import live_summary
from gateway.credentials import bearer_token
from gateway.errors import APIError, unexpected_error
from tenants.selectors import aauthenticate_key

# The latest time a ``since`` may name (the end of year 9999, the last a datetime holds).
LATEST_SINCE = datetime(9999, 12, 31, tzinfo=UTC).timestamp()


def _error_response(exc: Exception) -> HttpResponse:
    if isinstance(exc, APIError):
        return exc.response()
    if isinstance(exc, SuspiciousOperation):  # e.g. more query parameters than Django takes
        return APIError(400, f"Bad request: {exc}", code="bad_request").response()
    return unexpected_error(exc).response()


def json_errors(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """Answer any error of a (sync) view as a JSON body, never an HTML page."""

    @functools.wraps(view)
    def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        try:
            return view(request, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - answered as JSON (and logged if unexpected)
            return _error_response(exc)

    return wrapper


def async_json_errors(
        view: Callable[..., Awaitable[HttpResponse]]) -> Callable[..., Awaitable[HttpResponse]]:
    """:func:`json_errors` for an async view."""

    @functools.wraps(view)
    async def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        try:
            return await view(request, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - answered as JSON (and logged if unexpected)
            return _error_response(exc)

    return wrapper


def dashboard_page(request: HttpRequest) -> HttpResponse:
    """The live dashboard page; its script polls :func:`dashboard_data`."""
    conf = dashboard_settings()
    context = {
        **admin.site.each_context(request),
        "title": "Scheduler dashboard",
        "dashboard_conf": {"poll_interval_ms": conf["POLL_INTERVAL_MS"],
                           "chart_window_s": conf["CHART_WINDOW_S"]},
    }
    return render(request, "dashboard/dashboard.html", context)


def _since(request: HttpRequest) -> float:
    """The ``since`` query parameter: a finite number of unix seconds (absent or empty: 0).

    Raises:
        APIError: 400 naming ``since`` for anything else (``abc``, ``nan``, ``inf``).
    """
    raw = request.GET.get("since", "")
    try:
        since = float(raw) if raw.strip() else 0.0
    except ValueError:
        since = math.nan
    if not math.isfinite(since):
        raise APIError(400, "Invalid value for 'since': expected a finite number of unix "
                       "seconds.", param="since", code="invalid_value")
    return since


@json_errors
def dashboard_data(request: HttpRequest) -> JsonResponse:
    """The live numbers and the chart history, as JSON.

    ``?since=<unix seconds>`` returns only the snapshots taken after it (the page asks for the
    whole window once, then for what is new); a time before the chart's window means the whole
    window, one past year 9999 the end of that year.
    """
    conf = dashboard_settings()
    window_start = timezone.now() - timedelta(seconds=conf["CHART_WINDOW_S"])
    since = min(max(_since(request), window_start.timestamp()), LATEST_SINCE)
    start = datetime.fromtimestamp(since, tz=UTC)
    snapshots = StatsSnapshot.objects.filter(taken_at__gt=start).order_by("taken_at")
    return JsonResponse({
        "now": time.time(),
        "live": live_summary(),
        "history": [s.chart_point() for s in snapshots],
    })


async def _metrics_access(request: HttpRequest) -> int:
    """200: the request may read the metrics; 403: its credentials are valid but not allowed
    (a signed-in user who is not staff, an API key that is not an operator's); 401: none, or
    unknown ones."""
    user = await request.auser()
    if user.is_authenticated and user.is_staff:
        return 200
    token = bearer_token(request.headers).token
    if not token:
        return 403 if user.is_authenticated else 401
    expected = dashboard_settings().get("METRICS_TOKEN") or ""
    if expected and hmac.compare_digest(token.encode(), expected.encode()):
        return 200
    key = await aauthenticate_key(token)
    if key is None:
        return 401
    return 200 if key.is_operator else 403


@async_json_errors
async def metrics_view(request: HttpRequest) -> HttpResponse:
    """``GET /metrics`` (Prometheus text format).

    For staff users, operator API keys and the ``METRICS_TOKEN`` bearer token (for a Prometheus
    scrape config); it names tenants, so it is not public. 401 without valid credentials, 403
    with credentials that may not read it (as ``/scheduler/stats``), a JSON error body.
    """
    access = await _metrics_access(request)
    if access == 401:
        raise APIError(401, "Metrics need a staff session, an operator API key or the metrics "
                       "token.", code="unauthorized",
                       extra_headers={"WWW-Authenticate": 'Bearer realm="metrics"'})
    if access == 403:
        raise APIError(403, "Only staff users, operator keys and the metrics token may read "
                       "the metrics.", code="forbidden")
    body = await sync_to_async(metrics.render)()
    return HttpResponse(body, content_type=CONTENT_TYPE_LATEST)
