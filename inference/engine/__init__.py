"""The inference engine, a library: importable and testable without Redis, Django or the
environment (a process reads its settings and hands them in as an
:class:`~inference.engine.config.EngineConfig`).

- :mod:`~inference.engine.llm_engine`: :class:`~inference.engine.llm_engine.LLMEngine`, the
  thread-safe API (submit, abort, stats) over one scheduler on its own compute thread
  (:mod:`~inference.engine.compute_thread`), with :mod:`~inference.engine.submission`;
- :mod:`~inference.engine.sched`: the continuous-batching scheduler and its phases;
- :mod:`~inference.engine.request`, :mod:`~inference.engine.config`: a request and its sampling
  parameters, the engine's settings;
- :mod:`~inference.engine.kv_cache`: the KV block pool with prefix caching;
- :mod:`~inference.engine.sampling`, :mod:`~inference.engine.logprobs`,
  :mod:`~inference.engine.detokenizer`: from logits to tokens, their log-probabilities and text;
- :mod:`~inference.engine.backends`: the model (transformers, with native kernels; a reference
  backend for tests); :mod:`~inference.engine.model_store`: where its weights come from.

Its events and errors are the protocol's (:mod:`inference.protocol.events`).
"""
