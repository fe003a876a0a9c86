"""``Stack.wait_idle`` (a test's teardown waits on it before the database is flushed) waits for
requests waiting in any base model's queue, not only the default model's."""

from __future__ import annotations

import threading
import time

import redis

from benchmarks.harness.stack import Stack
from inference.protocol.keys import Keys
from inference.worker.fair_queue import FairQueue
from tests.worker.test_fair_queue import message


def test_it_waits_while_another_models_queue_holds_a_request(tmp_path, settings):
    rclient = redis.Redis.from_url(settings.REDIS_URL)
    stack = Stack("sqlite://", settings.REDIS_URL, tmp_path, workers=0)  # never started
    keys = Keys(stack.prefix)
    other = keys.of_model("other-model", "default-model")
    queue = FairQueue(rclient, other, "w1", "vtc")

    def withdraw() -> None:  # its deadline passed: ended, and its usage entry taken away
        queue.expire(60)
        rclient.delete(keys.usage_pending)

    try:
        queue.enqueue(message("acme", deadline_s=1.0))
        assert rclient.sismember(keys.queues, other.queue)
        threading.Timer(1.5, withdraw).start()
        started = time.monotonic()
        stack.wait_idle(timeout_s=8)
        waited = time.monotonic() - started
        assert 1.5 + 1.2 < waited < 8  # until it was withdrawn, then quiet; not the timeout
    finally:
        for key in rclient.scan_iter(f"{stack.prefix}*"):
            rclient.delete(key)
