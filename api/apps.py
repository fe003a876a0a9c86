from django.apps import AppConfig


class ApiConfig(AppConfig):
    """The OpenAI-compatible REST API, health and stats endpoints."""

    default_auto_field = "django.db.models.BigAutoField"
    name = "api"
