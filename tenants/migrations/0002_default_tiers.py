"""Create the default priority tiers."""

from django.db import migrations

DEFAULT_TIERS = [
    ("premium", 10, "Admitted before standard and batch work."),
    ("standard", 0, "The default tier."),
    ("batch", -10, "Served when nothing more urgent waits."),
]


def create_tiers(apps, schema_editor):
    PriorityTier = apps.get_model("tenants", "PriorityTier")
    for name, priority, description in DEFAULT_TIERS:
        PriorityTier.objects.get_or_create(
            name=name, defaults={"priority": priority, "description": description}
        )


class Migration(migrations.Migration):
    dependencies = [("tenants", "0001_initial")]

    operations = [migrations.RunPython(create_tiers, migrations.RunPython.noop)]
