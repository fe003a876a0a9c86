"""Redis key names, the shared queue's Lua scripts, and how a client rides out an outage."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Events streams outlive their request briefly so a slow reader still gets the final event.
EVENTS_TTL_S = 600
ABORT_MARK_TTL_S = 600
# The Celery task (by name: the worker does not import Django) that records a UsageReport.
USAGE_TASK_NAME = "gateway.tasks.record_usage"

_LUA = Path(__file__).resolve().parent / "lua"
# The shared queue's state changes, written once (see queue_script).
FAIR_QUEUE_LUA = (_LUA / "fair_queue.lua").read_text()


@dataclass(frozen=True)
class Keys:
    """Redis key names under one prefix (the table in :mod:`inference.protocol`), with the
    shared request queue of one base model.

    ``model`` is empty for the deployment's default model (``SERVED_MODEL_NAME``), whose queue
    is ``{prefix}:fq:``; another base model's queue is ``{prefix}:fq@{model}:``. Everything but
    the queue (events, heartbeats, stats, aborts, the usage ledger) is the deployment's, the same
    whatever ``model``.
    """

    prefix: str = "llm"
    model: str = ""

    @property
    def queue(self) -> str:
        """The queue's name as the queue's Lua scripts take it (their first argument):
        ``prefix``, or ``{prefix}@{model}``."""
        return f"{self.prefix}@{self.model}" if self.model else self.prefix

    def fq(self, *parts: str | int) -> str:
        """A key of the model's shared request queue (``inference/protocol/lua/fair_queue.lua``).
        """
        head = f"{self.prefix}:fq@{self.model}" if self.model else f"{self.prefix}:fq"
        return ":".join([head, *map(str, parts)])

    def of_model(self, model: str, default_model: str) -> Keys:
        """The keys of ``model``'s queue in a deployment whose default model is
        ``default_model`` (its queue keeps the plain ``{prefix}:fq:`` names)."""
        return Keys(self.prefix, "" if model == default_model else model)

    @property
    def queues(self) -> str:
        """Set of the queue names (``{prefix}@{model}``) a request was ever queued in, besides
        the default model's."""
        return f"{self.prefix}:fq:queues"

    @property
    def worker_queue(self) -> str:
        """Hash worker id -> the queue name it serves (absent: the default model's)."""
        return f"{self.prefix}:worker_queue"

    @property
    def control(self) -> str:
        return f"{self.prefix}:control"

    @property
    def workers(self) -> str:
        return f"{self.prefix}:workers"

    def events(self, request_id: str) -> str:
        return f"{self.prefix}:events:{request_id}"

    def aborted(self, request_id: str) -> str:
        return f"{self.prefix}:aborted:{request_id}"

    def stats(self, worker_id: str) -> str:
        return f"{self.prefix}:stats:{worker_id}"

    @property
    def usage_pending(self) -> str:
        return f"{self.prefix}:usage:pending"

    @property
    def web(self) -> str:
        return f"{self.prefix}:web"

    @property
    def epoch(self) -> str:
        return f"{self.prefix}:epoch"


# A Redis call that fails on a lost connection is retried with backoff for about this long
# (seconds): a restart of Redis (or a failover) within it goes unnoticed by the callers.
REDIS_RETRY_WINDOW_S = 5.0


def redis_retry_options(asyncio: bool = False) -> dict[str, Any]:
    """Keyword arguments for a Redis client that rides out a short outage: its calls are retried
    on a lost or refused connection with exponential backoff (0.05 s doubling to 0.5 s) for about
    :data:`REDIS_RETRY_WINDOW_S` (not on a timeout). Every Redis call the platform repeats this
    way is idempotent (an admission or an event write repeated after a lost reply changes
    nothing; a worker's counter updates, gate 1's held count and the fairness counters, carry a
    token that Redis applies once: ``fq_once`` in ``inference/protocol/lua/fair_queue.lua``)."""
    from redis.backoff import ExponentialBackoff
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    if asyncio:
        from redis.asyncio.retry import Retry
    else:
        from redis.retry import Retry
    # A refused or reset connection is retried; a timeout is not: a Redis that hangs would make
    # each retry wait a whole socket timeout, and the callers bound an outage themselves.
    del RedisTimeoutError
    return {"retry": Retry(ExponentialBackoff(cap=0.5, base=0.05), 13, (RedisConnectionError,)),
            "retry_on_error": [RedisConnectionError], "retry_on_timeout": False}


def lua_script(name: str) -> str:
    """The Lua source of ``inference/protocol/lua/{name}.lua`` on its own (a script that does
    not change the queue)."""
    return (_LUA / f"{name}.lua").read_text()


def queue_script(name: str) -> str:
    """The Lua source of the queue script ``inference/protocol/lua/{name}.lua``, after the queue
    library. The worker's scripts and the web tier's admission (``admit``) are built this way.
    """
    return FAIR_QUEUE_LUA + "\n" + lua_script(name)


def queue_library_with(body: str) -> str:
    """The Lua source of a script that changes the queue: the library, then ``body``."""
    return FAIR_QUEUE_LUA + "\n" + body


