"""Inference: the engine library, the worker process around it, and the wire contract between
the worker and the web tier.

- :mod:`inference.engine`: the library (scheduler, KV block pool, sampling, backends); imports
  neither Redis nor the worker, and of the protocol only its events;
- :mod:`inference.worker`: the process (``python -m inference.worker``): Redis in, events out;
- :mod:`inference.protocol`: keys, messages, settings and Lua scripts, which the web tier
  imports too;
- :mod:`inference.tokenization`: the torch-free tokenizer and chat template, shared by the
  engine and the web tier.
"""
