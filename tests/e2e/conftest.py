"""Fixtures of the end-to-end tests (the whole platform as separate processes:
:mod:`tests.support.e2e`)."""

from tests.support.platform import *  # noqa: F403 - the shared fixtures
from tests.support.web import *  # noqa: F403 - the web pages' fixtures
