"""Fixtures of the engine tests: the real default model, loaded once per session (its tests are
marked ``model``), and real-text prompts."""

from tests.support.model import backend, chat_prompt, corpus_ids  # noqa: F401 - fixtures
