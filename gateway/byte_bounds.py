"""Token count bounds of a text from its bytes, for a byte-level BPE tokenizer (no tokenizing).

A byte-level BPE tokenizer (GPT-2's scheme: Radford et al., 2019, the ``ByteLevel`` pre-tokenizer
of Hugging Face ``tokenizers``) writes each byte of the text as one character of a 256-character
alphabet and merges characters into vocabulary tokens. A token therefore covers at least one byte
and at most the longest token of the vocabulary, so a text of ``b`` bytes has between
``ceil(b / longest)`` and ``b`` tokens. One exception: a byte whose character is no token of the
vocabulary (SmolLM2's tokenizer lacks six control characters, e.g. ``\\x16``) is dropped without a
token (or, with an ``unk_token``, may share one with its neighbours), so the lower bound counts
only the bytes the vocabulary can hold (:meth:`ByteBounds.countable_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from inference.tokenization import byte_level_table


@dataclass(frozen=True)
class ByteBounds:
    """Token count bounds of a text from its UTF-8 bytes.

    Attributes:
        max_token_bytes: bytes of the longest token (vocabulary and added tokens).
        prefix_bytes: bytes the pre-tokenizer adds before the text (1 with
            ``add_prefix_space``, else 0).
        unencoded: byte values whose character no token holds: the tokenizer drops them (or
            folds them into an unknown token), so they count for no token in the lower bound.
    """

    max_token_bytes: int
    prefix_bytes: int = 0
    unencoded: frozenset[int] = frozenset()

    def countable_bytes(self, data: bytes) -> int:
        """Bytes of ``data`` (a text's UTF-8) that each end up in a token."""
        return len(data) - sum(data.count(b) for b in self.unencoded)

    def at_least(self, n_bytes: int) -> int:
        """The fewest tokens a text with ``n_bytes`` countable bytes can have
        (:meth:`countable_bytes`; all of its bytes when the vocabulary holds every byte)."""
        return -(-n_bytes // self.max_token_bytes)

    def at_most(self, n_bytes: int) -> int:
        """The most tokens a text of ``n_bytes`` bytes can have (each token has a byte)."""
        return n_bytes + self.prefix_bytes


def _byte_level(pre_tokenizer: Any) -> dict[str, Any] | None:
    """The ``ByteLevel`` step of a pre-tokenizer (alone or in a ``Sequence``), or None."""
    if not isinstance(pre_tokenizer, dict):
        return None
    if pre_tokenizer.get("type") == "ByteLevel":
        return pre_tokenizer
    if pre_tokenizer.get("type") == "Sequence":
        for step in pre_tokenizer.get("pretokenizers") or []:
            if (found := _byte_level(step)) is not None:
                return found
    return None


def byte_bounds(spec: dict[str, Any]) -> ByteBounds | None:
    """The byte bounds of the tokenizer described by ``spec`` (``tokenizer.json``'s content).

    Only a byte-level BPE tokenizer without a normalizer (which could change the text's length)
    and without added tokens that swallow neighbouring whitespace (``lstrip``/``rstrip``) has
    them: each vocabulary entry is written in the byte-level alphabet, one character per byte, and
    an added token matches its own UTF-8 bytes. Anything else: None (no bound is used).
    """
    model = spec.get("model") or {}
    byte_level = _byte_level(spec.get("pre_tokenizer"))
    if model.get("type") != "BPE" or byte_level is None or spec.get("normalizer") is not None:
        return None
    added = spec.get("added_tokens") or []
    if any(token.get("lstrip") or token.get("rstrip") for token in added):
        return None
    vocab = model.get("vocab") or {}
    longest = max([*map(len, vocab), *(len(token["content"].encode()) for token in added)],
                  default=0)
    if longest < 1:
        return None
    unencoded = frozenset(b for char, b in byte_level_table().items() if char not in vocab)
    return ByteBounds(max_token_bytes=longest,
                      prefix_bytes=1 if byte_level.get("add_prefix_space") else 0,
                      unencoded=unencoded)
