"""Writes that a request can do without, and logs that an outage does not flood.

Some writes on a request's way are hints for people, not something the request needs: an API
key's ``last_used_at``, a user's ``last_login``, a stats snapshot. When the database refuses one
(down, locked, read-only, out of disk, or any other database error) it is skipped, and the request
goes on; the refusals are logged at most once a minute (:class:`OccasionalLog`), not once per
request. Writes a request does need (a usage record, a chat message) never go through here.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from django.db import DatabaseError, transaction

log = logging.getLogger(__name__)

T = TypeVar("T")

# How often a kind of refusal is logged at most (seconds).
LOG_INTERVAL_S = 60.0


class OccasionalLog:
    """Warnings of one kind, at most one line per ``interval_s``; the next line says how many
    were left out since the last one. Safe from any thread."""

    def __init__(self, logger: logging.Logger, interval_s: float = LOG_INTERVAL_S):
        self.logger = logger
        self.interval_s = interval_s
        self._last = float("-inf")
        self._left_out = 0
        self._lock = threading.Lock()

    def warning(self, message: str, *args: Any) -> bool:
        """Log ``message % args`` unless a line was logged less than ``interval_s`` ago;
        return whether it was logged."""
        now = time.monotonic()
        with self._lock:
            if now - self._last < self.interval_s:
                self._left_out += 1
                return False
            left_out, self._left_out, self._last = self._left_out, 0, now
        if left_out:
            message, args = message + " (and %d more since the last such line)", (*args,
                                                                                    left_out)
        self.logger.warning(message, *args)
        return True


class BestEffortWrite:
    """One kind of write a request can do without (``what`` names it in the log)."""

    def __init__(self, what: str, interval_s: float = LOG_INTERVAL_S):
        self.what = what
        self.refusals = OccasionalLog(log, interval_s)

    def __call__(self, write: Callable[..., T], *args: Any) -> T | None:
        """``write(*args)`` in a transaction of its own (a savepoint inside another), so that a
        refusal leaves an enclosing transaction usable; None when the database refused it (any
        :class:`django.db.DatabaseError`, logged occasionally). Other exceptions propagate."""
        try:
            with transaction.atomic():
                return write(*args)
        except DatabaseError as exc:
            self.refusals.warning("skipped %s: the database refused the write: %s", self.what,
                                  exc)
            return None
