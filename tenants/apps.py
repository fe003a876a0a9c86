from django.apps import AppConfig


class TenantsConfig(AppConfig):
    """Tenants, priority tiers, users, API keys and usage records."""

    default_auto_field = "django.db.models.BigAutoField"
    name = "tenants"
