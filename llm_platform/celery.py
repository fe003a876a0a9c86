"""The Celery app: usage records from the worker's final events, periodic housekeeping.

Start a worker with ``celery -A llm_platform worker``. The broker is ``CELERY_BROKER_URL``
(``REDIS_URL`` by default).
"""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llm_platform.settings")

app = Celery("llm_platform")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
