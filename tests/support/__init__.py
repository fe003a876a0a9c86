"""What the tests share: fixtures (imported by each folder's ``conftest.py``) and builders.

- :mod:`~tests.support.platform`: a private Redis key prefix per test, tenants and keys, an
  in-process worker over real Redis;
- :mod:`~tests.support.web`: members, signed-in clients, the chat websocket;
- :mod:`~tests.support.e2e`: the whole platform as separate processes
  (:class:`benchmarks.harness.stack.Stack`), and the ``openai`` client on it;
- :mod:`~tests.support.engine`: engines on the reference backend and their event logs;
- :mod:`~tests.support.model`, :mod:`~tests.support.greedy`: the real default model and greedy
  comparisons on it.
"""
