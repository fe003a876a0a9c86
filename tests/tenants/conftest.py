"""Fixtures of the tenants tests: tenants, members, a private Redis key prefix per test."""

from tests.support.adapters import *  # noqa: F403 - LoRA adapters' fixtures
from tests.support.platform import *  # noqa: F403 - the shared fixtures
from tests.support.web import *  # noqa: F403 - the web pages' fixtures
