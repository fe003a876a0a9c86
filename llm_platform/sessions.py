"""Database sessions that look up only keys they could have issued.

Django's store looks a session cookie's key up as the client sent it; a key holding a NUL makes
PostgreSQL refuse the query (a 500 on every page that reads the session). Keys Django issues are
32 characters of ``[a-z0-9]``: anything else is no session, without a database query.
"""

from __future__ import annotations

import re

from django.contrib.sessions.backends.db import SessionStore as DatabaseSessionStore

ISSUED_KEY = re.compile(r"[a-z0-9]{8,64}")


class SessionStore(DatabaseSessionStore):
    """``SESSION_ENGINE = "llm_platform.sessions"``: the database store, keys checked first."""

    def _issued(self) -> bool:
        if isinstance(self.session_key, str) and ISSUED_KEY.fullmatch(self.session_key):
            return True
        self._session_key = None
        return False

    def _get_session_from_db(self):  # noqa: ANN202 - Django's signature
        return super()._get_session_from_db() if self._issued() else None

    async def _aget_session_from_db(self):  # noqa: ANN202 - Django's signature
        return await super()._aget_session_from_db() if self._issued() else None
