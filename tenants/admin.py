"""Admin for tenants, tiers, users, keys, usage, the base models served and the LoRA adapters
over them. A new key is shown once, on the page that answers the form that made it."""

from __future__ import annotations

from django import forms
from django.contrib import admin
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.utils.cache import add_never_cache_headers

from tenants import adapters
from tenants.models import (
    ApiKey,
    LoraAdapter,
    Membership,
    PriorityTier,
    ServedModel,
    Tenant,
    UsageRecord,
)
from tenants.services import VISIBLE_PREFIX_LEN, generate_raw_key, hash_key, revoke_api_key


@admin.register(PriorityTier)
class PriorityTierAdmin(admin.ModelAdmin):
    list_display = ["name", "priority", "description"]


class ApiKeyInline(admin.TabularInline):
    model = ApiKey
    extra = 0
    fields = ["prefix", "name", "is_operator", "created_at", "last_used_at", "revoked_at"]
    readonly_fields = ["prefix", "created_at", "last_used_at"]
    show_change_link = True

    def has_add_permission(self, request: HttpRequest, obj=None) -> bool:
        # Keys are created on their own page, which shows the raw key once.
        return False


class MembershipInline(admin.TabularInline):
    model = Membership
    extra = 0
    autocomplete_fields = ["user"]


@admin.register(Tenant)
class TenantAdmin(admin.ModelAdmin):
    list_display = [
        "name", "slug", "tier", "fairness_weight", "requests_per_minute", "tokens_per_minute",
        "max_concurrent_requests", "token_budget", "budget_period", "is_active",
    ]
    list_editable = ["tier", "fairness_weight", "is_active"]
    list_filter = ["tier", "is_active"]
    search_fields = ["name", "slug"]
    prepopulated_fields = {"slug": ["name"]}
    inlines = [MembershipInline, ApiKeyInline]


@admin.register(ServedModel)
class ServedModelAdmin(admin.ModelAdmin):
    """The registry of base models; the deployment's default model is served without an entry
    (see :class:`~tenants.models.ServedModel`)."""

    list_display = ["name", "enabled", "model_path", "tokenizer_path", "description",
                    "created_at"]
    list_filter = ["enabled"]
    search_fields = ["name", "description", "model_path"]
    readonly_fields = ["created_at"]


class LoraAdapterForm(forms.ModelForm):
    """An adapter's form: its folder must lie under ``ADAPTER_ROOT`` (symlinks followed)."""

    class Meta:
        model = LoraAdapter
        fields = ["name", "base_model", "owner", "folder", "enabled"]

    def clean_folder(self) -> str:
        folder = self.cleaned_data["folder"].strip()
        inside = adapters.inside_root(folder)
        if inside is None:
            raise forms.ValidationError(
                f"The folder must lie under ADAPTER_ROOT ({adapters.root_folder()}).")
        return str(inside)


@admin.register(LoraAdapter)
class LoraAdapterAdmin(admin.ModelAdmin):
    """LoRA adapters: uploaded by tenants (``POST /v1/adapters``) or registered by an operator
    (``manage.py register_adapter``, or here). A new adapter, or one whose folder or base model
    changes, is checked again by the Celery task (pending until then)."""

    form = LoraAdapterForm
    list_display = ["__str__", "owner", "state", "refusal", "enabled", "rank", "size_bytes",
                    "created_at", "validated_at"]
    list_filter = ["state", "enabled", "base_model", "owner"]
    search_fields = ["name", "base_model", "owner__slug", "digest"]
    readonly_fields = ["state", "refusal", "rank", "target_modules", "size_bytes", "digest",
                       "created_at", "validated_at"]
    actions = ["validate_again"]

    def save_model(self, request: HttpRequest, obj: LoraAdapter, form, change: bool) -> None:
        recheck = not change or bool({"folder", "base_model", "name"} & set(form.changed_data))
        if recheck:
            obj.state, obj.refusal = LoraAdapter.State.PENDING, ""
        super().save_model(request, obj, form, change)
        if recheck:
            adapters.queue_validation(obj.pk)

    @admin.action(description="Validate again", permissions=["change"])
    def validate_again(self, request: HttpRequest, queryset) -> None:
        """Queue the check of every selected adapter; each keeps its state until the check
        has run (``validated_at`` then moves)."""
        ids = list(queryset.values_list("pk", flat=True))
        for pk in ids:
            adapters.queue_validation(pk)
        self.message_user(request, f"Queued the validation of {len(ids)} adapter(s).")


@admin.register(Membership)
class MembershipAdmin(admin.ModelAdmin):
    list_display = ["user", "tenant", "created_at"]
    list_filter = ["tenant"]
    autocomplete_fields = ["user"]


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = ["prefix", "name", "tenant", "is_operator", "created_at", "last_used_at",
                    "revoked_at"]
    list_filter = ["tenant", "is_operator"]
    search_fields = ["prefix", "name", "tenant__name"]
    readonly_fields = ["prefix", "created_at", "last_used_at"]
    actions = ["revoke"]

    def get_readonly_fields(self, request: HttpRequest, obj: ApiKey | None = None) -> list[str]:
        """A key's tenant is chosen when it is made and never changes (its usage is billed
        there)."""
        return [*self.readonly_fields, "tenant"] if obj is not None else self.readonly_fields

    def save_model(self, request: HttpRequest, obj: ApiKey, form, change: bool) -> None:
        if not change:
            raw = generate_raw_key()
            obj.prefix = raw[:VISIBLE_PREFIX_LEN]
            obj.hashed_key = hash_key(raw)
            super().save_model(request, obj, form, change)
            obj._raw_key = raw  # for response_add, which shows it: never stored
            return
        super().save_model(request, obj, form, change)

    def response_add(self, request: HttpRequest, obj: ApiKey,
                     post_url_continue: str | None = None) -> HttpResponse:
        """The page answering the form that made ``obj``, which shows its raw key once.

        The key is written into this page only, never into a cookie (Django's messages travel
        in one, signed but readable), the session or the database; the page is not cached."""
        raw = getattr(obj, "_raw_key", None)
        if raw is None:
            return super().response_add(request, obj, post_url_continue)
        context = {
            **self.admin_site.each_context(request),
            "title": "API key created",
            "opts": self.opts,
            "key": obj,
            "raw_key": raw,
            "has_change_permission": self.has_change_permission(request, obj),
            "has_add_permission": self.has_add_permission(request),
        }
        response = TemplateResponse(request, "admin/tenants/apikey/created.html", context)
        add_never_cache_headers(response)
        return response

    # Only for users who may change keys: the admin then neither offers nor runs it for others.
    @admin.action(description="Revoke the selected keys", permissions=["change"])
    def revoke(self, request: HttpRequest, queryset) -> None:
        """Revoke every selected key (already revoked ones stay as they are)."""
        for key in queryset:
            revoke_api_key(key)
        self.message_user(request, f"Revoked {queryset.count()} key(s).")


class ServiceClassFilter(admin.SimpleListFilter):
    """Usage of batch work (Batch API lines, ``batch_id`` set) or of interactive requests."""

    title = "service class"
    parameter_name = "service_class"

    def lookups(self, request: HttpRequest, model_admin) -> list[tuple[str, str]]:
        return [("batch", "Batch"), ("interactive", "Interactive")]

    def queryset(self, request: HttpRequest, queryset):
        if self.value() == "batch":
            return queryset.exclude(batch_id="")
        if self.value() == "interactive":
            return queryset.filter(batch_id="")
        return queryset


@admin.register(UsageRecord)
class UsageRecordAdmin(admin.ModelAdmin):
    """Usage records: the tokens processed, and the tokens charged (``billed_tokens``: batch
    work at its price per token) beside the batch a line belongs to."""

    list_display = ["request_id", "tenant", "api_key", "model", "adapter", "prompt_tokens",
                    "cached_prompt_tokens", "completion_tokens", "billed_tokens", "batch_id",
                    "ttft_s", "duration_s", "finish_reason", "status", "created_at"]
    list_filter = ["tenant", ServiceClassFilter, "finish_reason", "status"]
    search_fields = ["request_id", "batch_id", "adapter"]
    date_hierarchy = "created_at"

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj=None) -> bool:
        return False
