"""Fixtures of the chat tests: members, a chat-ready in-process worker, a private Redis key prefix
per test."""

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
from tests.support.web import (  # noqa: F401, F811 - fixtures
    anyio_backend,
    chat_conf,
    make_member,
    worker,
)
