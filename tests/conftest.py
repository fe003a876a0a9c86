"""What every test shares: the marks that the CI lanes select on (``scripts/test.sh``).

A test that uses a fixture starting a server process of its own (a private ``redis-server``, the
whole platform) is marked ``process``, and one that uses the real browser ``browser``, whatever
its module says, so that the fast lane (no process, browser or model) never starts one.
"""

from __future__ import annotations

import pytest

# Fixtures that start a process (a redis-server of the test's own, the platform's processes).
PROCESS_FIXTURES = frozenset({
    "private_redis", "volatile_redis", "durable_redis", "quiet_redis", "stack",
})
BROWSER_FIXTURES = frozenset({"browser"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        used = set(getattr(item, "fixturenames", ()))
        if used & PROCESS_FIXTURES:
            item.add_marker(pytest.mark.process)
        if used & BROWSER_FIXTURES:
            item.add_marker(pytest.mark.browser)
