"""Trimming a conversation to the model's context: the oldest turns go first."""

from __future__ import annotations

import pytest

from chat.context import ContextOverflowError, fit_to_context, split_turns


def words(messages: list[dict[str, str]]) -> int:
    """A token counter: one per word, two per message, one per prompt."""
    return 1 + sum(2 + len(m["content"].split()) for m in messages)


def conversation(*contents: str) -> list[dict[str, str]]:
    roles = ["user", "assistant"]
    return [{"role": roles[i % 2], "content": c} for i, c in enumerate(contents)]


def test_a_conversation_that_fits_is_sent_whole():
    history = conversation("a b", "c d", "e f")
    assert fit_to_context(history, prompt_limit_tokens=100, count_tokens=words) == history


def test_the_oldest_turns_are_dropped_whole_until_it_fits():
    history = conversation("one two three", "four five six", "seven", "eight", "nine")
    # turns: (5 + 5) (3 + 3) (3) tokens; with the prompt's 1, 12 fits only the last two turns
    kept = fit_to_context(history, prompt_limit_tokens=10, count_tokens=words)
    assert kept == history[2:]
    assert words(kept) <= 10
    assert kept[0]["role"] == "user"


def test_the_system_message_is_always_kept_first():
    system = {"role": "system", "content": "be brief"}
    history = conversation("old question here", "old answer here", "new")
    kept = fit_to_context(history, prompt_limit_tokens=10, count_tokens=words, system=system)
    assert kept == [system, history[-1]]


def test_a_newest_message_too_long_for_the_context_is_an_error():
    history = conversation("a", "b", " ".join(["word"] * 50))
    with pytest.raises(ContextOverflowError) as info:
        fit_to_context(history, prompt_limit_tokens=20, count_tokens=words)
    assert info.value.prompt_tokens == 53 and info.value.limit_tokens == 20
    assert "too long" in str(info.value)


def test_turns_group_each_question_with_its_answers():
    history = conversation("q1", "a1", "q2")
    assert split_turns(history) == [history[:2], history[2:]]
