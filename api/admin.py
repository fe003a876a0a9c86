from django.contrib import admin

from api.models import Batch, StoredFile, StoredResponse


class ReadOnlyAdmin(admin.ModelAdmin):
    """Rows the API's clients write: shown in the admin, never added or changed there."""

    def get_readonly_fields(self, request, obj=None) -> list[str]:
        return [f.name for f in self.model._meta.fields]

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False


@admin.register(StoredResponse)
class StoredResponseAdmin(ReadOnlyAdmin):
    """Stored responses of the Responses API (their clients write them)."""

    list_display = ("id", "tenant", "status", "chain", "created_at", "ended_at")
    list_filter = ("status", "tenant")
    search_fields = ("id", "request_id")


@admin.register(StoredFile)
class StoredFileAdmin(ReadOnlyAdmin):
    """Files of the Files API (their clients upload them, batches write them)."""

    list_display = ("id", "tenant", "purpose", "filename", "bytes", "lines", "created_at",
                    "expires_at")
    list_filter = ("purpose", "tenant")
    search_fields = ("id", "filename")


@admin.register(Batch)
class BatchAdmin(ReadOnlyAdmin):
    """Batches of the Batch API (their clients create them, Celery steps run them)."""

    list_display = ("id", "tenant", "endpoint", "status", "total", "completed", "failed",
                    "created_at", "expires_at")
    list_filter = ("status", "tenant")
    search_fields = ("id", "input_file_id")
