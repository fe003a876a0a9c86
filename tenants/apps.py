from django.apps import AppConfig


class TenantsConfig(AppConfig):
    """Tenants, priority tiers, users, API keys and usage records."""

    default_auto_field = "django.db.models.BigAutoField"
    name = "tenants"

    def ready(self) -> None:
        from django.contrib.auth.signals import user_logged_in

        from tenants.signals import update_last_login

        # A user's last_login is a hint for people: a sign-in the database stored the session
        # of is not failed for it (Django's own receiver would).
        if user_logged_in.disconnect(dispatch_uid="update_last_login"):
            user_logged_in.connect(update_last_login, dispatch_uid="update_last_login")
