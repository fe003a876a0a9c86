from django.urls import path

from api import views

urlpatterns = [
    path("v1/chat/completions", views.chat_completions),
    path("v1/completions", views.completions),
    path("v1/models", views.list_models),
    path("v1/models/<path:model>", views.retrieve_model),
    path("scheduler/stats", views.scheduler_stats),
    path("healthz", views.healthz),
    path("readyz", views.readyz),
]
