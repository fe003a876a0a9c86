"""Fixtures of the REST API tests: a private Redis key prefix per test, tenants, an in-process
worker."""

from tests.support.adapters import *  # noqa: F403 - LoRA adapters' fixtures
from tests.support.platform import *  # noqa: F403 - the shared fixtures
