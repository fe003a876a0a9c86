"""URL routes: the OpenAI-compatible API, health and stats endpoints, the admin."""

from django.contrib import admin
from django.urls import include, path
from django.views.generic import RedirectView

# A request Django refuses before any view (a Host not in ALLOWED_HOSTS): JSON on the API.
handler400 = "api.views.bad_request"

urlpatterns = [
    # Before the admin's routes: the scheduler dashboard lives under admin/.
    path("", include("dashboard.urls")),
    path("admin/", admin.site.urls),
    path("chat/", include("chat.urls")),
    path("", RedirectView.as_view(pattern_name="chat:index", permanent=False)),
    path("", include("api.urls")),
]
