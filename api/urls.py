from django.urls import path, re_path

from api import adapter_views, batch_views, file_views, model_views, response_views, views

urlpatterns = [
    path("v1/chat/completions", views.chat_completions),
    path("v1/completions", views.completions),
    path("v1/responses", response_views.create_response),
    path("v1/responses/<str:response_id>", response_views.response_detail),
    path("v1/responses/<str:response_id>/input_items", response_views.response_input_items),
    path("v1/files", file_views.files),
    path("v1/files/<str:file_id>", file_views.file_detail),
    path("v1/files/<str:file_id>/content", file_views.file_content),
    path("v1/batches", batch_views.batches),
    path("v1/batches/<str:batch_id>", batch_views.batch_detail),
    path("v1/batches/<str:batch_id>/cancel", batch_views.batch_cancel),
    path("v1/adapters", adapter_views.adapters),
    path("v1/adapters/<path:adapter>", adapter_views.adapter_detail),
    path("v1/models", model_views.list_models),
    path("v1/models/<path:model>", model_views.retrieve_model),
    path("scheduler/stats", views.scheduler_stats),
    path("healthz", views.healthz),
    path("readyz", views.readyz),
    # Last: any other path under v1/ answers a JSON 404, not Django's HTML page.
    # [\s\S], not ".": a path holding a newline too (an encoded %0A).
    re_path(r"^v1(?:/(?P<path>[\s\S]*))?$", views.not_found),
]
