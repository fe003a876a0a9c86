"""The web tier's side of the worker protocol: the code the Django apps share that is not a view.

The web tier and the inference workers speak only through Redis, in the terms of
:mod:`inference.protocol`. This package is everything the web tier does in those terms, written
once for the REST API (``api``), the web chat (``chat``) and the dashboard (``dashboard``), which
never import each other:

- :mod:`gateway.lifecycle`: one request's life, start to end (the apps call only this to
  generate): build the message, admit it, read its events, abort it if unfinished, release its
  leases; the worker reports its usage, recorded by :mod:`gateway.tasks`.
- :mod:`gateway.admission`: rate limits, concurrency, token budgets and gate 1, checked and
  recorded all-or-nothing by one Lua script (``inference/protocol/lua/``) that also dispatches the
  request to the workers; the settlement of token reservations and the release of leases.
- :mod:`gateway.pricing`: what a token costs a tenant (batch work ``BATCH_TOKEN_PRICE`` of one).
- :mod:`gateway.events`: a request's event stream.
- :mod:`gateway.aborts`: aborts (a request withdrawn from the queue, or stopped in its
  worker); one that fails while Redis is unreachable is retried by the web process's monitor
  (:mod:`gateway.monitor`).
- :mod:`gateway.workers`: worker liveness, their stats snapshots and the one aggregation of them.
- :mod:`gateway.tokens`: prompt token counts, with the worker's own tokenizer and chat template
  (each model's: :mod:`gateway.tokenizer_folders`).
- :mod:`gateway.model_registry`: the base models served, and which of them a sender may call.
- :mod:`gateway.adapters`: the LoRA adapters served, and a request's ``base:adapter`` resolved
  to its base model and adapter (or the 404 of an unknown model); :mod:`gateway.adapter_validation`
  checks an adapter (its Celery task in :mod:`gateway.tasks`).
- :mod:`gateway.errors`: the client-facing error and the mapping of error codes to HTTP statuses.
- :mod:`gateway.clients` and :mod:`gateway.conf`: the Redis clients and the platform settings.

Layers (checked by import-linter): ``tenants`` < ``gateway`` < {``api``, ``chat``,
``dashboard``}. Of the engine, only :mod:`inference.protocol` and :mod:`inference.tokenization`
are imported here.
"""
