"""The inference worker process: one :class:`~inference.engine.llm_engine.LLMEngine` connected to
Redis (``python -m inference.worker``).

- :mod:`~inference.worker.main`: the process, its main loop and its settings
  (:mod:`~inference.worker.settings`);
- :mod:`~inference.worker.bridge`: the Redis side of one engine, which owns and calls its
  collaborators around one shared state (:mod:`~inference.worker.live`: the live-request table):
  :mod:`~inference.worker.intake` (what it takes from the shared queue, and preempted requests
  going back), :mod:`~inference.worker.publisher` (events out),
  :mod:`~inference.worker.recovery` (audits, reclaims, Redis data loss, drain) and
  :mod:`~inference.worker.origins` (whether a web process is alive);
- :mod:`~inference.worker.fair_queue`: the shared request queue's client (its Lua scripts are the
  protocol's); :mod:`~inference.worker.preparation`: a request message turned into a submission;
- :mod:`~inference.worker.prepare_model`: the set-up command that prepares the default model.
"""
