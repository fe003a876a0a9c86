"""The contract between the web tier and the inference workers: keys, messages and settings.

The two processes speak only through Redis, in the terms of this package's modules:

- :mod:`~inference.protocol.events`: what an engine emits (token and final events, errors as an
  :class:`~inference.protocol.events.ErrorCode`, usage, log-probabilities). The only part the
  engine itself imports: pydantic only, no Redis, no environment;
- :mod:`~inference.protocol.messages`: the other messages both sides build and validate (a
  request, an abort, a usage report);
- :mod:`~inference.protocol.keys`: the Redis key names (:class:`~inference.protocol.keys.Keys`),
  the Lua scripts of ``lua/`` (every atomic change of shared state, the web tier's admission
  included) and how a client rides out an outage;
- :mod:`~inference.protocol.settings`: the settings both processes read from the environment
  (:class:`~inference.protocol.settings.PlatformSettings`), and
  :mod:`~inference.protocol.models`: where a model's folder is.

It imports neither torch nor Django; the web tier imports it, and so do the engine (its events
only) and the worker. This file imports nothing, so that importing the events loads neither Redis
nor the settings. ``docs/design.md`` describes the processes around it.

Keys, under a configurable prefix (``REDIS_PREFIX``, default ``llm``):

================================  ===========================================================
``{p}:fq:*``                      the shared request queue: requests waiting, in the
                                  deployment's fair order, and those each worker took or runs
                                  (``inference/protocol/lua/fair_queue.lua`` lists its keys)
``{p}:events:{request_id}``       stream of one request's events, in order:
:class:`~inference.protocol.events.TokenEvent`
                                  ... then exactly one
                                  :class:`~inference.protocol.events.FinalEvent`
``{p}:control``                   pub/sub channel of
:class:`~inference.protocol.messages.ControlMessage` (aborts)
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
the queue is a Lua script made of one library (``inference/protocol/lua/fair_queue.lua``) and the
script's own body (:func:`~inference.protocol.keys.queue_script`), the web tier's admission script
included: each state change is written once. A request a worker took stays its own until the worker
writes the request's first event; if the worker's heartbeat lapses first, the request goes back to
its place, once.

Gate 1 (requests accepted and not yet admitted by any worker) is the number of requests waiting
plus those each worker holds taken and not yet admitted by its engine: the web tier refuses when
it would pass ``MAX_QUEUE_SIZE``.

Errors carry an :class:`~inference.protocol.events.ErrorCode`, never an HTTP status: the web tier
maps codes to statuses.
"""
