"""Fixtures of the tests that use Redis and the database: a private Redis key prefix per test,
tenants and keys, a fake worker heartbeat, an in-process worker over real Redis."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from inference.protocol.keys import Keys, redis_retry_options
from inference.protocol.messages import UsageReport

# The fixtures a folder's conftest.py takes with ``from tests.support.platform import *``.
__all__ = ["inproc_worker", "inproc_worker_long", "keys", "live_worker", "make_tenant", "rclient",
           "real_tokenizer", "redis_prefix", "stack_idle_before_flush", "tenant_key"]


@pytest.fixture(autouse=True)
def redis_prefix(settings) -> Iterator[str]:
    """A fresh Redis key prefix for this test (its keys are deleted afterwards)."""
    prefix = f"test-{uuid.uuid4().hex[:10]}"
    settings.LLM_PLATFORM = {**settings.LLM_PLATFORM, "REDIS_PREFIX": prefix}
    yield prefix
    client = redis.Redis.from_url(settings.REDIS_URL)
    keys = list(client.scan_iter(f"{prefix}:*", count=1000))
    if keys:
        client.delete(*keys)


@pytest.fixture(autouse=True)
def stack_idle_before_flush(request) -> Iterator[None]:
    """For tests on a running stack: let it go idle before the database is flushed.

    Requesting ``transactional_db`` from here makes its teardown (the flush) run after ours.
    """
    if "stack" not in request.fixturenames:
        yield
        return
    request.getfixturevalue("transactional_db")
    stack = request.getfixturevalue("stack")
    yield
    stack.wait_idle()


@pytest.fixture
def keys(redis_prefix: str) -> Keys:
    return Keys(redis_prefix)


@pytest.fixture
def rclient(settings) -> redis.Redis:
    return redis.Redis.from_url(settings.REDIS_URL)


@pytest.fixture
def live_worker(rclient: redis.Redis, keys: Keys) -> str:
    """Register a worker heartbeat (no process behind it) so requests are accepted."""
    rclient.zadd(keys.workers, {"fake-worker": time.time() + 3600})
    return "fake-worker"


@pytest.fixture
def make_tenant(db):
    """Create a tenant with one key: ``make_tenant(name, **limits) -> (tenant, key, raw_key)``."""
    from tenants.services import create_tenant

    def make(name: str | None = None, **kwargs: Any):
        name = name or f"t-{uuid.uuid4().hex[:8]}"
        return create_tenant(name, **kwargs)

    return make


@pytest.fixture
def tenant_key(make_tenant):
    """A tenant without limits and its raw key."""
    tenant, key, raw = make_tenant()
    return tenant, key, raw


class InProcessWorker:
    """A reference-backend engine and its Redis bridge, polled by a thread of this process, as
    ``inference.worker.main`` runs them (heartbeats last an hour unless ``heartbeat_ttl_s``
    says), serving the queue of ``model`` (empty: the default model's)."""

    def __init__(self, prefix: str, redis_url: str, *, prefetch: int = 1,
                 worker_id: str = "inproc", heartbeat_ttl_s: float = 3600,
                 heartbeat_interval_s: float = 0.05, drain_s: float = 5, web_ttl_s: float = 10,
                 event_hold_s: float = 0.0, model: str = "", **engine_settings: Any):
        import threading

        from inference.engine.config import EngineConfig
        from inference.engine.llm_engine import LLMEngine
        from inference.worker.bridge import WorkerBridge

        config = EngineConfig(backend="reference", **engine_settings)
        self.engine = LLMEngine(config)
        self.client = redis.Redis.from_url(redis_url, **redis_retry_options())
        self.heartbeat_interval_s = heartbeat_interval_s
        self.drain_s = drain_s
        self.usage: list[UsageReport] = []
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.keys = Keys(prefix, model)
        self.bridge = WorkerBridge(self.engine, self.client, self.keys, worker_id,
                                   prefetch=prefetch, usage_sink=self._report,
                                   web_ttl_s=web_ttl_s, heartbeat_ttl_s=heartbeat_ttl_s,
                                   event_hold_s=event_hold_s, model=model)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _report(self, request_id: str) -> None:
        """The usage sink: the report of the ledger entry (as the Celery task reads it)."""
        from gateway.usage import report_from_entry

        raw = self.client.hget(self.keys.usage_pending, request_id)
        if raw is not None:
            self.usage.append(report_from_entry(request_id, raw))

    def _loop(self) -> None:
        from inference.worker.main import serve

        serve(self.bridge, self._stop, heartbeat_ttl_s=self.heartbeat_ttl_s,
              heartbeat_interval_s=self.heartbeat_interval_s, poll_block_ms=20,
              drain_s=self.drain_s)

    def start(self) -> InProcessWorker:
        self.bridge.publish_stats(self.heartbeat_ttl_s)
        self.bridge.start_publisher()
        self.engine.start()
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 10) -> None:
        """Drain and stop (as SIGTERM does to a worker process)."""
        self._stop.set()
        self._thread.join(timeout_s)


@pytest.fixture
def inproc_worker(redis_prefix: str, settings) -> Iterator[InProcessWorker]:
    """A running in-process worker (reference backend, context of 256 tokens)."""
    worker = InProcessWorker(redis_prefix, settings.REDIS_URL, max_model_len=256,
                             max_batch_size=4).start()
    yield worker
    worker.stop()


@pytest.fixture
def inproc_worker_long(redis_prefix: str, settings) -> Iterator[InProcessWorker]:
    """A running in-process worker with a context of 4096 tokens (the reference backend's
    tokens are bytes: a prompt offering tools takes about 500)."""
    worker = InProcessWorker(redis_prefix, settings.REDIS_URL, max_model_len=4096,
                             max_batch_size=4).start()
    yield worker
    worker.stop()


@pytest.fixture(scope="module")
def real_tokenizer():
    """The default model's tokenizer and chat template (skips when the model is not prepared)."""
    from inference.protocol.models import model_folder
    from inference.tokenization import Tokenizer

    folder = model_folder()
    if not (folder / "tokenizer.json").is_file():
        pytest.skip(f"the default model is not prepared in {folder}")
    return Tokenizer.from_folder(folder)
