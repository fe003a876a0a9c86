"""Read-only queries about tenants and keys."""

from __future__ import annotations

from datetime import timedelta

from django.utils import timezone

from tenants.models import ApiKey
from tenants.services import hash_key

# last_used_at is a hint for people, not an audit log: write it at most this often per key.
LAST_USED_RESOLUTION = timedelta(seconds=30)


async def aauthenticate_key(raw_key: str) -> ApiKey | None:
    """The live key (with its tenant and tier loaded) for ``raw_key``, or None.

    None for an unknown key, a revoked key or a key of an inactive tenant. Touches
    ``last_used_at`` (at most every :data:`LAST_USED_RESOLUTION`).
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
    if key.last_used_at is None or now - key.last_used_at > LAST_USED_RESOLUTION:
        key.last_used_at = now
        await ApiKey.objects.filter(pk=key.pk).aupdate(last_used_at=now)
    return key
