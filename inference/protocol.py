"""The Redis message schema shared by the web tier and the inference workers.

Plain Python (standard library only): the web tier imports this module and never torch.

Keys, under a configurable prefix (``REDIS_PREFIX``, default ``llm``):

================================  ===========================================================
``{p}:requests:{priority}``       stream of the :class:`RequestMessage` of one priority value
                                  (``RequestMessage.priority``, any integer); consumer group
                                  ``workers`` on each
``{p}:request_tiers``             sorted set of the priorities that have a requests stream,
                                  member ``str(priority)`` scored by ``priority``; a tier is
                                  registered, and its stream and group created, atomically with
                                  its first request, so workers find new tiers without a restart
``{p}:events:{request_id}``       stream of one request's events, in order: ``token`` ... then
                                  exactly one ``final`` (the shapes of ``TokenEvent.to_dict()``
                                  and ``FinalEvent.to_dict()``; see :func:`final_event`)
``{p}:control``                   pub/sub channel of :class:`ControlMessage` (aborts)
``{p}:aborted:{request_id}``      set when a request is aborted, so a worker that reads it later
                                  drops it
``{p}:queue``                     gate 1: requests accepted and not yet admitted by any worker
``{p}:workers``                   sorted set: worker id -> time of its last heartbeat (unix s)
``{p}:stats:{worker_id}``         the worker's latest stats snapshot (JSON, expires)
================================  ===========================================================

Gate 1 (``shared/design/scheduler.md`` section 4) is global: the web tier increments
``{p}:queue`` atomically with the enqueue and refuses when it would pass ``MAX_QUEUE_SIZE``; each
worker keeps its share of the counter equal to the requests it has taken and not yet admitted
(those waiting in its engine's pending queue) and decrements it as they leave that queue.

Requests wait in Redis on one stream per priority so that a worker, which takes only a few ahead of
admission (its prefetch), takes the highest tier's first: a backlog of a low tier never stands in
front of a later request of a higher one. Within a tier they are taken in arrival order.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

CONSUMER_GROUP = "workers"
# Events streams outlive their request briefly so a slow reader still gets the final event.
EVENTS_TTL_S = 600
ABORT_MARK_TTL_S = 600
# The Celery task (by name: the worker does not import Django) that writes a usage record.
USAGE_TASK_NAME = "api.tasks.record_usage"

# Puts a request message on its tier's stream, atomically registering the tier and, for a new
# stream, creating the consumer group (from id 0, so the entry added here is delivered).
# KEYS[1] the tier's stream (Keys.requests(priority)), KEYS[2] Keys.request_tiers; ARGV[1]
# str(priority), ARGV[2] the group, ARGV[3] the message JSON. Returns the new entry's id.
# The web tier's admission script does the same after its checks.
ENQUEUE_LUA = """
redis.call('ZADD', KEYS[2], ARGV[1], ARGV[1])
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.pcall('XGROUP', 'CREATE', KEYS[1], ARGV[2], '0', 'MKSTREAM')
end
return redis.call('XADD', KEYS[1], '*', 'data', ARGV[3])
"""


@dataclass(frozen=True)
class Keys:
    """Redis key names under one prefix."""

    prefix: str = "llm"

    def requests(self, priority: int) -> str:
        """The requests stream of one priority value."""
        return f"{self.prefix}:requests:{int(priority)}"

    @property
    def request_tiers(self) -> str:
        """Sorted set of the priorities that have a requests stream (scored by priority)."""
        return f"{self.prefix}:request_tiers"

    @property
    def control(self) -> str:
        return f"{self.prefix}:control"

    @property
    def queue(self) -> str:
        return f"{self.prefix}:queue"

    @property
    def workers(self) -> str:
        return f"{self.prefix}:workers"

    def events(self, request_id: str) -> str:
        return f"{self.prefix}:events:{request_id}"

    def aborted(self, request_id: str) -> str:
        return f"{self.prefix}:aborted:{request_id}"

    def stats(self, worker_id: str) -> str:
        return f"{self.prefix}:stats:{worker_id}"


@dataclass
class RequestMessage:
    """One generation request, from the web tier to a worker.

    Exactly one of ``messages`` (chat) and ``prompt`` (completion) is set. ``sampling`` holds
    :class:`inference.request.SamplingParams` fields; a ``max_tokens`` of None means what is left
    of the context, capped by ``default_max_tokens``. ``enqueued_at`` is unix time (seconds);
    ``queue_deadline_s`` bounds the wait for admission. ``meta`` is opaque to the worker and
    handed back with the usage (tenant and key ids, the reservations to settle).
    """

    request_id: str
    tenant: str
    fairness_key: str
    priority: int = 0
    fairness_weight: float = 1.0
    messages: list[dict[str, str]] | None = None
    prompt: str | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    default_max_tokens: int = 512
    enqueued_at: float = field(default_factory=time.time)
    queue_deadline_s: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, data: str | bytes) -> RequestMessage:
        return cls(**json.loads(data))


@dataclass(frozen=True)
class ControlMessage:
    """A command to every worker; ``type`` is ``abort``."""

    type: str
    request_id: str

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, data: str | bytes) -> ControlMessage:
        return cls(**json.loads(data))


def error_dict(
    code: str,
    message: str,
    status: int,
    *,
    retryable: bool = False,
    gate: int | None = None,
    details: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """An error in the shape of ``inference.request.ErrorInfo.to_dict()``."""
    return {"code": code, "message": message, "status": status, "gate": gate,
            "retryable": retryable, "details": details or {}}


def final_event(
    request_id: str,
    finish_reason: str,
    *,
    seq: int = 0,
    usage: dict[str, int] | None = None,
    text: str = "",
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A final event in the shape of ``inference.request.FinalEvent.to_dict()``.

    For events a worker makes itself (a refusal before the engine saw the request).
    """
    return {
        "type": "final",
        "request_id": request_id,
        "seq": seq,
        "finish_reason": finish_reason,
        "usage": usage or {"prompt_tokens": 0, "cached_prompt_tokens": 0,
                           "completion_tokens": 0},
        "text": text,
        "error": error,
        "timings": {},
    }


def encode_event(event: dict[str, Any]) -> dict[str, str]:
    """Stream fields of one event (``{"data": json}``)."""
    return {"data": json.dumps(event, separators=(",", ":"))}


def decode_event(fields: dict[bytes | str, bytes | str]) -> dict[str, Any]:
    """The event dict from a stream entry's fields."""
    raw = fields.get(b"data", fields.get("data"))
    return json.loads(raw)
