"""The Batch API's figures in Redis, for ``/metrics`` and the dashboard (which read Redis only).

- ``{prefix}:batch:lines`` (hash): outcome -> lines that ended so, over every batch
  (``completed``: an output line; ``failed``: an error line, whatever the reason).
- ``{prefix}:batch:active`` (hash): batch id -> JSON ``{"tenant", "status", "total",
  "completed", "failed"}`` of each batch not yet ended; a batch's entry goes when it ends.

Each step (:mod:`api.batch_runner`) writes them once its transaction is committed, so a step
rolled back counts nothing.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import redis
from django.db import transaction

from gateway.clients import sync_redis
from gateway.conf import redis_keys

log = logging.getLogger(__name__)

OUTCOMES = ("completed", "failed")
# The statuses of a batch not yet ended (api.batch_store.ACTIVE).
ACTIVE_STATUSES = ("validating", "in_progress", "finalizing", "cancelling")


def lines_key() -> str:
    return f"{redis_keys().prefix}:batch:lines"


def active_key() -> str:
    return f"{redis_keys().prefix}:batch:active"


def publish_on_commit(batch_id: str, figures: dict[str, Any] | None,
                      ended: dict[str, int]) -> None:
    """Once the running transaction commits: add ``ended`` (outcome -> lines) to the line
    counters, and set the batch's entry to ``figures`` (None: it has ended, drop it)."""
    def send() -> None:
        try:
            pipe = sync_redis().pipeline(transaction=False)
            for outcome, n in ended.items():
                if n:
                    pipe.hincrby(lines_key(), outcome, n)
            if figures is None:
                pipe.hdel(active_key(), batch_id)
            else:
                pipe.hset(active_key(), batch_id, json.dumps(figures))
            pipe.execute()
        except redis.RedisError as exc:  # figures only: the next step writes them again
            log.warning("could not publish the figures of batch %s: %s", batch_id, exc)

    transaction.on_commit(send)


def read(client: redis.Redis | None = None) -> dict[str, Any]:
    """``{"lines": {outcome: n}, "active": [{"id", "tenant", "status", "total", "completed",
    "failed"}, ...]}`` (the active batches by id)."""
    client = client or sync_redis()
    lines = {k.decode() if isinstance(k, bytes) else k: int(v)
             for k, v in client.hgetall(lines_key()).items()}
    active = []
    for batch_id, raw in sorted(client.hgetall(active_key()).items()):
        try:
            entry = json.loads(raw)
        except ValueError:
            continue
        active.append({"id": batch_id.decode() if isinstance(batch_id, bytes) else batch_id,
                       **entry})
    return {"lines": {o: lines.get(o, 0) for o in OUTCOMES}, "active": active}
