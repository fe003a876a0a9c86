"""Fixtures of the gateway tests: a private Redis key prefix per test, tenants, an in-process
worker, and the async tests' event loop."""

from tests.support.adapters import *  # noqa: F403 - LoRA adapters' fixtures
from tests.support.platform import *  # noqa: F403 - the shared fixtures
from tests.support.web import *  # noqa: F403 - the web pages' fixtures
