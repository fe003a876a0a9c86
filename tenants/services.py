"""Operations that change tenants and keys (the admin and the commands call these)."""

from __future__ import annotations

import hashlib
import os
import secrets
from pathlib import Path

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import transaction
from django.utils import timezone
from django.utils.text import slugify

from tenants.models import ApiKey, Membership, PriorityTier, Tenant

KEY_PREFIX = "sk-"
VISIBLE_PREFIX_LEN = 10
DEMO_TENANT_SLUG = "demo"


def hash_key(raw_key: str) -> str:
    """SHA-256 hex digest of a key; keys are random 256-bit secrets, so a fast hash suffices."""
    return hashlib.sha256(raw_key.encode()).hexdigest()


def generate_raw_key() -> str:
    """A new random key: ``sk-`` and 43 URL-safe characters (256 bits)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def create_api_key(
    tenant: Tenant, name: str = "", *, is_operator: bool = False
) -> tuple[ApiKey, str]:
    """Create a key for ``tenant``; return it and the raw key, which is never stored."""
    raw = generate_raw_key()
    key = ApiKey.objects.create(
        tenant=tenant,
        name=name,
        prefix=raw[:VISIBLE_PREFIX_LEN],
        hashed_key=hash_key(raw),
        is_operator=is_operator,
    )
    return key, raw


def revoke_api_key(key: ApiKey) -> None:
    """Revoke ``key`` from now on (idempotent)."""
    if key.revoked_at is None:
        key.revoked_at = timezone.now()
        key.save(update_fields=["revoked_at"])


def default_tier() -> PriorityTier:
    """The ``standard`` tier (created if missing)."""
    tier, _ = PriorityTier.objects.get_or_create(name="standard", defaults={"priority": 0})
    return tier


@transaction.atomic
def create_tenant(
    name: str,
    *,
    slug: str = "",
    tier: PriorityTier | None = None,
    fairness_weight: float = 1.0,
    key_name: str = "default",
    operator_key: bool = False,
    allowed_models: str = "",
    **limits: int,
) -> tuple[Tenant, ApiKey, str]:
    """Create a tenant with one API key; return the tenant, the key and the raw key.

    ``limits`` are Tenant fields: ``requests_per_minute``, ``tokens_per_minute``,
    ``max_concurrent_requests``, ``token_budget``, ``budget_period``. ``allowed_models``: the
    models it may call (:mod:`tenants.model_access`; blank: every enabled model).

    Raises:
        django.core.exceptions.ValidationError: an empty or taken name or slug, a limit out
            of range, or an entry of ``allowed_models`` that is neither a model name nor a
            pattern; nothing is created then.
    """
    tenant = Tenant(
        name=name.strip(),
        slug=slug or slugify(name),
        tier=tier or default_tier(),
        fairness_weight=fairness_weight,
        allowed_models=allowed_models,
        **limits,
    )
    tenant.full_clean()
    tenant.save()
    key, raw = create_api_key(tenant, key_name, is_operator=operator_key)
    return tenant, key, raw


def demo_key_file() -> Path:
    """Where set-up keeps the demo tenant's raw key (``var/demo_api_key``, not committed)."""
    return Path(settings.BASE_DIR) / "var" / "demo_api_key"


def ensure_demo_tenant() -> tuple[Tenant, str | None]:
    """Create the demo tenant and an operator key once; return it and the raw key if known.

    The raw key is written to :func:`demo_key_file` so the run script can print it on every
    start; a demo tenant created before without that file gets a fresh key.
    """
    path = demo_key_file()
    tenant = Tenant.objects.filter(slug=DEMO_TENANT_SLUG).first()
    if tenant is not None and path.is_file():
        raw = path.read_text().strip()
        if ApiKey.objects.filter(hashed_key=hash_key(raw), revoked_at__isnull=True).exists():
            return tenant, raw
    if tenant is None:
        tenant, _, raw = create_tenant("Demo", slug=DEMO_TENANT_SLUG, operator_key=True)
    else:
        _, raw = create_api_key(tenant, "demo", is_operator=True)
    write_private(path, raw)
    return tenant, raw


DEMO_USERNAME = "demo"


def write_private(path: Path, secret: str) -> None:
    """Write ``secret`` to ``path`` readable by its owner only, from the first byte (mode 0600;
    its folder, when this creates it, 0700)."""
    if not path.parent.is_dir():
        path.parent.parent.mkdir(parents=True, exist_ok=True)
        path.parent.mkdir(mode=0o700, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # an older file may have had a wider mode
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")


def demo_password_file() -> Path:
    """Where set-up keeps the demo user's password (``var/demo_password``, not committed)."""
    return Path(settings.BASE_DIR) / "var" / "demo_password"


def ensure_demo_user(tenant: Tenant) -> tuple[str, str]:
    """Create once a staff user ``demo`` belonging to ``tenant``; return (username, password).

    The user signs in to the chat and the admin (dashboard included). The password is generated
    once and kept in :func:`demo_password_file`; a missing file gets a new password.
    """
    path = demo_password_file()
    user, _ = get_user_model().objects.get_or_create(
        username=DEMO_USERNAME, defaults={"is_staff": True, "is_superuser": True})
    password = path.read_text().strip() if path.is_file() else ""
    if not password or not user.check_password(password):
        password = secrets.token_urlsafe(12)
        user.set_password(password)
        user.save()
        write_private(path, password)
    Membership.objects.update_or_create(user=user, defaults={"tenant": tenant})
    return user.username, password
