"""Who a chat socket acts for, checked at every use, not only at connect.

Before each frame is acted on, and every ``REAUTHORIZE_INTERVAL_S`` while the socket is open
(:mod:`chat.conf`), the consumer (:mod:`chat.consumers`) calls :func:`authorize`: the session
that opened the socket must still exist (signing out deletes it) and still sign in the same
active user, and this user must still belong to the same active tenant. When that no longer
holds, the answer being written is stopped (and kept), the page gets a closing ``error`` frame
with the :class:`Denial`'s message, and the socket closes with its code: 4401 (signed out,
account disabled) or 4403 (tenant lost).
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module
from typing import Any

from django.conf import settings
from django.contrib.auth import (
    BACKEND_SESSION_KEY,
    HASH_SESSION_KEY,
    SESSION_KEY,
    get_user_model,
    load_backend,
)
from django.contrib.auth.models import AbstractBaseUser
from django.utils.crypto import constant_time_compare

from chat import selectors
from tenants.models import Tenant

# Close codes (4000-4999 are the application's): not signed in, no tenant.
CLOSE_UNAUTHENTICATED = 4401
CLOSE_NO_TENANT = 4403


@dataclass(frozen=True)
class Denial:
    """Why a socket may no longer act for its user: shown in the page, then the close code."""

    code: int
    reason: str  # the close frame's reason (short)
    message: str  # the error frame's readable message


SIGNED_OUT = Denial(CLOSE_UNAUTHENTICATED, "signed out",
                    "You are signed out (or your account was disabled). Sign in again to chat.")
NO_TENANT = Denial(CLOSE_NO_TENANT, "no tenant",
                   "Your account no longer belongs to an active tenant, so it cannot chat.")
OTHER_TENANT = Denial(CLOSE_NO_TENANT, "tenant changed",
                      "Your account now belongs to another tenant. Reload the page to chat "
                      "there.")


def _session_signs_in(data: dict[str, Any], user: AbstractBaseUser) -> bool:
    """Whether the session's auth hash is ``user``'s (the current key's or a fallback's).

    Read-only, unlike :func:`django.contrib.auth.get_user`: a socket never rotates or flushes
    the browser's session (it cannot set the cookie).
    """
    if not hasattr(user, "get_session_auth_hash"):
        return True
    stored = data.get(HASH_SESSION_KEY)
    if not isinstance(stored, str) or not stored:
        return False
    fallbacks = getattr(user, "get_session_auth_fallback_hash", lambda: [])()
    return any(constant_time_compare(stored, expected)
               for expected in [user.get_session_auth_hash(), *fallbacks])


def authorize(session_key: str | None, user_pk: Any,
              tenant_pk: int | None = None) -> tuple[AbstractBaseUser, Tenant] | Denial:
    """Who a socket acts for now, read fresh from the session store and the database.

    Args:
        session_key: the session that authenticated the socket (None: none did).
        user_pk: the user it authenticated.
        tenant_pk: the tenant the socket was opened under; None at connect.

    Returns:
        (the user, the user's active tenant), or why not: :data:`SIGNED_OUT` when the session is
        gone (signed out, expired), signs in someone else, no longer verifies (password changed)
        or the user is inactive; :data:`NO_TENANT` when the user belongs to no active tenant;
        :data:`OTHER_TENANT` when it belongs to another one than ``tenant_pk``.
    """
    if not session_key:
        return SIGNED_OUT
    store = import_module(settings.SESSION_ENGINE).SessionStore(session_key)
    data = {key: store.get(key) for key in (SESSION_KEY, BACKEND_SESSION_KEY, HASH_SESSION_KEY)}
    backend_path = data[BACKEND_SESSION_KEY]
    if data[SESSION_KEY] is None or backend_path not in settings.AUTHENTICATION_BACKENDS:
        return SIGNED_OUT
    try:
        session_user_pk = get_user_model()._meta.pk.to_python(data[SESSION_KEY])
    except Exception:  # noqa: BLE001 - a malformed session signs no one in
        return SIGNED_OUT
    if session_user_pk != user_pk:
        return SIGNED_OUT
    user = load_backend(backend_path).get_user(session_user_pk)
    if (user is None or not getattr(user, "is_active", True)
            or not _session_signs_in(data, user)):
        return SIGNED_OUT
    tenant = selectors.user_tenant(user)
    if tenant is None:
        return NO_TENANT
    if tenant_pk is not None and tenant.pk != tenant_pk:
        return OTHER_TENANT
    return user, tenant
