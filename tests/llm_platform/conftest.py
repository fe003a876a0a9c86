"""Fixtures of the Django project's tests: members, a private Redis key prefix per test."""

from tests.support.platform import *  # noqa: F403 - the shared fixtures
from tests.support.web import *  # noqa: F403 - the web pages' fixtures
