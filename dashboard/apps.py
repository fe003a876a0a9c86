from django.apps import AppConfig


class DashboardConfig(AppConfig):
    name = "dashboard"
    verbose_name = "Scheduler dashboard"

    def ready(self) -> None:
        from dashboard import signals  # noqa: F401 - connects the usage receiver
