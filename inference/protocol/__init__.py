"""The contract between the web tier and the inference workers: keys, messages and settings.

The two processes speak only through Redis, in the terms of this module: the key names
(:class:`Keys`), the messages both sides build and validate (pydantic models: a request, the
events of its answer, an abort, a usage report), and the settings both read
(:class:`PlatformSettings`). It imports neither torch nor Django; the web tier imports it, and so
do the engine and the worker. ``docs/design.md`` describes the processes around it.

Keys, under a configurable prefix (``REDIS_PREFIX``, default ``llm``):

================================  ===========================================================
``{p}:fq:*``                      the shared request queue: requests waiting, in the
                                  deployment's fair order, and those each worker took or runs
                                  (``inference/lua/fair_queue.lua`` lists its keys)
``{p}:events:{request_id}``       stream of one request's events, in order: :class:`TokenEvent`
                                  ... then exactly one :class:`FinalEvent`
``{p}:control``                   pub/sub channel of :class:`ControlMessage` (aborts)
``{p}:aborted:{request_id}``      set when a request is aborted, so a worker that reads it later
                                  drops it
``{p}:workers``                   sorted set: worker id -> time of its last heartbeat (unix s)
``{p}:stats:{worker_id}``         the worker's latest stats snapshot (JSON, expires)
``{p}:usage:pending``             hash request id -> usage entry of an ended request, until its
                                  usage record is written (``gateway.usage``)
``{p}:web``                       sorted set: web process id -> time of its last heartbeat
``{p}:epoch``                     a random id set by the first process to find none: when Redis
                                  loses its data, every process sees the epoch change
``{p}:admitted:{request_id}``     an admission's verdict, so a retried admission is not queued
                                  twice
================================  ===========================================================

The queue hands requests out in one order for the whole deployment: priority tier first, then
(with VTC) the fairness key with the least weighted service, counters shared by every worker, then
arrival. A worker takes only what it can start soon (its free rows and ``WORKER_PREFETCH``
more), so a request's place is decided by the queue, not by which worker read it. Every change of
the queue is a Lua script made of one library (``inference/lua/fair_queue.lua``) and the script's
own body (:func:`queue_script`), the web tier's admission script included: each state change is
written once. A request a worker took stays its own until the worker writes the request's first
event; if the worker's heartbeat lapses first, the request goes back to its place, once.

Gate 1 (requests accepted and not yet admitted by any worker) is the number of requests waiting
plus those each worker holds taken and not yet admitted by its engine: the web tier refuses when
it would pass ``MAX_QUEUE_SIZE``.

Errors carry a :class:`ErrorCode`, never an HTTP status: the web tier maps codes to statuses.
"""

from inference.protocol.keys import (
    ABORT_MARK_TTL_S,
    EVENTS_TTL_S,
    FAIR_QUEUE_LUA,
    REDIS_RETRY_WINDOW_S,
    USAGE_TASK_NAME,
    Keys,
    queue_library_with,
    queue_script,
    redis_retry_options,
)
from inference.protocol.messages import (
    LOGPROB_FLOOR,
    MAX_LOGPROBS,
    ChatTurn,
    ControlMessage,
    ErrorCode,
    ErrorInfo,
    Event,
    FinalEvent,
    FinishReason,
    Message,
    PositionLogprobs,
    RequestMessage,
    Sampling,
    TokenEvent,
    TokenLogprob,
    Usage,
    UsageReport,
    decode_event,
    encode_event,
)
from inference.protocol.settings import (
    DEFAULT_MODEL_DIRNAME,
    REPO_ROOT,
    PlatformSettings,
    model_cache_dir,
    model_folder,
)

__all__ = [
    "ABORT_MARK_TTL_S", "DEFAULT_MODEL_DIRNAME", "EVENTS_TTL_S", "FAIR_QUEUE_LUA",
    "LOGPROB_FLOOR", "MAX_LOGPROBS", "PositionLogprobs", "TokenLogprob",
    "REDIS_RETRY_WINDOW_S", "REPO_ROOT", "USAGE_TASK_NAME", "ChatTurn", "ControlMessage",
    "ErrorCode", "ErrorInfo", "Event", "FinalEvent", "FinishReason", "Keys", "Message",
    "PlatformSettings", "RequestMessage", "Sampling", "TokenEvent", "Usage", "UsageReport",
    "decode_event", "encode_event", "model_cache_dir", "model_folder", "queue_library_with",
    "queue_script", "redis_retry_options",
]
