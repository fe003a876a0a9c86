"""``manage.py ensure_demo_tenant``: create the demo tenant once and print its key."""

from django.core.management.base import BaseCommand

from tenants.services import demo_key_file, ensure_demo_tenant, ensure_demo_user


class Command(BaseCommand):
    help = ("Create the demo tenant with an operator key, and a staff user 'demo' in it, if "
            "missing; print the key (and, with --user, the user's name and password).")

    def add_arguments(self, parser) -> None:
        parser.add_argument("--user", action="store_true",
                            help="also print 'username password' of the demo user")

    def handle(self, *args, **options) -> None:
        tenant, raw = ensure_demo_tenant()
        username, password = ensure_demo_user(tenant)
        self.stderr.write(f"Demo tenant {tenant.slug!r}; key kept in {demo_key_file()}")
        self.stdout.write(raw or "")
        if options["user"]:
            self.stdout.write(f"{username} {password}")
