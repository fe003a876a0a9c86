from django.urls import path, re_path

from api import views

urlpatterns = [
    path("v1/chat/completions", views.chat_completions),
    path("v1/completions", views.completions),
    path("v1/models", views.list_models),
    path("v1/models/<path:model>", views.retrieve_model),
    path("scheduler/stats", views.scheduler_stats),
    path("healthz", views.healthz),
    path("readyz", views.readyz),
    # Last: any other path under v1/ answers a JSON 404, not Django's HTML page.
    # [\s\S], not ".": a path holding a newline too (an encoded %0A).
    re_path(r"^v1(?:/(?P<path>[\s\S]*))?$", views.not_found),
]
