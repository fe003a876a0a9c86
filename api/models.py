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


class Batch(models.Model):
    """One batch of the Batch API (``/v1/batches``), scoped to its tenant: the requests of an
    uploaded ``batch`` file (:class:`BatchLine`), run as batch work (``docs/design.md``, "The
    batch service class") by the Celery steps of :mod:`api.batch_runner`.

    ``status`` follows OpenAI's: ``validating`` (the file is read into lines), ``in_progress``,
    ``finalizing`` (the output and error files are written), then one of ``completed``,
    ``failed`` (the file could not be read as a batch: ``errors``), ``expired`` (its completion
    window ended first) or ``cancelled`` (after ``cancelling``). ``read_lines`` is how far
    validation has read the input file (it goes in steps); ``ends_as`` the status a finalizing
    batch ends in; ``total``, ``completed`` and ``failed`` are its ``request_counts``;
    ``input_tokens``, ``cached_tokens`` and ``output_tokens`` its ``usage``: the sums of its
    answered lines' usage, set when its output file is written (None until then, and for a batch
    that failed).
    """

    class Status(models.TextChoices):
        VALIDATING = "validating"
        FAILED = "failed"
        IN_PROGRESS = "in_progress"
        FINALIZING = "finalizing"
        COMPLETED = "completed"
        EXPIRED = "expired"
        CANCELLING = "cancelling"
        CANCELLED = "cancelled"

    id = models.CharField(primary_key=True, max_length=64)
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="batches")
    api_key = models.ForeignKey(ApiKey, null=True, blank=True, on_delete=models.SET_NULL,
                                related_name="batches")
    endpoint = models.CharField(max_length=64)
    input_file_id = models.CharField(max_length=64)
    output_file_id = models.CharField(max_length=64, blank=True)
    error_file_id = models.CharField(max_length=64, blank=True)
    completion_window = models.CharField(max_length=16, default="24h")
    status = models.CharField(max_length=16, choices=Status.choices, db_index=True,
                              default=Status.VALIDATING)
    metadata = models.JSONField(null=True, blank=True)
    errors = models.JSONField(null=True, blank=True)
    read_lines = models.PositiveIntegerField(default=0)
    # While finalizing: the status it ends in (completed, expired or cancelled).
    ends_as = models.CharField(max_length=16, blank=True)
    total = models.PositiveIntegerField(default=0)
    completed = models.PositiveIntegerField(default=0)
    failed = models.PositiveIntegerField(default=0)
    input_tokens = models.PositiveBigIntegerField(null=True, blank=True)
    cached_tokens = models.PositiveBigIntegerField(null=True, blank=True)
    output_tokens = models.PositiveBigIntegerField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now, db_index=True)
    expires_at = models.DateTimeField()
    in_progress_at = models.DateTimeField(null=True, blank=True)
    finalizing_at = models.DateTimeField(null=True, blank=True)
    completed_at = models.DateTimeField(null=True, blank=True)
    failed_at = models.DateTimeField(null=True, blank=True)
    expired_at = models.DateTimeField(null=True, blank=True)
    cancelling_at = models.DateTimeField(null=True, blank=True)
    cancelled_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        verbose_name_plural = "batches"
        indexes = [models.Index(fields=["tenant", "created_at", "id"])]

    def __str__(self) -> str:
        return f"{self.id} ({self.status})"


class BatchLine(models.Model):
    """One request of a batch: its line of the input file (``index``, from 0, over the non-empty
    lines; ``custom_id``; ``body``), and what became of it.

    ``state``: ``waiting`` (to be sent to the workers), ``running`` (admitted as
    ``request_id``, its answer not read yet), ``done`` (``result`` is its output-file line) or
    ``failed`` (``result`` is its error-file line). ``attempt`` counts the requests it was sent
    as (a line whose request ended with a retryable error, or was lost, goes again under a new
    ``request_id``).
    """

    class State(models.TextChoices):
        WAITING = "waiting"
        RUNNING = "running"
        DONE = "done"
        FAILED = "failed"

    batch = models.ForeignKey(Batch, on_delete=models.CASCADE, related_name="lines")
    index = models.PositiveIntegerField()
    custom_id = models.TextField()
    body = models.JSONField(null=True)
    state = models.CharField(max_length=8, choices=State.choices, default=State.WAITING)
    attempt = models.PositiveSmallIntegerField(default=0)
    request_id = models.CharField(max_length=96, blank=True)
    # The epoch of the Redis data its request was queued in (a new one: Redis lost it).
    epoch = models.CharField(max_length=64, blank=True)
    sent_at = models.DateTimeField(null=True, blank=True)
    result = models.JSONField(null=True, blank=True)

    class Meta:
        ordering = ["batch", "index"]
        constraints = [models.UniqueConstraint(fields=["batch", "index"],
                                               name="batch_line_index_unique")]
        indexes = [models.Index(fields=["batch", "state", "index"])]

    def __str__(self) -> str:
        return f"{self.batch_id} line {self.index} ({self.state})"
