"""Fixtures of the REST API tests: a private Redis key prefix per test, tenants, an in-process
worker."""

from tests.support.platform import *  # noqa: F403 - the shared fixtures
