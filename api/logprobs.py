"""Log-probabilities in the OpenAI API's shapes (the worker computes and renders the entries).

Chat (``choices[].logprobs``): ``{"content": [{"token", "logprob", "bytes", "top_logprobs":
[{"token", "logprob", "bytes"}, ...]}, ...], "refusal": null}``; the chosen token is reported
apart from its ``top_logprobs`` (which may not hold it).

Completions (``choices[].logprobs``): four parallel lists, ``tokens``, ``token_logprobs``,
``top_logprobs`` (one object ``{token: logprob}`` per token, most likely first, holding the
chosen token too, as vLLM does) and ``text_offset`` (where each token starts in the returned
text, in characters, counted across a stream's chunks). An echoed prompt's first token has a
``null`` logprob and ``null`` top object: nothing predicts it.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import Any

from inference.protocol.events import PositionLogprobs


def chat_entry(entry: PositionLogprobs) -> dict[str, Any]:
    """One token of a chat answer's ``logprobs.content``."""
    return {"token": entry.token, "logprob": entry.logprob, "bytes": entry.utf8_bytes(),
            "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": t.utf8_bytes()}
                             for t in entry.top]}


def chat_logprobs(entries: Sequence[PositionLogprobs]) -> dict[str, Any]:
    """A chat choice's (or chunk's) ``logprobs`` object."""
    return {"content": [chat_entry(e) for e in entries], "refusal": None}


def _top_object(entry: PositionLogprobs) -> dict[str, float] | None:
    if entry.logprob is None:
        return None
    top = {t.token: t.logprob for t in entry.top}
    top.setdefault(entry.token, entry.logprob)
    return top


class CompletionLogprobs:
    """A text completion's ``logprobs`` objects, keeping the text offset across chunks."""

    def __init__(self) -> None:
        self._offset = 0
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def render(self, entries: Sequence[PositionLogprobs]) -> dict[str, Any]:
        """The ``logprobs`` object of ``entries``, the tokens that follow those rendered so far."""
        offsets = []
        for entry in entries:
            offsets.append(self._offset)
            # Characters complete once this token's bytes are in (a split one: with the last).
            self._offset += len(self._decoder.decode(bytes(entry.utf8_bytes())))
        return {"tokens": [e.token for e in entries],
                "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [_top_object(e) for e in entries],
                "text_offset": offsets}
