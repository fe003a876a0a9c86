"""Tenants and what belongs to them: priority tiers, users, API keys, usage records; the base
models served and the LoRA adapters over them."""

from __future__ import annotations

import re
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


# A LoRA adapter's own name (the part after ':' in ``base:adapter``): one part of a model name.
ADAPTER_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
ADAPTER_NAME_MAX = 64


def valid_adapter_name(name: str) -> bool:
    """Whether ``name`` is a valid adapter name (:data:`ADAPTER_NAME_RE`, at most
    :data:`ADAPTER_NAME_MAX` characters)."""
    return len(name) <= ADAPTER_NAME_MAX and ADAPTER_NAME_RE.fullmatch(name) is not None


def validate_adapter_name(name: str) -> None:
    """Check a LoRA adapter's name (:func:`valid_adapter_name`).

    Raises:
        ValidationError: not a valid adapter name.
    """
    if not valid_adapter_name(name):
        raise ValidationError(
            "An adapter's name starts with a letter or digit and holds only letters, digits, "
            "'.', '_' and '-' (no '/', ':' or whitespace), 64 characters at most.",
            code="invalid_name")


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
    # The LoRA adapter the answer was generated under (``base:adapter``), or blank.
    adapter = models.CharField(max_length=200, blank=True)
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


class LoraAdapter(models.Model):
    """A LoRA adapter (PEFT) over a served base model, called as ``{base_model}:{name}``.

    ``owner``: the tenant whose keys may call it (None: every tenant's; shared). Names are per
    tenant: two tenants may each have their own ``base:x``; a tenant's own adapter comes before a
    shared one of the same name. ``folder``
    holds its ``adapter_config.json`` and ``adapter_model.safetensors``, under
    ``ADAPTER_ROOT``. A new or changed adapter is ``pending`` until the Celery task checks it
    (``tenants.adapter_check``): then ``ready``, with its ``rank``, ``target_modules``,
    ``size_bytes`` and ``digest`` (the SHA-256 of its safetensors file) set, or ``refused``
    with the reason in ``refusal``. Only a ready and enabled adapter is served.
    """

    class State(models.TextChoices):
        PENDING = "pending", "Pending"
        READY = "ready", "Ready"
        REFUSED = "refused", "Refused"

    name = models.CharField(
        max_length=ADAPTER_NAME_MAX, validators=[validate_adapter_name],
        help_text="The adapter's part of 'base:adapter' (case-sensitive).")
    base_model = models.CharField(
        max_length=128, validators=[validate_model_name],
        help_text="The name of the served base model it adapts.")
    owner = models.ForeignKey(
        Tenant, null=True, blank=True, on_delete=models.CASCADE, related_name="lora_adapters",
        help_text="The tenant that may call it; blank: shared with every tenant.")
    folder = models.CharField(
        max_length=1024, help_text="Its folder (adapter_config.json, "
                                   "adapter_model.safetensors), under ADAPTER_ROOT.")
    rank = models.PositiveIntegerField(default=0, editable=False)
    target_modules = models.TextField(blank=True, editable=False)
    size_bytes = models.PositiveBigIntegerField(default=0, editable=False)
    digest = models.CharField(max_length=64, blank=True, editable=False)
    state = models.CharField(max_length=8, choices=State.choices, default=State.PENDING,
                             editable=False)
    refusal = models.TextField(blank=True, editable=False)
    enabled = models.BooleanField(default=True)
    created_at = models.DateTimeField(auto_now_add=True)
    validated_at = models.DateTimeField(null=True, blank=True, editable=False)

    class Meta:
        ordering = ["base_model", "name"]
        verbose_name = "LoRA adapter"
        # Each tenant names its adapters apart from every other tenant's (a name another
        # tenant took is no business of its); shared adapters' names are unique among them.
        constraints = [
            models.UniqueConstraint(fields=["owner", "base_model", "name"],
                                    condition=models.Q(owner__isnull=False),
                                    name="unique_tenant_adapter_per_base_model"),
            models.UniqueConstraint(fields=["base_model", "name"],
                                    condition=models.Q(owner__isnull=True),
                                    name="unique_shared_adapter_per_base_model"),
        ]

    def __str__(self) -> str:
        return self.api_name

    @property
    def api_name(self) -> str:
        """What a request sends as ``model``: ``{base_model}:{name}``."""
        return f"{self.base_model}:{self.name}"

    def save(self, *args: Any, **kwargs: Any) -> None:
        """Save, refusing an adapter name or a base model name that is not valid, whoever saves
        it (the resolution of ``base:adapter`` relies on both).

        Raises:
            ValidationError: ``name`` or ``base_model`` is not valid.
        """
        validate_adapter_name(self.name)
        validate_model_name(self.base_model)
        super().save(*args, **kwargs)
