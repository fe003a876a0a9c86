"""Incremental detokenization with stop strings.

Text deltas are produced the way text-generation-inference and vLLM do it: decode a short window
of recent tokens twice (with and without the newest one) and emit the difference, holding it
back while it ends in U+FFFD (a character whose bytes are split across tokens). Each delta is
therefore whole characters, and the concatenated deltas equal the decoded output.

Stop strings: text that might be the start of a stop string is held back until it is known not
to be one; a matched stop string and everything after it is never emitted. Text still held back
when the request ends another way is released by :meth:`IncrementalDetokenizer.flush`.

Items that belong to a token's text (its log-probability entry) wait with it
(:meth:`IncrementalDetokenizer.hold`, :meth:`IncrementalDetokenizer.release`): an item goes out
once its token's text is all emitted, and never for a token whose text starts at or past a stop
string; the token the stop string starts inside goes out with its text cut there. So the items
cover exactly the returned text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from inference.engine.backends.base import Tokenizer

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns one request's generated token ids into safe text deltas.

    Args:
        tokenizer: decodes token ids (special tokens skipped).
        stop: stop strings; an empty sequence disables the hold-back.
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()):
        self._tokenizer = tokenizer
        self._stop = tuple(s for s in stop if s)
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self.text = ""  # all decoded text so far (emitted or held back), cut at a stop string
        self._emitted = 0
        self.stopped = False
        self._held: list[tuple[int, int, Any]] = []  # (start, end in text, item), in order
        self._decoded = 0  # characters decoded so far, a stop string's cut not applied

    @property
    def emitted(self) -> int:
        """Characters of :attr:`text` emitted so far."""
        return self._emitted

    def hold(self, item: Any, start: int) -> None:
        """Keep ``item`` until its token's text, ``text[start:]`` as it is now, is emitted.

        ``start`` is ``len(text)`` just before the token was added (:meth:`add_token`); a token
        that added no text (an EOS, part of a character) has an empty text at ``start``.
        """
        self._held.append((start, max(start, self._decoded), item))

    def release(self, final: bool = False) -> list[tuple[Any, str | None]]:
        """The held items whose text is now out, in order, each with its cut text or None.

        Not stopped: the items whose text is all emitted (an empty text: once text past it is
        emitted, or ``final``, the request's end). Stopped: every item whose text starts before
        the stop string, the cut text (``text[start:]``) given for the one it starts inside;
        the others are dropped.
        """
        out: list[tuple[Any, str | None]] = []
        if self.stopped:
            end_of_text = len(self.text)
            for start, end, item in self._held:
                if start < end_of_text:
                    out.append((item, self.text[start:] if end > end_of_text else None))
            self._held.clear()
            return out
        while self._held:
            start, end, item = self._held[0]
            if not (final or (end <= self._emitted and start < self._emitted)):
                break
            out.append((item, None))
            self._held.pop(0)
        return out

    def add_token(self, token_id: int, check_stop: bool = True) -> str:
        """Add one generated token; return the text that is now safe to stream (maybe "").

        With ``check_stop`` False (before ``min_tokens``), stop strings are not looked for and
        the text is released at once. After a stop string is found, :attr:`stopped` is True and
        further tokens are ignored.
        """
        if self.stopped:
            return ""
        self._ids.append(token_id)
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = decode(self._ids[self._prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return ""
        self.text += new_text[len(prefix_text):]
        self._decoded = len(self.text)
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        if not (self._stop and check_stop):
            return self._take(len(self.text))
        return self._release()

    def _release(self) -> str:
        # Text that could start a stop string is never emitted, so a match starts in the
        # unemitted part.
        start = self._emitted
        hit = min((i for i in (self.text.find(s, start) for s in self._stop) if i >= 0),
                  default=-1)
        if hit >= 0:
            self.stopped = True
            self.text = self.text[:hit]
            return self._take(hit)
        safe = len(self.text)
        for s in self._stop:
            # Longest suffix of the text that is a proper prefix of this stop string.
            for k in range(min(len(s) - 1, len(self.text) - self._emitted), 0, -1):
                if self.text.endswith(s[:k]):
                    safe = min(safe, len(self.text) - k)
                    break
        return self._take(safe)

    def _take(self, end: int) -> str:
        if end <= self._emitted:
            return ""
        delta = self.text[self._emitted:end]
        self._emitted = end
        return delta

    def flush(self) -> str:
        """Release text held back for a possible stop string (the request ended another way).

        Tokens still held because they end in a partial character are decoded as they are (the
        partial character shows as U+FFFD), so the concatenated deltas equal the decoded output.
        A stop string completed by that text still cuts it.
        """
        if not self.stopped and self._read_offset < len(self._ids):
            decode = self._tokenizer.decode
            prefix_text = decode(self._ids[self._prefix_offset:self._read_offset])
            new_text = decode(self._ids[self._prefix_offset:])
            self._read_offset = len(self._ids)
            if len(new_text) > len(prefix_text):
                self.text += new_text[len(prefix_text):]
                self._decoded = len(self.text)
                hits = [i for i in (self.text.find(s, self._emitted) for s in self._stop) if i >= 0]
                if hits:
                    self.stopped = True
                    self.text = self.text[:min(hits)]
        return self._take(len(self.text))
