"""The LoRA adapters served, and a request's ``model`` resolved to a base model and an adapter.

A request's ``model`` of the form ``{base}:{adapter}`` (:data:`ADAPTER_SEPARATOR`) names a LoRA
adapter (:class:`tenants.models.LoraAdapter`) over a base model. A sender may call it when it
may call the base model (served, and allowed by its access rules: :mod:`gateway.model_registry`)
and the adapter is ``ready``, enabled, and shared or owned by the sender's tenant. Otherwise
the answer is byte-for-byte the 404 of an unknown model, naming what the client sent
(:func:`gateway.model_registry.model_not_found`): a key cannot probe for another tenant's
adapters.

The adapters served are read from the database at most once every
:data:`~gateway.model_registry.CACHE_TTL_S` per process (at once in the process that saved
one). A request for an adapter goes to its base model's queue (``meta["model"]`` is the base
model's name) and carries the adapter as :class:`~inference.protocol.messages.AdapterRef`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from asgiref.sync import sync_to_async
from django.core.signals import setting_changed
from django.db.models.signals import post_delete, post_save

from gateway.errors import APIError
from gateway.model_registry import (
    CACHE_TTL_S,
    Access,
    ModelEntry,
    allowed,
    find,
    model_not_found,
    read_served_models,
    served_models,
)
from inference.protocol.messages import ADAPTER_SEPARATOR, AdapterRef
from tenants.adapters import inside_root
from tenants.model_access import valid_name
from tenants.models import ApiKey, LoraAdapter, valid_adapter_name

log = logging.getLogger(__name__)

# What ``GET /v1/models`` says owns a shared adapter.
SHARED_OWNER = "system"


@dataclass(frozen=True)
class AdapterEntry:
    """A LoRA adapter served: ``ref`` (what a request carries; ``ref.name`` is its API name,
    ``base:adapter``), its ``base`` model's name, its owner (``owner_id``, the tenant's id, and
    ``owned_by``, its slug; None and ``"system"`` when shared) and ``created`` (unix time)."""

    ref: AdapterRef
    base: str
    owner_id: int | None
    owned_by: str
    created: int = 0

    @property
    def name(self) -> str:
        return self.ref.name

    def visible_to(self, access: Access) -> bool:
        """Whether the sender of ``access`` may see it: it is shared, or its tenant's own."""
        return self.owner_id is None or self.owner_id == access.tenant_id


@dataclass(frozen=True)
class Target:
    """What a request's ``model`` resolved to: the base ``model`` (its queue, its tokenizer)
    and, for ``base:adapter``, the ``entry`` of its adapter."""

    model: ModelEntry
    entry: AdapterEntry | None = None

    @property
    def name(self) -> str:
        """The name the client sent, as the answer repeats it (``base`` or ``base:adapter``)."""
        return self.entry.name if self.entry is not None else self.model.name

    @property
    def adapter(self) -> AdapterRef | None:
        """The adapter a request carries (None: the bare base model)."""
        return self.entry.ref if self.entry is not None else None

    @property
    def created(self) -> int:
        return self.entry.created if self.entry is not None else self.model.created

    @property
    def owned_by(self) -> str | None:
        """Who ``GET /v1/models`` says owns it (None: the base model's default)."""
        return self.entry.owned_by if self.entry is not None else None


def _entry(row: LoraAdapter) -> AdapterEntry | None:
    """The entry of a ready row, or None for one that cannot be served (logged): a name or a
    folder its checks would refuse, written past them."""
    folder = inside_root(row.folder)
    if not (valid_name(row.base_model) and valid_adapter_name(row.name)) or folder is None:
        log.warning("the LoRA adapter %r is not valid or not under ADAPTER_ROOT: not served",
                    row.api_name)
        return None
    try:
        checked = int(row.validated_at.timestamp()) if row.validated_at else 0
        ref = AdapterRef(name=row.api_name, path=str(folder), digest=row.digest, rank=row.rank,
                         revision=f"{row.pk}-{checked}")
    except ValueError as exc:
        log.warning("the LoRA adapter %r has no valid digest or rank: not served (%s)",
                    row.api_name, exc)
        return None
    return AdapterEntry(ref=ref, base=row.base_model, owner_id=row.owner_id,
                        owned_by=row.owner.slug if row.owner is not None else SHARED_OWNER,
                        created=int(row.created_at.timestamp()) if row.created_at else 0)


_lock = threading.Lock()
_cached: tuple[float, list[AdapterEntry]] | None = None
# Counts the calls of forget(): a read that began before one is not kept.
_generation = 0


def forget(**_: Any) -> None:
    """Drop this process's copy of the adapters served: the next call reads them again.

    Connected to the adapters' saves and deletes and to Django's ``setting_changed``.
    """
    global _cached, _generation
    with _lock:
        _cached = None
        _generation += 1


post_save.connect(forget, sender=LoraAdapter, dispatch_uid="gateway.adapters.saved")
post_delete.connect(forget, sender=LoraAdapter, dispatch_uid="gateway.adapters.deleted")
setting_changed.connect(forget, dispatch_uid="gateway.adapters.settings")


def _fresh() -> list[AdapterEntry] | None:
    cached = _cached
    if cached is not None and time.monotonic() - cached[0] < CACHE_TTL_S:
        return cached[1]
    return None


def read_adapters() -> list[AdapterEntry]:
    """The adapters served (ready and enabled), by name. Blocking (one query when this
    process's copy is stale): for synchronous callers; :func:`served_adapters` on an event
    loop.

    Raises:
        django.db.DatabaseError: the adapters could not be read.
    """
    global _cached
    if (adapters := _fresh()) is not None:
        return adapters
    generation = _generation
    rows = (LoraAdapter.objects.filter(state=LoraAdapter.State.READY, enabled=True)
            .select_related("owner").order_by("base_model", "name"))
    adapters = [entry for row in rows if (entry := _entry(row)) is not None]
    with _lock:
        if generation == _generation:
            _cached = (time.monotonic(), adapters)
    return adapters


async def served_adapters() -> list[AdapterEntry]:
    """The adapters served, as :func:`read_adapters` (no query while this process's copy is
    fresh).

    Raises:
        django.db.DatabaseError: the adapters could not be read.
    """
    if (adapters := _fresh()) is not None:
        return adapters
    return await sync_to_async(read_adapters)()


class _HasOwner(Protocol):
    @property
    def owner_id(self) -> int | None: ...


Owned = TypeVar("Owned", bound=_HasOwner)


def own_first(found: Sequence[Owned]) -> Owned:
    """Of adapters (registry rows or entries) of one name visible to one tenant, the one it
    reaches: its own, else the shared one (names are per tenant)."""
    return min(found, key=lambda adapter: adapter.owner_id is None)


def names_adapter(name: str) -> bool:
    """Whether a request's ``model`` names an adapter (``base:adapter``)."""
    return ADAPTER_SEPARATOR in name


def find_target(models: list[ModelEntry], adapters: list[AdapterEntry], access: Access,
                name: str) -> Target:
    """What ``name`` names among ``models`` and ``adapters`` that ``access`` may call: a base
    model (:func:`gateway.model_registry.find`), or ``base:adapter``: the base model that
    ``access`` may call and its adapter, visible to ``access``.

    Raises:
        APIError: 404 :func:`~gateway.model_registry.model_not_found` naming ``name``, the
            same whatever is missing or not allowed.
    """
    if not names_adapter(name):
        return Target(find(models, access, name))
    base = name.partition(ADAPTER_SEPARATOR)[0]
    try:
        model = find(models, access, base)
    except APIError:
        raise model_not_found(name) from None
    # Names are per tenant: the key's tenant's own adapter, else a shared one of that name.
    found = [entry for entry in adapters if entry.name == name and entry.visible_to(access)]
    if not found:
        raise model_not_found(name)
    return Target(model, own_first(found))


def read_target(access: Access, name: str) -> Target:
    """:func:`find_target` over the models and adapters served, blocking (the Celery batch
    step).

    Raises:
        APIError: 404 ``model_not_found`` (see :func:`find_target`).
        django.db.DatabaseError: the registry could not be read.
    """
    adapters = read_adapters() if names_adapter(name) else []
    return find_target(read_served_models(), adapters, access, name)


async def resolve_target(key: ApiKey, name: str) -> Target:
    """What ``name`` (a request's ``model``) names that ``key`` may call: a base model, or a
    base model and its adapter.

    Raises:
        APIError: 404 ``model_not_found`` (param ``model``) for any model or adapter that is
            not served or that the key may not call, byte for byte the same.
        django.db.DatabaseError: the registry could not be read.
    """
    adapters = await served_adapters() if names_adapter(name) else []
    return find_target(await served_models(), adapters, Access.of_key(key), name)


def callable_adapters(models: list[ModelEntry], adapters: list[AdapterEntry],
                      access: Access) -> list[AdapterEntry]:
    """Those of ``adapters`` that ``access`` may call (visible, over a base model of ``models``
    that it may call), by name; of a name both its own and shared, its own."""
    bases = {m.name for m in allowed(models, access)}
    by_name: dict[str, list[AdapterEntry]] = {}
    for entry in adapters:
        if entry.base in bases and entry.visible_to(access):
            by_name.setdefault(entry.name, []).append(entry)
    return [own_first(found) for _, found in sorted(by_name.items())]


async def callable_targets(key: ApiKey) -> list[Target]:
    """Everything ``key`` may call, as ``GET /v1/models`` lists it: the base models (the
    default first, then by name), then the adapters by name.

    Raises:
        django.db.DatabaseError: the registry could not be read.
    """
    access = Access.of_key(key)
    models = await served_models()
    by_name = {m.name: m for m in models}
    adapters = callable_adapters(models, await served_adapters(), access)
    return [*(Target(m) for m in allowed(models, access)),
            *(Target(by_name[a.base], a) for a in adapters)]
