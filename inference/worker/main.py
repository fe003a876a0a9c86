"""The inference worker process: ``python -m inference.worker``.

Loads the model, runs the engine's scheduler loop on its own thread, takes requests from the
shared queue in the deployment's fair order (only what it can start soon; several workers share
the load), charges the shared fairness counters, writes each request's events, takes aborts from
the control channel, publishes its stats with a heartbeat, reclaims the requests of workers whose
heartbeat lapsed, ends requests past their admission deadline, and hands each finished request's
usage to Celery (by task name; the worker does not import Django).

SIGTERM or SIGINT drains it: it takes no new work, requests not yet admitted go back to their place
in the queue for another worker, requests in flight may finish within ``SHUTDOWN_TIMEOUT_S``; what
is still running then ends with a retryable ``worker_shutdown`` error event. A Redis outage is
ridden out: every loop retries with backoff, and the events generated meanwhile are written, in
order and once each, when Redis is back.

Settings (environment): :class:`inference.worker.settings.WorkerSettings` (the engine's settings,
those the web tier reads too, and the worker's own).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import redis
from pydantic import ValidationError

from inference.protocol.keys import USAGE_TASK_NAME, Keys, redis_retry_options
from inference.worker.bridge import UsageSink, WorkerBridge
from inference.worker.settings import WorkerSettings

log = logging.getLogger("inference.worker")


def celery_usage_sink(broker_url: str, queue: str) -> UsageSink:
    """Ask the web tier's Celery task to record a request's usage (by name: no Django here)."""
    from celery import Celery

    app = Celery("llm_worker", broker=broker_url)

    def send(request_id: str) -> None:
        app.send_task(USAGE_TASK_NAME, args=[request_id], queue=queue)

    return send


class Backoff:
    """Sleeps between retries of a failing loop: 0.1 s doubling to 2 s, reset on success."""

    def __init__(self, first_s: float = 0.1, most_s: float = 2.0):
        self.first_s, self.most_s = first_s, most_s
        self.delay_s = 0.0
        self.failing_since: float | None = None

    def failed(self, exc: Exception, stop: threading.Event) -> None:
        if self.failing_since is None:
            self.failing_since = time.monotonic()
            log.warning("Redis unreachable (%s): retrying until it is back", exc)
        self.delay_s = min(self.most_s, max(self.first_s, self.delay_s * 2))
        stop.wait(self.delay_s)

    def succeeded(self) -> bool:
        """Note a success; return whether it ends an outage."""
        ended = self.failing_since is not None
        if ended:
            log.warning("Redis reachable again after %.1f s",
                        time.monotonic() - self.failing_since)
        self.failing_since, self.delay_s = None, 0.0
        return ended


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line: no options but ``--help``; the settings are environment variables.

    Raises:
        SystemExit: after printing the help (status 0), or for any argument (status 2).
    """
    parser = argparse.ArgumentParser(
        prog="python -m inference.worker",
        description="The inference worker: loads the model, takes requests from the shared queue "
                    "in Redis and writes their events back, until SIGTERM or SIGINT drains it.",
        epilog="Its settings are environment variables (or a .env file): REDIS_URL, "
               "REDIS_PREFIX, MODEL_PATH, MAX_BATCH_SIZE, WORKER_ID, ... (docs/engine.md and "
               "docs/platform.md list them all).")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the worker process until it is told to stop; returns its exit status."""
    parse_args(argv)
    try:
        settings = WorkerSettings()
    except ValidationError as exc:  # a setting out of range: one line each, no traceback
        for error in exc.errors():
            name = "_".join(str(part) for part in error["loc"]).upper() or "settings"
            print(f"inference.worker: {name}: {error['msg']}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = settings.engine_config()
    worker_id = settings.worker_id or f"{socket.gethostname()}-{os.getpid()}"
    if (config.backend == "transformers" and not config.model_path
            and settings.served_model != settings.served_model_name):
        log.error("MODEL_NAME=%s is not the default model (SERVED_MODEL_NAME=%s): set MODEL_PATH "
                  "to its folder", settings.served_model, settings.served_model_name)
        return 2

    stop = threading.Event()

    def request_stop(signum: int, _frame: Any) -> None:
        log.info("signal %s: draining (no new work)", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)

    from inference.engine.llm_engine import LLMEngine
    from inference.engine.model_store import ModelLoadError

    client = redis.Redis.from_url(settings.redis_url, **redis_retry_options())
    loaded = threading.Event()
    threading.Thread(target=beat_while_loading, name="startup-heartbeat", daemon=True,
                     args=(client, settings.keys, worker_id,
                           settings.heartbeat_interval_s, loaded)).start()
    log.info("loading backend %s (model %s from %s)", config.backend, settings.served_model,
             config.model_path or "the default folder")
    if config.backend == "transformers" and not config.model_path:
        from inference.engine.model_store import prepare_default_model

        # On a thread that ends with it: a first run converts the model with torch, and the
        # OpenMP pool that leaves behind would slow the engine's own
        # (inference.engine.compute_thread).
        with ThreadPoolExecutor(1) as once:
            path = once.submit(prepare_default_model, settings.model_cache_dir).result()
        config = config.model_copy(update={"model_path": str(path)})
    try:
        engine = LLMEngine(config)
    except ModelLoadError as exc:  # a folder that is not a model: one line, no traceback
        log.error("cannot load the model: %s", exc)
        return 2
    finally:
        loaded.set()
    if (pool := engine.scheduler.state.adapters) is not None:  # LoRA adapters: ADAPTER_ROOT only
        pool.root, pool.max_rank = settings.adapter_folder, settings.max_lora_rank
    usage_sink = None if settings.broker_url == "none" else celery_usage_sink(
        settings.broker_url, settings.celery_queue)
    bridge = WorkerBridge(engine, client, settings.keys, worker_id,
                          prefetch=settings.worker_prefetch,
                          batch_prefetch=settings.batch_prefetch(), usage_sink=usage_sink,
                          web_ttl_s=settings.web_heartbeat_ttl_s,
                          heartbeat_ttl_s=settings.worker_heartbeat_ttl_s,
                          event_hold_s=settings.event_hold_ms / 1000,
                          event_hold_min_streams=settings.event_hold_min_streams,
                          model=settings.served_model)
    bridge.queue.affinity_s = settings.adapter_affinity_ms / 1000
    pubsub = client.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(**{bridge.keys.control: bridge.on_control})

    def control_failed(exc: BaseException, _pubsub: Any, _thread: Any) -> None:
        # The thread goes on: the next read reconnects and subscribes again. Aborts published
        # meanwhile are found by the abort marks (WorkerBridge.audit).
        log.warning("control channel: %s; reconnecting", exc)
        time.sleep(0.5)

    # get_message() returns as soon as a control message arrives; the timeout only bounds how
    # often the thread wakes when none does (each wake-up competes with the model's threads).
    control_thread = pubsub.run_in_thread(sleep_time=0.5, daemon=True,
                                          exception_handler=control_failed)

    bridge.start_publisher()
    engine.start()
    try:
        serve(bridge, stop, heartbeat_ttl_s=settings.worker_heartbeat_ttl_s,
              heartbeat_interval_s=settings.heartbeat_interval_s,
              poll_block_ms=settings.poll_block_ms, drain_s=settings.shutdown_timeout_s)
    finally:
        control_thread.stop()
    return 0


def beat_while_loading(client: redis.Redis, keys: Keys, worker_id: str,
                       interval_s: float, loaded: threading.Event) -> None:
    """Keep this worker's heartbeat fresh while it loads the model and calibrates, until
    ``loaded`` is set (then :func:`serve` beats with its stats).

    A restart of the only worker can take longer than ``WORKER_HEARTBEAT_TTL_S`` on a loaded
    machine; meanwhile the web tier would find no worker alive and refuse requests with 503
    ``no_worker_available``. Beating from the start, the new process lets them wait in the
    shared queue instead, for it to take once it is ready. The queue it will serve is named
    (``keys.worker_queue``) unless an earlier process under its id named one: what that one
    left is reclaimed from its own queue first (:meth:`WorkerBridge.publish_stats`).
    """
    while not loaded.is_set():
        try:
            pipe = client.pipeline(transaction=False)
            pipe.hsetnx(keys.worker_queue, worker_id, keys.queue)
            pipe.zadd(keys.workers, {worker_id: time.time()})
            pipe.execute()
        except redis.RedisError as exc:  # serve() rides out the outage once loaded
            log.debug("startup heartbeat not written: %s", exc)
        loaded.wait(interval_s)


def serve(bridge: WorkerBridge, stop: threading.Event, *, heartbeat_ttl_s: float,
          heartbeat_interval_s: float, poll_block_ms: int, drain_s: float) -> int:
    """The worker's main loop, until ``stop`` is set and the drain ends; then shut down.

    Each round takes work, writes waiting events, releases gate 1, charges the fairness
    counters and hands usage on; each heartbeat it publishes stats, sweeps the queue and audits
    what it holds. Each round that succeeds feeds the worker's sight of Redis (a round that
    hung, or a pause of the process, breaks it: :mod:`inference.protocol.liveness`), against
    which it judges heartbeats. A Redis error ends the round, not the loop (backoff, then the
    next round).
    Once ``stop`` is set it drains: no new work, unadmitted requests go back to the queue, the
    running ones have ``drain_s`` seconds to finish, then what is left ends with
    ``worker_shutdown``.

    Returns:
        How many requests went back to the shared queue at the end.
    """
    backoff = Backoff()
    sight = bridge.state.sight
    while True:  # Redis may be down at start too
        try:
            bridge.publish_stats(heartbeat_ttl_s)
            sight.answered()
            break
        except redis.RedisError as exc:
            backoff.failed(exc, stop)
            if stop.is_set():
                return 0
    backoff.succeeded()
    log.info("worker %s ready (max_model_len=%d)", bridge.worker_id, bridge.engine.max_model_len)
    drain_until: float | None = None
    next_beat = 0.0
    handed_back = 0
    try:
        while True:
            if stop.is_set() and drain_until is None:
                drain_until = time.monotonic() + drain_s
                try:
                    handed_back = bridge.begin_drain()
                    log.info("draining: %d request(s) handed back; up to %g s for the rest",
                             handed_back, drain_s)
                except redis.RedisError as exc:
                    log.warning("could not hand requests back now: %s", exc)
            if drain_until is not None and (
                    not bridge.busy() or time.monotonic() >= drain_until):
                break
            try:
                bridge.flush_events(held=False)
                bridge.poll(poll_block_ms)
                bridge.reconcile_queue()
                bridge.charge_service()
                bridge.flush_usage()
                now = time.monotonic()
                if now >= next_beat:
                    bridge.publish_stats(heartbeat_ttl_s)
                    bridge.housekeep(heartbeat_ttl_s)
                    bridge.audit()
                    next_beat = now + heartbeat_interval_s
                sight.answered()
                backoff.succeeded()
            except redis.RedisError as exc:
                sight.lost()  # until it is back, and for a heartbeat TTL after
                backoff.failed(exc, stop if drain_until is None else threading.Event())
    finally:
        try:
            handed_back += bridge.shutdown(drain_s if drain_until is None else 1.0)
        except redis.RedisError as exc:
            log.error("Redis unreachable at shutdown (%s): the live workers reclaim what "
                      "this worker held", exc)
        log.info("worker %s stopped; %d request(s) handed back", bridge.worker_id, handed_back)
    return handed_back


if __name__ == "__main__":
    raise SystemExit(main())
