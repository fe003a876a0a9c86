"""Dashboard routes: the page and its data inside the admin (staff only), and ``/metrics``.

Included by the project's URLconf before the admin's own routes.
"""

from django.contrib import admin
from django.urls import path

from dashboard import views

urlpatterns = [
    # admin_view: the admin's login page and staff check.
    path("admin/scheduler/", admin.site.admin_view(views.dashboard_page),
         name="scheduler-dashboard"),
    # json_errors outside too: the staff check reads the session (a database outage: JSON 503).
    path("admin/scheduler/data", views.json_errors(admin.site.admin_view(views.dashboard_data)),
         name="scheduler-dashboard-data"),
    path("metrics", views.metrics_view, name="metrics"),
]
