"""Fixtures of the chat tests: members, a chat-ready in-process worker, a private Redis key prefix
per test."""

from tests.support.platform import *  # noqa: F403 - the shared fixtures
from tests.support.web import *  # noqa: F403 - the web pages' fixtures
