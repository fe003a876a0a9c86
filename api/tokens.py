"""Prompt token counts in the web tier, for rate limits and budgets (never torch).

The worker is the authority on token counts and context length: the numbers here only size the
reservation made at admission, which is settled to the worker's real usage afterwards. With the
model's ``tokenizer.json`` (``TOKENIZER_PATH``, ``MODEL_PATH`` or the prepared default model) the
count is the tokenizer's; without it, a conservative estimate from the text's length.
"""

from __future__ import annotations

import functools
import math
import os
from pathlib import Path

from api.conf import platform_settings

# A chat template adds role markers around each message and a generation prompt at the end.
CHAT_TOKENS_PER_MESSAGE = 5
CHAT_TOKENS_PER_PROMPT = 3
# Byte-level BPE tokenizers average about 4 bytes per token on English text; 3 over-counts.
ESTIMATE_BYTES_PER_TOKEN = 3


def _tokenizer_folder() -> Path | None:
    configured = platform_settings().get("TOKENIZER_PATH") or os.environ.get("MODEL_PATH", "")
    if configured:
        return Path(configured).expanduser()
    from inference.model_store import DEFAULT_MODEL_DIRNAME, cache_dir

    return cache_dir() / DEFAULT_MODEL_DIRNAME


@functools.cache
def _load_tokenizer(folder: str):  # -> tokenizers.Tokenizer | None
    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


def count_text_tokens(text: str) -> int:
    """Tokens of ``text`` (no special tokens)."""
    folder = _tokenizer_folder()
    tokenizer = _load_tokenizer(str(folder)) if folder else None
    if tokenizer is None:
        return math.ceil(len(text.encode()) / ESTIMATE_BYTES_PER_TOKEN)
    return len(tokenizer.encode(text, add_special_tokens=False).ids)


def count_chat_tokens(messages: list[dict[str, str]]) -> int:
    """Tokens of a chat prompt: the messages' contents plus the template's markers."""
    content = sum(count_text_tokens(m["content"]) for m in messages)
    return content + CHAT_TOKENS_PER_MESSAGE * len(messages) + CHAT_TOKENS_PER_PROMPT
