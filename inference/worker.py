"""The inference worker process: ``python -m inference.worker``.

Loads the model, runs the engine's scheduler loop on its own thread, takes requests from the
Redis requests streams (one per priority tier, highest tier first; consumer groups: several
workers share the load), writes each request's events, takes aborts from the control channel,
publishes its stats with a heartbeat, and hands each finished request's usage to Celery (by task
name; the worker does not import Django).

SIGTERM or SIGINT stops it cleanly: it takes no new work, requests not yet admitted go back to
their tier's stream for another worker, requests in flight end with a ``worker_shutdown`` error
event.

Settings (environment): the engine's (:class:`inference.config.EngineConfig`) and those of
:class:`WorkerSettings`.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from typing import Any

import redis
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from inference.bridge import UsageSink, WorkerBridge
from inference.config import EngineConfig
from inference.protocol import USAGE_TASK_NAME, Keys

log = logging.getLogger("inference.worker")


class WorkerSettings(BaseSettings):
    """Settings of the worker process itself (times in seconds)."""

    model_config = SettingsConfigDict(case_sensitive=False, extra="ignore")

    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_prefix: str = "llm"
    worker_id: str = Field("", description="Consumer name; empty: host-pid.")
    # Requests held in the engine's pending queue at most; 0: MAX_BATCH_SIZE.
    worker_prefetch: int = Field(0, ge=0)
    heartbeat_interval_s: float = Field(1.0, gt=0)
    worker_heartbeat_ttl_s: float = Field(10.0, gt=0)
    shutdown_timeout_s: float = Field(10.0, ge=0)
    poll_block_ms: int = Field(50, ge=1)
    # Where usage goes; empty: CELERY_BROKER_URL's default, REDIS_URL. "none" disables it.
    celery_broker_url: str = ""
    celery_task_default_queue: str = "celery"


def celery_usage_sink(broker_url: str, queue: str) -> UsageSink:
    """Send usage payloads to the Celery task ``api.tasks.record_usage`` by name."""
    from celery import Celery

    app = Celery("llm_worker", broker=broker_url)

    def send(payload: dict[str, Any]) -> None:
        app.send_task(USAGE_TASK_NAME, args=[payload], queue=queue)

    return send


def main() -> int:
    logging.basicConfig(level=os.environ.get("LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    settings = WorkerSettings()
    # The fair policy is the platform's default (the engine's own default is FCFS).
    config = EngineConfig(**({} if os.environ.get("SCHEDULING_POLICY") else
                             {"scheduling_policy": "vtc"}))
    worker_id = settings.worker_id or f"{socket.gethostname()}-{os.getpid()}"

    stop = threading.Event()

    def request_stop(signum: int, _frame: Any) -> None:
        log.info("signal %s: stopping (no new work)", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)

    from inference.engine import LLMEngine

    log.info("loading backend %s (model %s)", config.backend, config.model_path or "default")
    engine = LLMEngine(config)
    client = redis.Redis.from_url(settings.redis_url)
    broker = settings.celery_broker_url or settings.redis_url
    usage_sink = None if broker == "none" else celery_usage_sink(
        broker, settings.celery_task_default_queue)
    bridge = WorkerBridge(engine, client, Keys(settings.redis_prefix), worker_id,
                          prefetch=settings.worker_prefetch or config.max_batch_size,
                          usage_sink=usage_sink)
    bridge.ensure_groups()
    pubsub = client.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(**{bridge.keys.control: bridge.on_control})
    # get_message() returns as soon as a control message arrives; the timeout only bounds how
    # often the thread wakes when none does (each wake-up competes with the model's threads).
    control_thread = pubsub.run_in_thread(sleep_time=0.5, daemon=True)

    engine.start()
    bridge.publish_stats(settings.worker_heartbeat_ttl_s)
    log.info("worker %s ready (max_model_len=%d)", worker_id, engine.max_model_len)
    next_beat = 0.0
    try:
        while not stop.is_set():
            bridge.poll(settings.poll_block_ms)
            bridge.reconcile_queue()
            bridge.flush_usage()
            now = time.monotonic()
            if now >= next_beat:
                bridge.publish_stats(settings.worker_heartbeat_ttl_s)
                next_beat = now + settings.heartbeat_interval_s
    finally:
        requeued = bridge.shutdown(settings.shutdown_timeout_s)
        control_thread.stop()
        log.info("worker %s stopped; %d request(s) handed back", worker_id, requeued)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
