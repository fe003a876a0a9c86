"""Text a client sent, made storable: PostgreSQL keeps no NUL character (U+0000) in ``text``,
``varchar`` or ``jsonb``, where SQLite does; a NUL in a client's text is stored as U+FFFD (the
replacement character), so that one row reads the same on both databases, and an id or a filter
holding one is looked up as one that matches nothing. A lone UTF-16 surrogate (U+D800 to U+DFFF,
which JSON's ``\\ud800`` escapes make) is no text at all: neither database encodes it (jsonb
refuses the escape), so it is stored as U+FFFD too; where a client's value must be kept exactly,
:func:`holds_lone_surrogate` finds it first so that it is refused.
"""

from __future__ import annotations

import re
from typing import Any

NUL = "\x00"
REPLACEMENT = "\ufffd"
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def storable_text(text: str) -> str:
    """``text`` with each NUL and each lone surrogate replaced by U+FFFD (the same string when
    it holds none). ASCII text (most of it, and a large prompt's) is only searched for a NUL:
    the pattern's pass over 2 MB takes about 5 ms, ``in`` a hundredth of one."""
    if text.isascii():
        return text.replace(NUL, REPLACEMENT) if NUL in text else text
    return _UNSTORABLE.sub(REPLACEMENT, text)


def holds_lone_surrogate(value: Any) -> bool:
    """Whether any string in the JSON value ``value`` (object keys included) holds a lone UTF-16
    surrogate."""
    if isinstance(value, str):
        return _SURROGATE.search(value) is not None
    if isinstance(value, dict):
        return any(holds_lone_surrogate(k) or holds_lone_surrogate(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return any(holds_lone_surrogate(item) for item in value)
    return False


def storable(value: Any) -> Any:
    """A JSON value (``dict``/``list``/``str``/number/bool/None, nested) with every string in it,
    object keys included, made :func:`storable_text`; other values as they are."""
    if isinstance(value, str):
        return storable_text(value)
    if isinstance(value, dict):
        return {storable(key): storable(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [storable(item) for item in value]
    return value


def holds_nul(*texts: str | None) -> bool:
    """Whether any of ``texts`` holds a NUL (such an id was never issued: no query needed)."""
    return any(text is not None and NUL in text for text in texts)
