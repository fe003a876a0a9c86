"""``manage.py ensure_demo_tenant``: create the demo tenant once and print its key."""

from django.core.management.base import BaseCommand

from tenants.services import demo_key_file, ensure_demo_tenant


class Command(BaseCommand):
    help = "Create the demo tenant with an operator key if missing; print the key."

    def handle(self, *args, **options) -> None:
        tenant, raw = ensure_demo_tenant()
        self.stderr.write(f"Demo tenant {tenant.slug!r}; key kept in {demo_key_file()}")
        self.stdout.write(raw or "")
