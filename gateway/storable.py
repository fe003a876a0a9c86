"""Text a client sent, made storable: PostgreSQL keeps no NUL character (U+0000) in ``text``,
``varchar`` or ``jsonb``, where SQLite does; a NUL in a client's text is stored as U+FFFD (the
replacement character), so that one row reads the same on both databases, and an id or a filter
holding one is looked up as one that matches nothing.
"""

from __future__ import annotations

from typing import Any

NUL = "\x00"
REPLACEMENT = "\ufffd"


def storable_text(text: str) -> str:
    """``text`` with each NUL replaced by U+FFFD (the same string when it holds none)."""
    return text.replace(NUL, REPLACEMENT) if NUL in text else text


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
