"""No log line carries an API key: anything shaped like one is cut to the prefix the admin shows.

The platform reads keys from the ``Authorization`` header only and never logs it; but a client
may put a key where none belongs (a URL's query or path, which daphne's access log and Django's
"Not Found" warning write). :class:`RedactKeys` filters the web process's log handler
(``LOGGING`` in the settings) and :class:`RedactingAccessLog` writes daphne's access log
(:mod:`llm_platform.serve`), both through :func:`redact`.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from daphne.access import AccessLogGenerator

# ``sk-`` and URL-safe characters, as keys are made (tenants.services.generate_raw_key): the
# first 10 characters are the prefix the admin lists (VISIBLE_PREFIX_LEN), the rest is cut. A
# URL may carry any of its characters percent-encoded (``sk%2D...``, ``%73%6B%2D...``), which
# the server decodes: those spellings are keys too (an encoded character after a key is cut with
# it: a log line may lose a little, never keep a key).
_PREFIX = r"(?:s|%73)(?:k|%6[bB])(?:-|%2[dD])"
_CHAR = r"(?:[A-Za-z0-9_-]|%[0-9A-Fa-f]{2})"
KEY_SHAPED = re.compile(rf"({_PREFIX}{_CHAR}{{7}}){_CHAR}+")


def redact(text: str) -> str:
    """``text`` with every key-shaped word (also percent-encoded) cut to its visible prefix and
    ``…``."""
    return KEY_SHAPED.sub(r"\1…", text) if ("sk-" in text or "%" in text) else text


class RedactKeys(logging.Filter):
    """A log handler's filter that redacts keys (:func:`redact`) in the message, the arguments
    it is formatted with and the traceback's text of each record."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        redacted = redact(message)
        if redacted != message:
            record.msg, record.args = redacted, ()
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        return True


class RedactingAccessLog(AccessLogGenerator):
    """daphne's access log, with keys redacted from the request line (a key in a URL)."""

    def write_entry(self, host: Any, date: Any, request: str, *args: Any, **kwargs: Any) -> None:
        super().write_entry(host, date, redact(str(request)), *args, **kwargs)


class WithoutTraceback(logging.Filter):
    """A logger's filter that keeps its records to their one line: for refusals whose message
    says all (Django's ``django.security.DisallowedHost``: a ``Host`` not allowed, which any
    client can send), a traceback per request would only fill the log."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.exc_info = None
        record.exc_text = None
        return True
