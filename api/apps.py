from django.apps import AppConfig


class ApiConfig(AppConfig):
    """The OpenAI-compatible REST API, health and stats endpoints."""

    default_auto_field = "django.db.models.BigAutoField"
    name = "api"

    def ready(self) -> None:
        from django.db.models.signals import post_delete

        from api.file_store import delete_bytes_of
        from api.models import StoredFile
        from api.tasks import end_orphaned_responses
        from gateway.tasks import swept

        swept.connect(end_orphaned_responses, dispatch_uid="api.end_orphaned_responses")
        post_delete.connect(delete_bytes_of, sender=StoredFile, dispatch_uid="api.file_bytes")
