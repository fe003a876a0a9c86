"""A LoRA adapter's check, as the Celery task and the ``register_adapter`` command run it: the
checks of :mod:`tenants.adapter_check` against its base model's ``config.json`` (read from the
base model's folder as the registry gives it, else its tokenizer folder) and the settings, and
the adapter's row set ``ready`` or ``refused`` with the reason. Torch-free and numpy-free.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from django.utils import timezone

from gateway import adapters
from gateway.conf import platform_settings
from gateway.model_registry import read_served_models
from tenants.adapter_check import AdapterFacts, check_adapter
from tenants.adapters import root_folder
from tenants.models import LoraAdapter

log = logging.getLogger(__name__)

# The largest base model config.json read (bytes).
MAX_BASE_CONFIG_BYTES = 1 << 20


def base_config(base_model: str) -> dict[str, Any]:
    """The parsed ``config.json`` of the served base model ``base_model``: from its folder,
    else its tokenizer folder (a web-only host keeps the tokenizer's files there).

    Raises:
        ValueError: the base model is not served (unknown or disabled), or neither folder holds
            a ``config.json`` that parses as a JSON object.
    """
    entry = next((m for m in read_served_models() if m.name == base_model), None)
    if entry is None:
        raise ValueError(f"the base model '{base_model}' is not served.")
    for folder in dict.fromkeys((Path(entry.folder), Path(entry.tokenizer_folder))):
        path = folder / "config.json"
        if not path.is_file() or path.stat().st_size > MAX_BASE_CONFIG_BYTES:
            continue
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise ValueError("the base model's config.json is not valid JSON.") from exc
        if isinstance(config, dict):
            return config
    log.warning("no config.json of base model %s in %s or %s", base_model, entry.folder,
                entry.tokenizer_folder)
    raise ValueError("the base model's config.json could not be read on the host that checks "
                     "adapters.")


def check(row: LoraAdapter) -> AdapterFacts:
    """Check the adapter ``row`` against its base model and the settings (``ADAPTER_ROOT``,
    ``MAX_LORA_RANK``, ``MAX_ADAPTER_BYTES``).

    Raises:
        ValueError: it is refused; the message says why.
    """
    conf = platform_settings()
    return check_adapter(row.folder, base_config(row.base_model), root=root_folder(),
                         max_rank=conf["MAX_LORA_RANK"], max_bytes=conf["MAX_ADAPTER_BYTES"])


def validate(adapter_id: int) -> LoraAdapter | None:
    """Check the adapter ``adapter_id`` and record the outcome on its row: ``ready`` with its
    rank, target modules, size and digest, or ``refused`` with the reason. Returns the row as
    recorded; None when it no longer exists, or changed (its folder or base model) while it
    was checked (the change queued another check).

    Raises:
        django.db.DatabaseError: the row could not be read or written.
    """
    row = LoraAdapter.objects.filter(pk=adapter_id).first()
    if row is None:
        return None
    try:
        facts = check(row)
    except (ValueError, OSError) as exc:
        reason = (str(exc) if isinstance(exc, ValueError)
                  else f"its files could not be read ({exc.strerror or exc}).")
        row.state, row.refusal = LoraAdapter.State.REFUSED, reason[:2000]
        row.rank, row.target_modules, row.size_bytes, row.digest = 0, "", 0, ""
    else:
        row.state, row.refusal = LoraAdapter.State.READY, ""
        row.rank, row.target_modules = facts.rank, ",".join(facts.targets)
        row.size_bytes, row.digest = facts.size, facts.digest
    row.validated_at = timezone.now()
    fields = ["state", "refusal", "rank", "target_modules", "size_bytes", "digest",
              "validated_at"]
    updated = LoraAdapter.objects.filter(pk=row.pk, folder=row.folder,
                                         base_model=row.base_model).update(
        **{field: getattr(row, field) for field in fields})
    adapters.forget()
    if not updated:
        return None
    log.info("LoRA adapter %s: %s%s", row.api_name, row.state,
             f" ({row.refusal})" if row.refusal else "")
    return row
