"""The web tier (daphne's Django application) never imports torch."""

from __future__ import annotations

import subprocess
import sys

from benchmarks.harness.stack import REPO

PROBE = """
import sys
import django
django.setup()
import llm_platform.asgi, api.views, chat.consumers, dashboard.views, dashboard.metrics
from django.urls import get_resolver
get_resolver().url_patterns  # every view module the URLconf names
print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
"""


def test_loading_the_asgi_application_and_every_view_does_not_import_torch():
    result = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, capture_output=True,
                            text=True, timeout=120,
                            env={"DJANGO_SETTINGS_MODULE": "llm_platform.settings",
                                 "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"
