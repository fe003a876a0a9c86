from django.db import migrations, models

import tenants.models


class Migration(migrations.Migration):

    dependencies = [
        ('tenants', '0005_usagerecord_billed_tokens'),
    ]

    operations = [
        migrations.CreateModel(
            name='ServedModel',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('name', models.CharField(help_text="The name clients send as 'model' (case-sensitive).", max_length=128, unique=True, validators=[tenants.models.validate_model_name])),
                ('model_path', models.CharField(help_text='The local Hugging Face model folder its workers load.', max_length=1024)),
                ('tokenizer_path', models.CharField(blank=True, help_text='The folder whose tokenizer counts its prompts in the web tier; blank: the model folder.', max_length=1024)),
                ('enabled', models.BooleanField(default=True)),
                ('description', models.CharField(blank=True, max_length=255)),
                ('created_at', models.DateTimeField(auto_now_add=True)),
            ],
            options={
                'verbose_name': 'base model',
                'ordering': ['name'],
            },
        ),
        migrations.AddField(
            model_name='apikey',
            name='allowed_models',
            field=models.TextField(blank=True, help_text="Model names or patterns, one a line or separated by commas; '*' matches within one '/'-separated segment ('vendor/*'). Blank: whatever its tenant allows. A key calls only what both its tenant's and its own rules allow.", validators=[tenants.models.validate_model_rules]),
        ),
        migrations.AddField(
            model_name='tenant',
            name='allowed_models',
            field=models.TextField(blank=True, help_text="Model names or patterns, one a line or separated by commas; '*' matches within one '/'-separated segment ('vendor/*'). Blank: every enabled model.", validators=[tenants.models.validate_model_rules]),
        ),
    ]
