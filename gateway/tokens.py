"""Prompt token counts in the web tier, for rate limits and budgets (never torch).

The count is the worker's own: the same tokenizer and chat template (:mod:`inference.tokenization`,
which the worker builds its prompts with), read from ``TOKENIZER_PATH``, else ``MODEL_PATH``,
else the prepared default model's folder. Without a ``tokenizer.json`` there (a web-only install
given no tokenizer), counts are a conservative estimate from the text's length. The worker stays
the authority on context length: a reservation made from these counts is settled to the worker's
real usage afterwards.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Sequence
from pathlib import Path

from gateway.conf import platform_settings
from inference.protocol import model_folder
from inference.tokenization import Tokenizer, TokenizerLoadError

log = logging.getLogger(__name__)

# Byte-level BPE tokenizers average about 4 bytes per token on English text; 3 over-counts.
ESTIMATE_BYTES_PER_TOKEN = 3
# Without the chat template: role markers around each message, a generation prompt at the end.
ESTIMATE_TOKENS_PER_MESSAGE = 5
ESTIMATE_TOKENS_PER_PROMPT = 3


def tokenizer_folder() -> Path:
    """The folder whose tokenizer counts prompt tokens (see the module docstring)."""
    configured = platform_settings().get("TOKENIZER_PATH") or ""
    if configured.strip():
        return Path(configured.strip()).expanduser()
    conf = platform_settings()
    return model_folder(conf["MODEL_PATH"], conf["LLM_CACHE_DIR"])


@functools.cache
def _load(folder: str) -> Tokenizer | None:
    try:
        return Tokenizer.from_folder(folder)
    except TokenizerLoadError as exc:
        log.warning("counting tokens by estimate: %s", exc)
        return None


def tokenizer() -> Tokenizer | None:
    """The model's tokenizer, or None when its folder has none."""
    return _load(str(tokenizer_folder()))


def count_text_tokens(text: str) -> int:
    """Tokens of a completion prompt ``text`` (no special tokens), as the worker counts them."""
    tok = tokenizer()
    if tok is None:
        return math.ceil(len(text.encode()) / ESTIMATE_BYTES_PER_TOKEN)
    return len(tok.encode(text))


def count_chat_tokens(messages: Sequence[dict[str, str]]) -> int:
    """Tokens of a chat prompt, rendered with the model's chat template as the worker does.

    The template's own additions count too (a default system prompt when the messages have
    none, role markers, the generation prompt).
    """
    tok = tokenizer()
    if tok is None or not tok.chat_template:
        content = sum(math.ceil(len(m["content"].encode()) / ESTIMATE_BYTES_PER_TOKEN)
                      for m in messages)
        return content + ESTIMATE_TOKENS_PER_MESSAGE * len(messages) + ESTIMATE_TOKENS_PER_PROMPT
    return len(tok.apply_chat_template(messages))
