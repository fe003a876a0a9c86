"""Tool calls read from an answer's text as it streams: the Hermes ``<tool_call>`` blocks of
:mod:`inference.tokenization.chat_tools`, split into content and OpenAI's ``tool_calls``.

:class:`ToolCallParser` reads the text one character at a time and says, for each, what it adds:
content, the start of a call (its id and function name), or a fragment of the call's arguments.
What it says after a text depends on that text only, never on how it was cut into deltas, so a
streamed answer's content and arguments join to exactly the non-streamed answer's, whatever the
number of tokens per event (the whole answer is the same parser fed once).

- Content streams as it comes, except the characters that may be the start of ``<tool_call>``,
  held until the next one settles it; whitespace between and after calls is dropped.
- A call ``{"name": N, "arguments": A}`` (the grammar writes exactly that, name first,
  compactly; the model may add blanks) starts as soon as ``N`` and the key ``"arguments"`` are
  read; an object or array ``A`` then streams character by character, as written, up to its
  closing bracket. Arguments written as a JSON string (JSON text inside a string) go out as that
  string's value; ``null`` or none at all as ``{}``, as does a function without parameters.
- A block that is not such a call (no name first, not JSON) is read whole when it closes: a JSON
  object with a string ``name`` is still a call (its arguments re-written as JSON), anything
  else is content, markers included. An answer cut inside a call (``length``) keeps the call
  with the arguments written so far, and drops one cut before its name was read (or, after
  calls, before its marker was whole).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from inference.tokenization.chat_tools import CALL_CLOSE, CALL_OPEN

_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*\Z')
_WHITESPACE = " \t\r\n"


@dataclass(frozen=True)
class Piece:
    """What the text adds: ``kind`` ``content`` (``text``), ``call`` (call ``index`` starts:
    ``call_id``, ``name``) or ``arguments`` (``text`` is a fragment of call ``index``'s)."""

    kind: str
    text: str = ""
    index: int = 0
    call_id: str = ""
    name: str = ""


def new_call_id() -> str:
    """A tool call's id, as OpenAI writes them: ``call_`` and 24 characters."""
    return "call_" + uuid.uuid4().hex[:24]


class ToolCallParser:
    """See the module docstring. Feed text with :meth:`feed`, then call :meth:`finish` once.

    Args:
        calls_only: the grammar lets no text come before a call (``tool_choice`` ``required``
            or a named function, or ``auto`` with a JSON ``response_format``): an answer that
            ends inside a call's marker (``<tool``) drops it, as it drops a block cut before its
            name; with free text before calls it stays content (it may be the text's own).
    """

    def __init__(self, calls_only: bool = False) -> None:
        self._calls_only = calls_only
        self.calls = 0  # calls started
        self._state = "content"  # content | head | arguments | after
        self._held = ""  # content that may be the start of CALL_OPEN
        self._raw = ""  # the current call's text since CALL_OPEN
        self._after_call = False  # no content yet since the last call
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._scalar = ""  # arguments written as a scalar, read whole
        self._sent_arguments = False

    def feed(self, text: str) -> list[Piece]:
        """The pieces ``text`` adds, in order (adjacent pieces of one kind merged)."""
        out: list[Piece] = []
        for char in text:
            self._char(char, out)
        return _merged(out)

    def finish(self) -> list[Piece]:
        """The pieces still held when the text ends."""
        out: list[Piece] = []
        if self._state == "content":
            # The start of a call's marker, cut short: dropped after calls or where only calls
            # may come; else it may be the text's own.
            if not (self._after_call or self._calls_only):
                self._content(self._held, out)
            self._held = ""
        elif self._state == "head":  # cut inside a block: a call, if it is one whole
            self._whole_block(out, closed=False, cut=True)
        elif self._state == "arguments" and self._scalar:
            self._scalar_arguments(out)
        self._state = "content"
        return _merged(out)

    # -- one character -------------------------------------------------------------------------

    def _char(self, char: str, out: list[Piece]) -> None:
        if self._state == "content":
            self._held += char
            if self._held == CALL_OPEN:
                self._held, self._raw, self._state = "", "", "head"
                return
            cut = next(k for k in range(len(self._held) + 1)
                       if CALL_OPEN.startswith(self._held[k:]))
            self._content(self._held[:cut], out)
            self._held = self._held[cut:]
            return
        self._raw += char
        if self._state == "head":
            if self._raw.endswith(CALL_CLOSE):
                self._raw = self._raw[:-len(CALL_CLOSE)]
                self._whole_block(out, closed=True)
            elif char == ":" and (match := _HEAD.match(self._raw)):
                out.append(Piece("call", index=self.calls, call_id=new_call_id(),
                                 name=json.loads(match.group(1))))
                self.calls += 1
                self._state, self._sent_arguments = "arguments", False
                self._depth, self._in_string, self._escaped, self._scalar = 0, False, False, ""
        elif self._state == "arguments":
            self._argument_char(char, out)
        elif self._raw.endswith(CALL_CLOSE):  # after the arguments: up to the block's end
            self._state, self._after_call = "content", True

    def _argument_char(self, char: str, out: list[Piece]) -> None:
        if self._scalar:
            if self._scalar[0] == '"':
                self._scalar += char
                if self._string_char(char):
                    self._scalar_arguments(out)
            elif char in _WHITESPACE + ",}<":
                self._scalar_arguments(out)
                self._after_arguments()
            else:
                self._scalar += char
            return
        if self._depth == 0:
            if char in _WHITESPACE:
                return
            if char not in "{[":
                self._scalar = char
                return
        self._sent_arguments = True
        out.append(Piece("arguments", char, index=self.calls - 1))
        if self._in_string:
            self._string_char(char)
        elif char == '"':
            self._in_string = True
        elif char in "{[":
            self._depth += 1
        elif char in "}]":
            self._depth -= 1
            if self._depth == 0:
                self._state = "after"

    def _string_char(self, char: str) -> bool:
        """Track a JSON string; True when ``char`` closes it."""
        if self._escaped:
            self._escaped = False
        elif char == "\\":
            self._escaped = True
        elif char == '"' and (self._in_string or len(self._scalar) > 1):
            self._in_string = False
            return True
        return False

    def _after_arguments(self) -> None:
        self._state = "after"
        if self._raw.endswith(CALL_CLOSE):
            self._state, self._after_call = "content", True

    def _scalar_arguments(self, out: list[Piece]) -> None:
        text, self._scalar = self._scalar, ""
        if text.startswith('"'):
            try:
                value = json.loads(text)
            except ValueError:
                value = text
            text = value if isinstance(value, str) else text
            self._state = "after"
        if text == "null":
            text = "{}"
        self._sent_arguments = True
        out.append(Piece("arguments", text, index=self.calls - 1))

    def _content(self, text: str, out: list[Piece]) -> None:
        if self._after_call:
            text = text.lstrip(_WHITESPACE)
            if not text:
                return
            self._after_call = False
        if text:
            out.append(Piece("content", text))

    def _whole_block(self, out: list[Piece], *, closed: bool, cut: bool = False) -> None:
        """A block whose start was not ``{"name": ..., "arguments": ...}``, read whole; one the
        answer's end ``cut`` before its name was read is dropped."""
        raw, self._raw = self._raw, ""
        try:
            value = json.loads(raw)
        except (ValueError, RecursionError):
            value = None
        if isinstance(value, dict) and isinstance(value.get("name"), str):
            arguments = value.get("arguments")
            text = arguments if isinstance(arguments, str) else json.dumps(
                {} if arguments is None else arguments, ensure_ascii=False)
            out.append(Piece("call", index=self.calls, call_id=new_call_id(),
                             name=value["name"]))
            out.append(Piece("arguments", text, index=self.calls))
            self.calls += 1
            self._state, self._after_call = "content", True
            return
        self._state = "content"
        if not cut:
            self._content(CALL_OPEN + raw + (CALL_CLOSE if closed else ""), out)


def _merged(pieces: list[Piece]) -> list[Piece]:
    """Adjacent content pieces, and adjacent fragments of one call, as one piece."""
    out: list[Piece] = []
    for piece in pieces:
        last = out[-1] if out else None
        if (last is not None and piece.kind == last.kind and piece.kind != "call"
                and piece.index == last.index):
            out[-1] = Piece(piece.kind, last.text + piece.text, index=piece.index)
        else:
            out.append(piece)
    return out
