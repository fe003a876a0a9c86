"""The Celery app: usage records from the worker's final events, periodic housekeeping, the
Batch API's steps.

Start a worker with ``celery -A llm_platform worker``. The broker is ``CELERY_BROKER_URL``
(``REDIS_URL`` by default).
"""

import os

from celery import Celery
from celery.signals import worker_process_init, worker_ready

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llm_platform.settings")

app = Celery("llm_platform")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@worker_ready.connect
@worker_process_init.connect
def load_tokenizer(**_: object) -> None:
    """Load the model's tokenizer when a process that runs tasks starts (the worker of the solo
    pool once it is ready, each child of a prefork pool), not in the first batch step: the steps
    count their lines' prompt tokens in this process, and the load (about 0.3 s of CPU) would
    otherwise land beside the requests the engine serves as a batch starts."""
    from gateway.tokens import tokenizer

    tokenizer()
