"""``manage.py create_tenant NAME``: create a tenant with one API key and print the key."""

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError

from tenants.models import PriorityTier, Tenant
from tenants.services import create_tenant


class Command(BaseCommand):
    help = "Create a tenant with one API key and print the key (it is shown only once)."

    def add_arguments(self, parser) -> None:
        parser.add_argument("name")
        parser.add_argument("--slug", default="")
        parser.add_argument("--tier", default="standard", help="Priority tier name.")
        parser.add_argument("--fairness-weight", type=float, default=1.0)
        parser.add_argument("--rpm", type=int, default=0, help="Requests per minute (0: none).")
        parser.add_argument("--tpm", type=int, default=0, help="Tokens per minute (0: none).")
        parser.add_argument("--max-concurrent", type=int, default=0)
        parser.add_argument("--token-budget", type=int, default=0)
        parser.add_argument("--budget-period", default=Tenant.BudgetPeriod.MONTH,
                            choices=Tenant.BudgetPeriod.values)
        parser.add_argument("--operator", action="store_true",
                            help="The key may also read /scheduler/stats.")
        parser.add_argument("--allowed-models", default="", metavar="RULES",
                            help="The models its keys and chat users may call: names and "
                                 "patterns, comma- or line-separated (docs/platform.md, "
                                 "\"Access\"); blank: every enabled model.")

    def handle(self, *args, **options) -> None:
        try:
            tier = PriorityTier.objects.get(name=options["tier"])
        except PriorityTier.DoesNotExist as exc:
            names = ", ".join(PriorityTier.objects.values_list("name", flat=True))
            raise CommandError(f"no priority tier {options['tier']!r}; known: {names}") from exc
        try:
            tenant, key, raw = self._create(tier, options)
        except ValidationError as exc:
            problems = "; ".join(f"{field}: {' '.join(messages)}"
                                 for field, messages in exc.message_dict.items())
            raise CommandError(f"tenant not created: {problems}") from exc
        self.stderr.write(f"Created tenant {tenant.slug!r} (tier {tier.name}), key {key.prefix}…")
        self.stdout.write(raw)

    @staticmethod
    def _create(tier, options):
        return create_tenant(
            options["name"],
            slug=options["slug"],
            tier=tier,
            fairness_weight=options["fairness_weight"],
            operator_key=options["operator"],
            requests_per_minute=options["rpm"],
            tokens_per_minute=options["tpm"],
            max_concurrent_requests=options["max_concurrent"],
            token_budget=options["token_budget"],
            budget_period=options["budget_period"],
            allowed_models=options["allowed_models"],
        )
