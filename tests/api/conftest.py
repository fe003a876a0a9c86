"""Fixtures of the REST API tests: a private Redis key prefix per test, tenants, an in-process
worker."""

from tests.support.platform import (  # noqa: F401 - fixtures
    inproc_worker,
    keys,
    live_worker,
    make_tenant,
    rclient,
    real_tokenizer,
    redis_prefix,
    stack_idle_before_flush,
    tenant_key,
)
