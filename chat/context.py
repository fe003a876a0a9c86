"""Fitting a conversation into the model's context: drop the oldest turns first."""

from __future__ import annotations

from collections.abc import Callable, Sequence

ChatMessage = dict[str, str]
# Tokens of a whole chat prompt (the chat template's additions included).
TokenCounter = Callable[[list[ChatMessage]], int]


class ContextOverflowError(ValueError):
    """The newest message alone does not fit in the context (with room for an answer)."""

    def __init__(self, prompt_tokens: int, limit_tokens: int):
        super().__init__(
            f"The message is too long: about {prompt_tokens} tokens, and at most {limit_tokens} "
            "fit in the model's context with room for an answer. Shorten it."
        )
        self.prompt_tokens = prompt_tokens
        self.limit_tokens = limit_tokens


def split_turns(messages: Sequence[ChatMessage]) -> list[list[ChatMessage]]:
    """Group messages into turns: each user message with the replies that follow it.

    Messages before the first user message (other than system ones, which callers keep apart)
    form a turn of their own.
    """
    turns: list[list[ChatMessage]] = []
    for message in messages:
        if message["role"] == "user" or not turns:
            turns.append([message])
        else:
            turns[-1].append(message)
    return turns


def fit_to_context(
    messages: Sequence[ChatMessage],
    *,
    prompt_limit_tokens: int,
    count_tokens: TokenCounter,
    system: ChatMessage | None = None,
) -> list[ChatMessage]:
    """The newest turns of ``messages`` whose prompt fits in ``prompt_limit_tokens``.

    Whole turns (a user message and its answer) are dropped from the oldest, so the model never
    sees an answer without its question. The system message, when given, is always kept, and so
    is the newest turn.

    Args:
        messages: the conversation in order, ending with the new user message; no system ones.
        prompt_limit_tokens: tokens the prompt may take (the context less the answer's room).
        count_tokens: tokens of a whole chat prompt, as the worker will count it (template
            included, as :func:`gateway.tokens.count_chat_tokens`); it must not shrink when a
            turn is added. A binary search over the number of turns kept calls it about
            ``log2(turns)`` times.

    Raises:
        ContextOverflowError: if the system message and the newest turn alone do not fit.
    """
    head = [system] if system else []
    turns = split_turns(messages)

    def prompt(kept: int) -> list[ChatMessage]:
        return head + [m for t in turns[len(turns) - kept:] for m in t]

    newest = count_tokens(prompt(1)) if turns else count_tokens(head)
    if not turns or newest > prompt_limit_tokens:
        raise ContextOverflowError(newest, prompt_limit_tokens)
    fits, too_many = 1, len(turns) + 1  # fits(n) holds for n <= fits and fails at too_many
    while too_many - fits > 1:
        middle = (fits + too_many) // 2
        if count_tokens(prompt(middle)) <= prompt_limit_tokens:
            fits = middle
        else:
            too_many = middle
    return prompt(fits)
