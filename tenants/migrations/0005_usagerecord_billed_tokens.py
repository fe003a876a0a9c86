from django.db import migrations, models
from django.db.models import F


def charge_in_full(apps, schema_editor):
    """Records written before prices were kept were charged every token they processed."""
    UsageRecord = apps.get_model("tenants", "UsageRecord")
    UsageRecord.objects.using(schema_editor.connection.alias).update(
        billed_tokens=F("prompt_tokens") + F("completion_tokens"))


class Migration(migrations.Migration):

    dependencies = [
        ('tenants', '0004_usagerecord_batch_id'),
    ]

    operations = [
        migrations.AddField(
            model_name='usagerecord',
            name='billed_tokens',
            field=models.PositiveIntegerField(blank=True, null=True),
        ),
        migrations.RunPython(charge_in_full, migrations.RunPython.noop),
        migrations.AlterField(
            model_name='usagerecord',
            name='billed_tokens',
            field=models.PositiveIntegerField(
                blank=True, help_text='Tokens charged (the budget counts these): prompt + '
                                      'completion, batch work at its price per token.'),
        ),
    ]
