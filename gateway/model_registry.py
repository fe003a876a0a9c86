"""The base models served, and which of them a sender may call.

The models served are the enabled entries of the registry (:class:`tenants.models.ServedModel`)
and the deployment's default model (``SERVED_MODEL_NAME``, its folder ``MODEL_PATH`` or the
prepared default model, its tokenizer :func:`gateway.tokenizer_folders.tokenizer_folder`),
unless the registry holds an entry of the default's name: then that entry rules (disabled, the
default model is not served). They are read from the database at most once every
:data:`CACHE_TTL_S` per process (a change in the admin shows within that time; at once in the
process that saved it).

A sender calls a model only when its tenant's ``allowed_models`` and its key's both allow it
(:mod:`tenants.model_access`). A model it may not call and a model that is not served get
byte-for-byte the same 404 (:func:`model_not_found`): a key cannot probe for the names served
to others, and no answer lists them.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asgiref.sync import sync_to_async
from django.core.signals import setting_changed
from django.db.models.signals import post_delete, post_save

from gateway.conf import platform_settings
from gateway.errors import APIError
from gateway.tokenizer_folders import tokenizer_folder
from inference.protocol.models import model_folder
from tenants.model_access import parse_rules, permitted, valid_name
from tenants.models import ApiKey, ServedModel, Tenant

log = logging.getLogger(__name__)

# How long a process keeps the models served before it reads them again (seconds).
CACHE_TTL_S = 2.0
# Longest model name repeated back in a 404 (a longer one is cut).
MAX_ECHOED_NAME = 64


@dataclass(frozen=True)
class ModelEntry:
    """A base model served: its ``name`` in the API, the ``folder`` its workers load, the
    ``tokenizer_folder`` the web tier counts its prompts with, and whether it is the
    deployment's default model (``SERVED_MODEL_NAME``). ``created``: its registration's unix
    time (0 for the implicit default)."""

    name: str
    folder: Path
    tokenizer_folder: Path
    is_default: bool
    created: int = 0


@dataclass(frozen=True)
class Access:
    """What a sender may call: its tenant's and its key's ``allowed_models`` rule lists (as
    stored; a chat user has no key: ``key_rules`` blank), and its tenant's id (``tenant_id``:
    the LoRA adapters it owns, :mod:`gateway.adapters`; None: only shared ones)."""

    tenant_rules: str
    key_rules: str = ""
    tenant_id: int | None = None

    @classmethod
    def of_key(cls, key: ApiKey) -> Access:
        """The access of ``key`` (its tenant loaded with it, as
        :func:`gateway.credentials.authenticate_headers` returns it)."""
        return cls(key.tenant.allowed_models, key.allowed_models, key.tenant_id)

    @classmethod
    def of_tenant(cls, tenant: Tenant) -> Access:
        return cls(tenant.allowed_models, tenant_id=tenant.pk)

    def permits(self, name: str) -> bool:
        """Whether both rule lists allow ``name``; a rule list stored unvalidated that does not
        parse allows nothing (logged)."""
        try:
            return permitted(parse_rules(self.tenant_rules), parse_rules(self.key_rules), name)
        except ValueError as exc:
            log.warning("an allowed_models rule list does not parse, it allows nothing: %s", exc)
            return False


def default_entry() -> ModelEntry:
    """The deployment's default model as configured (whatever the registry says of it)."""
    conf = platform_settings()
    return ModelEntry(name=conf["SERVED_MODEL_NAME"],
                      folder=model_folder(conf["MODEL_PATH"], conf["LLM_CACHE_DIR"]),
                      tokenizer_folder=tokenizer_folder(), is_default=True)


def _entry(row: ServedModel, default_name: str) -> ModelEntry:
    folder = Path(row.model_path.strip()).expanduser()
    tokenizer = row.tokenizer_path.strip()
    return ModelEntry(name=row.name, folder=folder,
                      tokenizer_folder=Path(tokenizer).expanduser() if tokenizer else folder,
                      is_default=row.name == default_name,
                      created=int(row.created_at.timestamp()) if row.created_at else 0)


_lock = threading.Lock()
_cached: tuple[float, list[ModelEntry]] | None = None
# Counts the calls of forget(): a read that began before one is not kept.
_generation = 0


def forget(**_: Any) -> None:
    """Drop this process's copy of the models served: the next call reads them again.

    Connected to the registry's saves and deletes and to Django's ``setting_changed``.
    """
    global _cached, _generation
    with _lock:
        _cached = None
        _generation += 1


post_save.connect(forget, sender=ServedModel, dispatch_uid="gateway.model_registry.saved")
post_delete.connect(forget, sender=ServedModel, dispatch_uid="gateway.model_registry.deleted")
setting_changed.connect(forget, dispatch_uid="gateway.model_registry.settings")


def _fresh() -> list[ModelEntry] | None:
    cached = _cached
    if cached is not None and time.monotonic() - cached[0] < CACHE_TTL_S:
        return list(cached[1])
    return None


def read_served_models() -> list[ModelEntry]:
    """The models served (module docstring): the default model first when it is served, then
    the others by name. Blocking (one query when this process's copy is stale): for synchronous
    callers (the Celery batch step); :func:`served_models` on an event loop.

    Raises:
        django.db.DatabaseError: the registry could not be read.
    """
    global _cached
    if (models := _fresh()) is not None:
        return models
    generation = _generation
    default = default_entry()
    rows = {row.name: row for row in ServedModel.objects.order_by("name")}
    for name in [name for name in rows if not valid_name(name)]:
        # Written past ServedModel.save (raw SQL, an older release): not served.
        log.warning("the registry's model %r is not a valid model name: not served", name)
        del rows[name]
    models = [_entry(row, default.name) for row in rows.values() if row.enabled]
    if default.name not in rows:
        models.append(default)
    models.sort(key=lambda m: (not m.is_default, m.name))
    with _lock:
        if generation == _generation:
            _cached = (time.monotonic(), models)
    return list(models)


async def served_models() -> list[ModelEntry]:
    """The models served, as :func:`read_served_models` (from this process's copy while it is
    fresh: no query).

    Raises:
        django.db.DatabaseError: the registry could not be read.
    """
    if (models := _fresh()) is not None:
        return models
    return await sync_to_async(read_served_models)()


def allowed(models: list[ModelEntry], access: Access) -> list[ModelEntry]:
    """Those of ``models`` that ``access`` permits, in their order."""
    return [m for m in models if access.permits(m.name)]


def model_not_found(name: str) -> APIError:
    """The 404 for a model that is not served or that the sender may not call: the same for
    both, naming only what the client sent (cut at :data:`MAX_ECHOED_NAME` characters)."""
    shown = name if len(name) <= MAX_ECHOED_NAME else name[:MAX_ECHOED_NAME] + "..."
    return APIError(404, f"The model '{shown}' does not exist or you do not have access to it.",
                    param="model", code="model_not_found")


def find(models: list[ModelEntry], access: Access, name: str) -> ModelEntry:
    """The model of ``models`` named ``name`` (exactly) that ``access`` permits.

    Raises:
        APIError: 404 :func:`model_not_found` when there is none.
    """
    for model in models:
        if model.name == name:
            if access.permits(name):
                return model
            break
    raise model_not_found(name)


async def callable_models(key: ApiKey) -> list[ModelEntry]:
    """The models served that ``key`` may call (default first, then by name).

    Raises:
        django.db.DatabaseError: the registry could not be read.
    """
    return allowed(await served_models(), Access.of_key(key))


async def resolve_model(key: ApiKey, name: str) -> ModelEntry:
    """The model served named ``name`` that ``key`` may call.

    Raises:
        APIError: 404 ``model_not_found`` (param ``model``) for a model not served (unknown or
            disabled) and for one the key may not call alike (:func:`model_not_found`).
        django.db.DatabaseError: the registry could not be read.
    """
    return find(await served_models(), Access.of_key(key), name)
