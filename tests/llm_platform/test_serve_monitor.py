"""A web process (``python -m llm_platform.serve``) runs its monitor from the moment it serves,
not from its first request: its heartbeat is there before any client came, and its sight of
Redis is continuous by the time a worker dies (a monitor started by the first request judges
that death a heartbeat TTL later than it could)."""

from __future__ import annotations

import time
import uuid

import pytest
import redis

from inference.protocol.keys import Keys
from tests.support.web_process import WebProcess

pytestmark = pytest.mark.process


def test_the_web_heartbeat_is_published_before_any_request(tmp_path, settings):
    prefix = f"test-{uuid.uuid4().hex[:10]}"
    web = WebProcess(f"sqlite:///{tmp_path}/db.sqlite3", tmp_path / "daphne.log",
                     REDIS_PREFIX=prefix, REDIS_URL=settings.REDIS_URL)
    client = redis.Redis.from_url(settings.REDIS_URL)
    try:
        deadline = time.monotonic() + 30
        while not client.zcard(Keys(prefix).web) and time.monotonic() < deadline:
            assert web.proc.poll() is None, web.log.read_text()[-3000:]
            time.sleep(0.1)
        beats = client.zrange(Keys(prefix).web, 0, -1, withscores=True)
    finally:
        web.stop()
        for key in client.scan_iter(f"{prefix}:*"):
            client.delete(key)
    assert len(beats) == 1 and time.time() - beats[0][1] < 10
