"""Receivers of Django's signals that write what a request can do without."""

from __future__ import annotations

from typing import Any

from django.contrib.auth.models import update_last_login as stamp_last_login

from tenants.best_effort import BestEffortWrite

LAST_LOGIN_WRITE = BestEffortWrite("a user's last_login")


def update_last_login(sender: Any, user: Any, **kwargs: Any) -> None:
    """``user_logged_in``: stamp the user's ``last_login`` as Django does, best effort (a
    database that refuses the write skips it: :data:`LAST_LOGIN_WRITE`)."""
    LAST_LOGIN_WRITE(stamp_last_login, sender, user)
