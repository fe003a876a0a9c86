"""The inference engine: continuous-batching scheduler, KV block pool and model backends.

Importable and testable without Django. The public entry points are
:class:`inference.config.EngineConfig` and :class:`inference.engine.LLMEngine`.
"""
