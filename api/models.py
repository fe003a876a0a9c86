"""The API's stored objects: responses of the Responses API kept for ``GET /v1/responses/{id}`` and
``previous_response_id`` (``store``, true by default as OpenAI's), and the files of the Files
API."""

from __future__ import annotations

from django.db import models
from django.utils import timezone

from tenants.models import ApiKey, Tenant


class StoredResponse(models.Model):
    """One response of ``POST /v1/responses``, scoped to its tenant.

    ``body`` is the response object as ``GET /v1/responses/{id}`` returns it; ``input_items`` the
    items its request sent (with their ids), as ``GET .../input_items`` lists them, oldest
    first; ``previous`` the response it continued (``previous_response_id``), and ``chain`` how
    many responses its chain holds, itself included. A response is written ``in_progress`` when
    its request is admitted (with the web process relaying it, ``web_id``) and ended once: by
    that process, or, when it died, by the sweep (:func:`api.response_store.end_orphans`).
    """

    class Status(models.TextChoices):
        IN_PROGRESS = "in_progress"
        COMPLETED = "completed"
        INCOMPLETE = "incomplete"
        FAILED = "failed"
        CANCELLED = "cancelled"

    id = models.CharField(primary_key=True, max_length=64)
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="responses")
    api_key = models.ForeignKey(ApiKey, null=True, blank=True, on_delete=models.SET_NULL,
                                related_name="responses")
    previous = models.ForeignKey("self", null=True, blank=True, on_delete=models.SET_NULL,
                                 related_name="next_responses")
    chain = models.PositiveIntegerField(default=1)
    request_id = models.CharField(max_length=64, db_index=True)
    web_id = models.CharField(max_length=128, blank=True)
    status = models.CharField(max_length=16, choices=Status.choices, db_index=True,
                              default=Status.IN_PROGRESS)
    body = models.JSONField()
    input_items = models.JSONField(default=list)
    # How its text is read for tool calls (api.response_events.OutputShape), for the sweep.
    shape = models.JSONField(default=dict)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    ended_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.id} ({self.status})"


class StoredFile(models.Model):
    """One file of the Files API (``/v1/files``), scoped to its tenant: every key of the tenant
    sees it, no other tenant does.

    Its bytes are in the ``files`` storage (``STORAGES["files"]``, :mod:`api.file_store`) under
    ``storage_name``, a generated name (never the client's ``filename``). ``bytes`` is its size,
    ``lines`` its non-empty lines (a batch file's requests); ``expires_at`` (None: kept until
    deleted) is when the purge removes it. ``purpose`` ``batch`` is a client's upload,
    ``batch_output`` a file the platform wrote (a batch's output or errors).
    """

    class Purpose(models.TextChoices):
        BATCH = "batch"
        BATCH_OUTPUT = "batch_output"

    id = models.CharField(primary_key=True, max_length=64)
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="files")
    api_key = models.ForeignKey(ApiKey, null=True, blank=True, on_delete=models.SET_NULL,
                                related_name="files")
    purpose = models.CharField(max_length=32, choices=Purpose.choices, db_index=True)
    filename = models.CharField(max_length=255)
    bytes = models.BigIntegerField()
    lines = models.PositiveIntegerField(default=0)
    storage_name = models.CharField(max_length=255, unique=True)
    created_at = models.DateTimeField(default=timezone.now, db_index=True)
    expires_at = models.DateTimeField(null=True, blank=True, db_index=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["tenant", "created_at", "id"])]

    def __str__(self) -> str:
        return f"{self.id} ({self.purpose}, {self.bytes} bytes)"
