"""Fixtures of the chat and dashboard tests; the platform's fixtures are shared from
tests/platform (a private Redis prefix per test, tenants, an in-process worker)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from tests.platform.conftest import (  # noqa: F401 - fixtures shared with the platform tests
    InProcessWorker,
    inproc_worker,
    keys,
    live_worker,
    make_tenant,
    rclient,
    redis_prefix,
    stack_idle_before_flush,
    tenant_key,
)

PASSWORD = "a-long-test-password"


@pytest.fixture
def anyio_backend() -> str:
    """Async tests (``pytest.mark.anyio``) run on asyncio, as daphne does."""
    return "asyncio"


@pytest.fixture
def make_member(make_tenant):  # noqa: F811 - the shared fixture
    """Create a user belonging to a tenant: ``make_member(tenant=None, **user_fields)``."""
    from django.contrib.auth import get_user_model

    from tenants.models import Membership

    def make(tenant=None, **fields: Any):
        if tenant is None:
            tenant = make_tenant()[0]
        username = fields.pop("username", f"u-{uuid.uuid4().hex[:8]}")
        user = get_user_model().objects.create_user(username, password=PASSWORD, **fields)
        Membership.objects.create(user=user, tenant=tenant)
        return user

    return make
