"""Fitting a conversation into the model's context: drop the oldest turns first."""

from __future__ import annotations

from collections.abc import Callable, Sequence

ChatMessage = dict[str, str]
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
        count_tokens: tokens of a chat prompt (template markers included); additive over
            messages plus a fixed overhead, as :func:`api.tokens.count_chat_tokens` is.
        system: a system message to put first.

    Raises:
        ContextOverflowError: if the system message and the newest turn alone do not fit.
    """
    head = [system] if system else []
    turns = split_turns(messages)
    # A chat prompt's count is its messages' counts plus a fixed overhead (the generation
    # prompt), so each message is counted once, not once per candidate prefix.
    overhead = count_tokens([])
    used = count_tokens(head)
    kept: list[list[ChatMessage]] = []
    for turn in reversed(turns):
        cost = sum(count_tokens([m]) - overhead for m in turn)
        if used + cost > prompt_limit_tokens:
            break
        used += cost
        kept.insert(0, turn)
    if not kept:
        newest = head + (turns[-1] if turns else [])
        raise ContextOverflowError(count_tokens(newest), prompt_limit_tokens)
    return head + [m for t in kept for m in t]
