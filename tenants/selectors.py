"""Read-only queries about tenants and keys."""

from __future__ import annotations

from datetime import datetime, timedelta

from asgiref.sync import sync_to_async
from django.utils import timezone

from tenants.best_effort import BestEffortWrite
from tenants.models import ApiKey
from tenants.services import hash_key

# last_used_at is a hint for people, not an audit log: write it at most this often per key.
LAST_USED_RESOLUTION = timedelta(seconds=30)
# ... and never fail a request for it (a database that refuses writes skips it).
LAST_USED_WRITE = BestEffortWrite("an API key's last_used_at")


def _stamp_last_used(pk: int, now: datetime) -> int:
    return ApiKey.objects.filter(pk=pk).update(last_used_at=now)


async def aauthenticate_key(raw_key: str) -> ApiKey | None:
    """The live key (with its tenant and tier loaded) for ``raw_key``, or None.

    None for an unknown key, a revoked key or a key of an inactive tenant. Touches
    ``last_used_at`` (at most every :data:`LAST_USED_RESOLUTION`), best effort: a database that
    refuses the write skips it (:data:`LAST_USED_WRITE`).

    Raises:
        django.db.DatabaseError: the key could not be read (the database is unavailable).
    """
    if not raw_key:
        return None
    key = (
        await ApiKey.objects.select_related("tenant", "tenant__tier")
        .filter(hashed_key=hash_key(raw_key), revoked_at__isnull=True, tenant__is_active=True)
        .afirst()
    )
    if key is None:
        return None
    now = timezone.now()
    due = key.last_used_at is None or now - key.last_used_at > LAST_USED_RESOLUTION
    if due and await sync_to_async(LAST_USED_WRITE)(_stamp_last_used, key.pk, now) is not None:
        key.last_used_at = now
    return key
