"""Fitting a conversation into the model's context: drop the oldest turns first.

:func:`fit_to_context` takes any token counter; :func:`fit_here` is the chat's, with the model's
tokenizer, meant to run in a token-counting process (:func:`gateway.tokens.run`), since
tokenizing a long conversation would hold the web process's event loop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from gateway import tokens

ChatMessage = dict[str, str]
# Tokens of a whole chat prompt (the chat template's additions included).
TokenCounter = Callable[[list[ChatMessage]], int]
# (fewest, most) tokens of a whole chat prompt, found without tokenizing it; None: unknown.
TokenBounds = Callable[[list[ChatMessage]], "tuple[int, int] | None"]


class ContextOverflowError(ValueError):
    """The newest message alone does not fit in the context (with room for an answer).

    ``prompt_tokens`` is the prompt's count, or with ``at_least`` the fewest tokens its size
    allows (it was not tokenized).
    """

    def __init__(self, prompt_tokens: int, limit_tokens: int, at_least: bool = False):
        about = "at least" if at_least else "about"
        super().__init__(
            f"The message is too long: {about} {prompt_tokens} tokens, and at most "
            f"{limit_tokens} fit in the model's context with room for an answer. Shorten it."
        )
        self.prompt_tokens = prompt_tokens
        self.limit_tokens = limit_tokens
        self.at_least = at_least

    def __reduce__(self) -> tuple:
        # Raised in a counting process and re-raised in the web process: pickled by its fields.
        return type(self), (self.prompt_tokens, self.limit_tokens, self.at_least)


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
    bounds: TokenBounds | None = None,
) -> list[ChatMessage]:
    """The newest turns of ``messages`` whose prompt fits in ``prompt_limit_tokens``.

    Whole turns (a user message and its answer) are dropped from the oldest, so the model never
    sees an answer without its question. The system message, when given, is always kept, and so
    is the newest turn.

    Args:
        messages: the conversation in order, ending with the new user message; no system ones.
        prompt_limit_tokens: tokens the prompt may take (the context less the answer's room).
        count_tokens: tokens of a whole chat prompt, as the worker will count it (template
            included, as :func:`gateway.tokens.measure_here`); it must not shrink when a
            turn is added. A binary search over the number of turns kept calls it about
            ``log2(turns)`` times.
        bounds: the fewest and most tokens of a prompt, found cheaply (from its bytes, as
            :func:`gateway.tokens.bounds_here`); a prompt they settle is not counted.

    Raises:
        ContextOverflowError: if the system message and the newest turn alone do not fit.
    """
    head = [system] if system else []
    turns = split_turns(messages)

    def prompt(kept: int) -> list[ChatMessage]:
        return head + [m for t in turns[len(turns) - kept:] for m in t]

    def settled(kept: int) -> tuple[bool | None, int | None]:
        """Whether ``kept`` turns fit by the bounds alone (None: unknown), and the fewest."""
        fewest, most = (bounds(prompt(kept)) if bounds else None) or (None, None)
        if most is not None and most <= prompt_limit_tokens:
            return True, fewest
        if fewest is not None and fewest > prompt_limit_tokens:
            return False, fewest
        return None, fewest

    def fits(kept: int) -> bool:
        verdict, _ = settled(kept)
        return verdict if verdict is not None else (
            count_tokens(prompt(kept)) <= prompt_limit_tokens)

    if not turns:
        raise ContextOverflowError(count_tokens(head), prompt_limit_tokens)
    verdict, fewest = settled(1)
    if verdict is False:
        raise ContextOverflowError(fewest, prompt_limit_tokens, at_least=True)
    if verdict is None and (newest := count_tokens(prompt(1))) > prompt_limit_tokens:
        raise ContextOverflowError(newest, prompt_limit_tokens)
    kept, too_many = 1, len(turns) + 1  # fits(n) holds for n <= kept and fails at too_many
    while too_many - kept > 1:
        middle = (kept + too_many) // 2
        if fits(middle):
            kept = middle
        else:
            too_many = middle
    return prompt(kept)


def fit_here(messages: Sequence[ChatMessage], prompt_limit_tokens: int,
             system: ChatMessage | None = None) -> tuple[list[ChatMessage], int]:
    """:func:`fit_to_context` with the model's tokenizer in this process, and the prompt's count.

    Blocking: run it in a token-counting process (:func:`gateway.tokens.run`, given the model's
    tokenizer folder). Byte bounds
    settle many candidates without tokenizing them; none is tokenized twice.

    Returns:
        The messages to send (system message first when given) and their tokens, as the worker
        counts them.

    Raises:
        ContextOverflowError: as :func:`fit_to_context`.
    """
    counted: dict[int, int] = {}  # messages in the prompt -> its tokens

    def count(prompt: list[ChatMessage]) -> int:
        if len(prompt) not in counted:
            counted[len(prompt)] = tokens.measure_here(prompt, None).tokens
        return counted[len(prompt)]

    kept = fit_to_context(messages, prompt_limit_tokens=prompt_limit_tokens, count_tokens=count,
                          system=system, bounds=tokens.bounds_here)
    return kept, count(kept)
