"""The inference worker process: ``python -m inference.worker``.

Loads the model, runs the engine's scheduler loop on its own thread, takes requests from the
shared queue in the deployment's fair order (only what it can start soon; several workers share
the load), charges the shared fairness counters, writes each request's events, takes aborts from
the control channel, publishes its stats with a heartbeat, reclaims the requests of workers whose
heartbeat lapsed, ends requests past their admission deadline, and hands each finished request's
usage to Celery (by task name; the worker does not import Django).

SIGTERM or SIGINT stops it cleanly: it takes no new work, requests not yet admitted go back to
their place in the queue for another worker, requests in flight end with a ``worker_shutdown`` error
event.

Settings (environment): :class:`inference.settings.WorkerSettings` (the engine's settings, those
the web tier reads too, and the worker's own).
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

from inference.bridge import UsageSink, WorkerBridge
from inference.protocol import USAGE_TASK_NAME, UsageReport
from inference.settings import WorkerSettings

log = logging.getLogger("inference.worker")


def celery_usage_sink(broker_url: str, queue: str) -> UsageSink:
    """Send usage reports to the web tier's Celery task (by name: no Django here)."""
    from celery import Celery

    app = Celery("llm_worker", broker=broker_url)

    def send(report: UsageReport) -> None:
        app.send_task(USAGE_TASK_NAME, args=[report.model_dump(mode="json")], queue=queue)

    return send


def main() -> int:
    settings = WorkerSettings()
    logging.basicConfig(level=settings.log_level,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = settings.engine_config()
    worker_id = settings.worker_id or f"{socket.gethostname()}-{os.getpid()}"

    stop = threading.Event()

    def request_stop(signum: int, _frame: Any) -> None:
        log.info("signal %s: stopping (no new work)", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)

    from inference.engine import LLMEngine

    log.info("loading backend %s (model %s)", config.backend, config.model_path or "default")
    if config.backend == "transformers" and not config.model_path:
        from inference.model_store import prepare_default_model

        config = config.model_copy(update={
            "model_path": str(prepare_default_model(settings.model_cache_dir))})
    engine = LLMEngine(config)
    client = redis.Redis.from_url(settings.redis_url)
    usage_sink = None if settings.broker_url == "none" else celery_usage_sink(
        settings.broker_url, settings.celery_queue)
    bridge = WorkerBridge(engine, client, settings.keys, worker_id,
                          prefetch=settings.worker_prefetch, usage_sink=usage_sink)
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
            bridge.charge_service()
            bridge.flush_usage()
            now = time.monotonic()
            if now >= next_beat:
                bridge.publish_stats(settings.worker_heartbeat_ttl_s)
                bridge.housekeep(settings.worker_heartbeat_ttl_s)
                next_beat = now + settings.heartbeat_interval_s
    finally:
        requeued = bridge.shutdown(settings.shutdown_timeout_s)
        control_thread.stop()
        log.info("worker %s stopped; %d request(s) handed back", worker_id, requeued)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
