"""The admin dashboard (staff only, inside the Django admin) and ``GET /metrics``."""

from __future__ import annotations

import hmac
import time
from datetime import UTC, datetime, timedelta

from asgiref.sync import sync_to_async
from django.contrib import admin
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render
from django.utils import timezone
from prometheus_client import CONTENT_TYPE_LATEST

from dashboard import metrics
from dashboard.conf import dashboard_settings
from dashboard.models import StatsSnapshot
from dashboard.stats import live_summary
from tenants.selectors import aauthenticate_key


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


def dashboard_data(request: HttpRequest) -> JsonResponse:
    """The live numbers and the chart history, as JSON.

    ``?since=<unix seconds>`` returns only the snapshots taken after it (the page asks for the
    whole window once, then for what is new).
    """
    conf = dashboard_settings()
    window_start = timezone.now() - timedelta(seconds=conf["CHART_WINDOW_S"])
    try:
        since = float(request.GET.get("since", "0"))
    except ValueError:
        since = 0.0
    start = max(window_start, datetime.fromtimestamp(since, tz=UTC))
    snapshots = StatsSnapshot.objects.filter(taken_at__gt=start).order_by("taken_at")
    return JsonResponse({
        "now": time.time(),
        "live": live_summary(),
        "history": [s.chart_point() for s in snapshots],
    })


async def _may_read_metrics(request: HttpRequest) -> bool:
    user = await request.auser()
    if user.is_authenticated and user.is_staff:
        return True
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return False
    expected = dashboard_settings().get("METRICS_TOKEN") or ""
    if expected and hmac.compare_digest(token.encode(), expected.encode()):
        return True
    key = await aauthenticate_key(token)
    return bool(key and key.is_operator)


async def metrics_view(request: HttpRequest) -> HttpResponse:
    """``GET /metrics`` (Prometheus text format).

    For staff users, operator API keys and the ``METRICS_TOKEN`` bearer token (for a Prometheus
    scrape config); it names tenants, so it is not public. 401 otherwise.
    """
    if not await _may_read_metrics(request):
        response = HttpResponse("metrics need a staff session, an operator API key or the "
                                "metrics token\n", status=401, content_type="text/plain")
        response["WWW-Authenticate"] = 'Bearer realm="metrics"'
        return response
    body = await sync_to_async(metrics.render)()
    return HttpResponse(body, content_type=CONTENT_TYPE_LATEST)
