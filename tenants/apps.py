from django.apps import AppConfig


class TenantsConfig(AppConfig):
    """Tenants, priority tiers, users, API keys and usage records."""

    default_auto_field = "django.db.models.BigAutoField"
    name = "tenants"

    def ready(self) -> None:
        from django.contrib.auth.signals import user_logged_in
        from django.db.models.signals import post_delete

        from tenants.adapters import remove_files_of
        from tenants.models import LoraAdapter
        from tenants.signals import update_last_login

        # A tenant's adapter's files go with its row, however it is deleted.
        post_delete.connect(remove_files_of, sender=LoraAdapter,
                            dispatch_uid="tenants.adapter_files")

        # A user's last_login is a hint for people: a sign-in the database stored the session
        # of is not failed for it (Django's own receiver would).
        if user_logged_in.disconnect(dispatch_uid="update_last_login"):
            user_logged_in.connect(update_last_login, dispatch_uid="update_last_login")
