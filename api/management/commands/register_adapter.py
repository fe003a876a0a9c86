"""``manage.py register_adapter --base M --name N --folder PATH (--tenant SLUG | --shared)``:
register a LoRA adapter from a folder under ``ADAPTER_ROOT`` and check it at once; a refused
one is not registered (no row is left)."""

from __future__ import annotations

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError
from django.db import IntegrityError, transaction

from gateway import adapter_validation, adapters
from gateway.model_registry import read_served_models
from tenants.adapters import inside_root, root_folder
from tenants.models import LoraAdapter, Tenant


class Refused(Exception):
    """The adapter's check refused it (the message says why); its row is rolled back."""


class Command(BaseCommand):
    help = ("Register a LoRA adapter (its folder under ADAPTER_ROOT holding adapter_config.json "
            "and adapter_model.safetensors) over a served base model, for one tenant or shared "
            "with all, and check it now; prints its state.")

    def add_arguments(self, parser) -> None:
        parser.add_argument("--base", required=True, help="The served base model's name.")
        parser.add_argument("--name", required=True,
                            help="The adapter's name (the part after ':' in base:adapter).")
        parser.add_argument("--folder", required=True, help="Its folder, under ADAPTER_ROOT.")
        owner = parser.add_mutually_exclusive_group(required=True)
        owner.add_argument("--tenant", help="The slug of the tenant that may call it.")
        owner.add_argument("--shared", action="store_true",
                           help="Every tenant may call it (within its base model's rules).")

    def handle(self, *args, **options) -> None:
        folder = inside_root(options["folder"])
        if folder is None:
            raise CommandError(f"the folder {options['folder']} is not under ADAPTER_ROOT "
                               f"({root_folder()}), symlinks followed")
        owner = None
        if options["tenant"]:
            owner = Tenant.objects.filter(slug=options["tenant"]).first()
            if owner is None:
                raise CommandError(f"no tenant with the slug {options['tenant']!r}")
        if not any(m.name == options["base"] for m in read_served_models()):
            raise CommandError(f"no served base model {options['base']!r}")
        try:
            # The row, and its check, in one transaction: a refused adapter leaves no row (so
            # the same name may be registered again once its files are fixed), and no
            # ``post_delete`` ever runs for it (which would remove a tenant's adapter's folder).
            with transaction.atomic():
                row = LoraAdapter.objects.create(name=options["name"],
                                                 base_model=options["base"], owner=owner,
                                                 folder=str(folder))
                checked = adapter_validation.validate(row.pk)
                if checked is None or checked.state != LoraAdapter.State.READY:
                    reason = (checked.refusal if checked is not None
                              else "it changed while checked")
                    raise Refused(f"{row.api_name}: refused: {reason}")
        except ValidationError as exc:
            raise CommandError(f"adapter not registered: {' '.join(exc.messages)}") from exc
        except IntegrityError as exc:
            raise CommandError(f"an adapter {options['base']}:{options['name']} exists "
                               "already") from exc
        except Refused as exc:
            adapters.forget()  # nothing of the rolled back row is kept
            raise CommandError(f"{exc} (nothing was registered)") from exc
        self.stdout.write(f"{checked.api_name}: ready (rank {checked.rank}, "
                          f"{checked.target_modules}, {checked.size_bytes} bytes, sha256 "
                          f"{checked.digest})")
