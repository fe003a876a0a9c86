"""A worker's counter updates survive a lost reply: applied once, not once per try.

Between the worker and a real Redis sits a TCP proxy that, when armed, lets a script call reach
Redis and drops the connection instead of passing its reply on (what a Redis killed right after
writing a call, or a dropped connection, does). The worker's Redis client retries such a call on a
new connection (``redis_retry_options``): the held count of gate 1 and the fairness counters
must still move once.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import uuid

import pytest
import redis
from django.conf import settings as django_settings

from inference.protocol.keys import Keys, redis_retry_options
from inference.protocol.messages import RequestMessage
from inference.worker.fair_queue import FairQueue


class ReplyDropper:
    """A TCP proxy to Redis; :meth:`arm` makes it drop the reply to the next script call
    (``EVALSHA``, or the next round holding ``command``) that Redis ran, closing that
    connection."""

    def __init__(self, host: str, port: int):
        self.target = (host, port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.armed = threading.Event()
        self.command = b"EVALSHA"
        self.dropped = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def arm(self, command: bytes = b"EVALSHA") -> None:
        self.command = command
        self.armed.set()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            state = {"script": False}
            threading.Thread(target=self._up, args=(client, upstream, state), daemon=True).start()
            threading.Thread(target=self._down, args=(upstream, client, state),
                             daemon=True).start()

    def _up(self, client: socket.socket, upstream: socket.socket, state: dict) -> None:
        while data := _recv(client):
            state["script"] = self.command in data.upper()
            upstream.sendall(data)
        _close(client, upstream)

    def _down(self, upstream: socket.socket, client: socket.socket, state: dict) -> None:
        while data := _recv(upstream):
            ran = state["script"] and not data.startswith(b"-NOSCRIPT")
            if ran and self.armed.is_set():
                self.armed.clear()
                self.dropped += 1
                break  # Redis ran it; its client never hears so
            client.sendall(data)
        _close(client, upstream)

    def close(self) -> None:
        self.listener.close()


def _recv(sock: socket.socket) -> bytes:
    with contextlib.suppress(OSError):
        return sock.recv(65536)
    return b""


def _close(*socks: socket.socket) -> None:
    for sock in socks:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)  # wakes the thread reading it
        with contextlib.suppress(OSError):
            sock.close()


@pytest.fixture
def dropper():
    url = redis.connection.parse_url(django_settings.REDIS_URL)
    proxy = ReplyDropper(url.get("host", "127.0.0.1"), int(url.get("port", 6379)))
    yield proxy
    proxy.close()


@pytest.fixture
def worker_queue(dropper, redis_prefix):
    """The queue of a worker whose Redis client (the worker's retry options) goes through the
    proxy."""
    client = redis.Redis(host="127.0.0.1", port=dropper.port, db=_db(), **redis_retry_options())
    yield FairQueue(client, Keys(redis_prefix), "w1", "vtc")
    client.close()


def _db() -> int:
    return int(redis.connection.parse_url(django_settings.REDIS_URL).get("db", 0))


def message(key: str) -> RequestMessage:
    return RequestMessage(request_id=uuid.uuid4().hex, tenant=key, fairness_key=key,
                          priority=0, prompt="hi")


def test_a_release_whose_reply_was_lost_lowers_gate_one_once(worker_queue, dropper):
    for _ in range(3):
        worker_queue.enqueue(message("acme"))
    worker_queue.take(3)
    worker_queue.release_held(1)  # one admitted
    assert worker_queue.gate1() == 2
    dropper.arm()
    worker_queue.release_held(1)  # another admitted: Redis ran it, its reply was lost, retried
    assert dropper.dropped == 1
    assert worker_queue.gate1() == 1  # the one still held by the worker
    worker_queue.release_held(1)
    assert worker_queue.gate1() == 0


def test_a_release_sent_when_redis_was_unreachable_goes_with_the_next_call(
        worker_queue, dropper, monkeypatch):
    for _ in range(2):
        worker_queue.enqueue(message("acme"))
    worker_queue.take(2)
    calls = {"n": 0}
    real = worker_queue._run

    def unreachable_once(name, *args):
        calls["n"] += 1
        if calls["n"] == 1:
            raise redis.ConnectionError("Redis is down")
        return real(name, *args)

    monkeypatch.setattr(worker_queue, "_run", unreachable_once)
    with pytest.raises(redis.ConnectionError):
        worker_queue.release_held(1)
    assert worker_queue.gate1() == 2
    worker_queue.release_held(0)  # the next round: what was not sent goes now
    assert worker_queue.gate1() == 1


def test_a_charge_whose_reply_was_lost_adds_its_service_once(worker_queue, dropper, rclient,
                                                             keys):
    worker_queue.enqueue(message("acme"))
    worker_queue.charge({"acme": 10.0})
    dropper.arm()
    worker_queue.charge({"acme": 5.0})
    assert dropper.dropped == 1
    assert float(rclient.hget(keys.fq("counter"), "acme")) == pytest.approx(15.0)


def test_a_heartbeat_that_finds_redis_wiped_after_it_read_the_epoch_bills_what_was_computed(
        rclient, keys, monkeypatch):
    """Redis lost its data between a heartbeat's epoch read and its registration: the worker is
    gone from the heartbeats as if reclaimed, but no one reclaimed its requests. They end as
    requests Redis lost (billed for what was computed, their finals written), not as stale
    takes another worker serves."""
    from inference.engine.config import EngineConfig
    from inference.engine.llm_engine import LLMEngine
    from inference.worker.bridge import WorkerBridge

    engine = LLMEngine(EngineConfig(backend="reference", max_model_len=256))
    try:
        bridge = WorkerBridge(engine, rclient, keys, "w-wiped", prefetch=1)
        message = RequestMessage(request_id=uuid.uuid4().hex, tenant="t", fairness_key="t",
                                 prompt="hi", sampling={"max_tokens": 4})
        FairQueue(rclient, keys, "tool", "vtc").enqueue(message)
        bridge.publish_stats(10)  # registered, the epoch read
        assert bridge.poll() == 1
        for key in rclient.scan_iter(f"{keys.prefix}:*"):  # Redis restarted empty
            rclient.delete(key)
        # The heartbeat's epoch read came just before the loss.
        monkeypatch.setattr(bridge.recovery, "check_epoch", lambda: None)
        bridge.publish_stats(10)
        assert message.request_id in bridge.state.wiped  # billed as computed, final written
        monkeypatch.undo()
        bridge.publish_stats(10)  # afresh: registered again, under the new epoch
        assert rclient.zscore(keys.workers, "w-wiped") is not None
    finally:
        engine.shutdown(1)


def test_a_heartbeat_whose_reply_was_lost_is_not_taken_for_a_reclaim(dropper, redis_prefix):
    """The client sends a heartbeat round again after a lost reply; the same score again changes
    nothing in Redis, which is no sign that the worker was reclaimed: it keeps serving."""
    from inference.engine.config import EngineConfig
    from inference.engine.llm_engine import LLMEngine
    from inference.worker.bridge import WorkerBridge

    keys = Keys(redis_prefix)
    client = redis.Redis(host="127.0.0.1", port=dropper.port, db=_db(), **redis_retry_options())
    engine = LLMEngine(EngineConfig(backend="reference", max_model_len=256))
    try:
        bridge = WorkerBridge(engine, client, keys, "w-beat", prefetch=1)
        queued = message("t")
        FairQueue(client, keys, "tool", "vtc").enqueue(queued)
        bridge.publish_stats(10)  # registered
        assert bridge.poll() == 1
        dropper.arm(b"ZADD")
        bridge.publish_stats(10)  # Redis ran it; the reply is lost; the client sends it again
        assert dropper.dropped == 1
        assert bridge.state.holds_any()  # not stopped as a reclaimed worker's stale take
        assert bridge.state.registered
    finally:
        engine.shutdown(1)
        client.close()
