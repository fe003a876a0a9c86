"""Tenants and what belongs to them: priority tiers, users, API keys, usage records; the base
models served."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import MinValueValidator
from django.db import models

from tenants.model_access import parse_rules, valid_name

ALLOWED_MODELS_HELP = (
    "Model names or patterns, one a line or separated by commas; '*' matches within one "
    "'/'-separated segment ('vendor/*'). Blank: {blank}.")


def validate_model_name(name: str) -> None:
    """Check a base model's name (:func:`tenants.model_access.valid_name`).

    Raises:
        ValidationError: not a valid model name.
    """
    if not valid_name(name):
        raise ValidationError(
            "A model name is one or more '/'-separated parts, each starting with a letter or "
            "digit and holding only letters, digits, '.', '_' and '-' (no ':', '@', '*', "
            "whitespace, or empty part), 128 characters at most.", code="invalid_name")


def validate_model_rules(text: str) -> None:
    """Check an ``allowed_models`` rule list (:func:`tenants.model_access.parse_rules`).

    Raises:
        ValidationError: an entry is neither a name nor a pattern; the message names it.
    """
    try:
        parse_rules(text)
    except ValueError as exc:
        raise ValidationError(str(exc), code="invalid_rule") from exc


class PriorityTier(models.Model):
    """A service class: requests of a higher ``priority`` are admitted first by the scheduler."""

    name = models.CharField(max_length=64, unique=True)
    priority = models.IntegerField(
        default=0, help_text="Higher is served first (the scheduler's sort key is -priority)."
    )
    description = models.CharField(max_length=255, blank=True)

    class Meta:
        ordering = ["-priority", "name"]

    def __str__(self) -> str:
        return f"{self.name} ({self.priority})"


class Tenant(models.Model):
    """A customer sharing the model workers; its limits are enforced by the web tier.

    A limit of 0 means unlimited. ``fairness_weight`` scales the tenant's share under the fair
    (VTC) policy: a weight of 2 is served about twice the tokens of a weight of 1.
    ``allowed_models``: the models its keys and chat users may call, as names and patterns
    (:mod:`tenants.model_access`); blank, every enabled model.
    """

    class BudgetPeriod(models.TextChoices):
        HOUR = "hour", "Hour"
        DAY = "day", "Day"
        WEEK = "week", "Week"
        MONTH = "month", "30 days"

    name = models.CharField(max_length=128)
    slug = models.SlugField(max_length=64, unique=True)
    tier = models.ForeignKey(PriorityTier, on_delete=models.PROTECT, related_name="tenants")
    fairness_weight = models.FloatField(
        default=1.0, validators=[MinValueValidator(0.01)],
        help_text="Share of the fair scheduler: a tenant of weight 2 is served twice as much.")
    is_active = models.BooleanField(default=True)
    requests_per_minute = models.PositiveIntegerField(default=0, help_text="0: unlimited.")
    tokens_per_minute = models.PositiveIntegerField(
        default=0, help_text="Prompt + completion tokens per minute; 0: unlimited."
    )
    max_concurrent_requests = models.PositiveIntegerField(default=0, help_text="0: unlimited.")
    token_budget = models.PositiveBigIntegerField(
        default=0, help_text="Tokens per budget period; 0: unlimited."
    )
    budget_period = models.CharField(
        max_length=8, choices=BudgetPeriod.choices, default=BudgetPeriod.MONTH
    )
    allowed_models = models.TextField(
        blank=True, validators=[validate_model_rules],
        help_text=ALLOWED_MODELS_HELP.format(blank="every enabled model"))
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def budget_period_seconds(self) -> int:
        return {"hour": 3600, "day": 86400, "week": 7 * 86400, "month": 30 * 86400}[
            self.budget_period
        ]


class Membership(models.Model):
    """A user belonging to a tenant (one tenant per user)."""

    user = models.OneToOneField(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="membership"
    )
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="memberships")
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"{self.user} @ {self.tenant}"


class ApiKey(models.Model):
    """A bearer key of one tenant, stored as its SHA-256 hash; shown once at creation.

    The ``prefix`` (the first characters of the key) stays visible so people can tell keys apart.
    Per-key limits of 0 mean only the tenant's limits apply. An operator key may also read the
    scheduler's stats. ``allowed_models`` narrows what its tenant's ``allowed_models`` allow
    (:mod:`tenants.model_access`).
    """

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=128, blank=True)
    prefix = models.CharField(max_length=16, db_index=True, editable=False)
    hashed_key = models.CharField(max_length=64, unique=True, editable=False)
    is_operator = models.BooleanField(default=False)
    requests_per_minute = models.PositiveIntegerField(default=0, help_text="0: tenant's only.")
    tokens_per_minute = models.PositiveIntegerField(default=0, help_text="0: tenant's only.")
    allowed_models = models.TextField(
        blank=True, validators=[validate_model_rules],
        help_text=ALLOWED_MODELS_HELP.format(blank="whatever its tenant allows") + " A key "
                  "calls only what both its tenant's and its own rules allow.")
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True, editable=False)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        verbose_name = "API key"

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.tenant})"

    @property
    def is_revoked(self) -> bool:
        return self.revoked_at is not None


class UsageRecord(models.Model):
    """What one request cost and how it ended; written by a Celery task from its final event.

    ``prompt_tokens`` and ``completion_tokens`` are the tokens processed; ``billed_tokens`` the
    tokens the tenant is charged for them (its token budget counts these): their sum for
    interactive work, that sum at the price of a batch token for a Batch API line
    (``batch_id`` set; ``gateway.pricing``). A record saved without ``billed_tokens`` is
    charged in full.
    """

    request_id = models.CharField(max_length=64, unique=True)
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="usage_records")
    api_key = models.ForeignKey(
        ApiKey, null=True, blank=True, on_delete=models.SET_NULL, related_name="usage_records"
    )
    model = models.CharField(max_length=128)
    prompt_tokens = models.PositiveIntegerField(default=0)
    cached_prompt_tokens = models.PositiveIntegerField(default=0)
    completion_tokens = models.PositiveIntegerField(default=0)
    billed_tokens = models.PositiveIntegerField(
        blank=True, help_text="Tokens charged (the budget counts these): prompt + completion, "
                              "batch work at its price per token.")
    ttft_s = models.FloatField(null=True, blank=True, help_text="Time to first token (seconds).")
    duration_s = models.FloatField(null=True, blank=True)
    finish_reason = models.CharField(max_length=16, blank=True)
    status = models.PositiveSmallIntegerField(default=200, help_text="HTTP status answered.")
    error_code = models.CharField(max_length=64, blank=True)
    # The batch (the Batch API) whose line this request ran, or blank for interactive work.
    batch_id = models.CharField(max_length=64, blank=True, db_index=True)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.request_id} ({self.tenant})"

    def save(self, *args, **kwargs) -> None:
        """Save the record; one given no ``billed_tokens`` is charged its :attr:`total_tokens`."""
        if self.billed_tokens is None:
            self.billed_tokens = self.total_tokens
        super().save(*args, **kwargs)

    @property
    def total_tokens(self) -> int:
        """Tokens processed: prompt + completion (not what is charged: :attr:`billed_tokens`)."""
        return self.prompt_tokens + self.completion_tokens

    @property
    def is_batch(self) -> bool:
        """Whether the request ran a Batch API line (batch work)."""
        return bool(self.batch_id)


class ServedModel(models.Model):
    """A base model of the registry: a name the API accepts, and the folder its workers load.

    The web tier reads the model's tokenizer (prompt token counts, the chat template) from
    ``tokenizer_path``, blank: ``model_path``. A disabled model is served to no one: it is not
    listed and a request naming it gets the same 404 as an unknown model.

    The deployment's default model (its name ``SERVED_MODEL_NAME``, its folder ``MODEL_PATH``
    or the prepared default model, its tokenizer ``TOKENIZER_PATH``) is always served without
    an entry here, unless the registry holds an entry of the same name: then that entry's fields
    rule (its folders, and ``enabled``: disabling it withdraws the default model).
    """

    name = models.CharField(
        max_length=128, unique=True, validators=[validate_model_name],
        help_text="The name clients send as 'model' (case-sensitive).")
    model_path = models.CharField(
        max_length=1024, help_text="The local Hugging Face model folder its workers load.")
    tokenizer_path = models.CharField(
        max_length=1024, blank=True,
        help_text="The folder whose tokenizer counts its prompts in the web tier; blank: the "
                  "model folder.")
    enabled = models.BooleanField(default=True)
    description = models.CharField(max_length=255, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]
        verbose_name = "base model"

    def __str__(self) -> str:
        return self.name

    def save(self, *args: Any, **kwargs: Any) -> None:
        """Save, refusing a name that is not a model name whoever saves it (the admin's form,
        the shell, a data migration): the queue's Redis keys and the access rules rely on it.

        Raises:
            ValidationError: ``name`` is not a valid model name.
        """
        validate_model_name(self.name)
        super().save(*args, **kwargs)
