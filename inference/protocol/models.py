"""Where a model lives: the folder conventions that the web tier (its tokenizer) and the workers
(the weights) share. Pure functions of their arguments: no environment is read here.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
# The default model's folder under the model cache (prepared by ``inference.engine.model_store``).
DEFAULT_MODEL_DIRNAME = "SmolLM2-135M-Instruct"


def model_cache_dir(llm_cache_dir: str = "") -> Path:
    """The folder holding prepared models: ``llm_cache_dir``, else ``<repo>/.cache/models``."""
    if llm_cache_dir.strip():
        return Path(llm_cache_dir.strip()).expanduser()
    return REPO_ROOT / ".cache" / "models"


def model_folder(model_path: str = "", llm_cache_dir: str = "") -> Path:
    """The model's folder: ``model_path``, else the default model's under the model cache."""
    if model_path.strip():
        return Path(model_path.strip()).expanduser()
    return model_cache_dir(llm_cache_dir) / DEFAULT_MODEL_DIRNAME




def adapter_root(root: str = "") -> Path:
    """The folder LoRA adapters live under: ``root`` (``ADAPTER_ROOT``), else
    ``<repo>/.cache/adapters``; resolved, symlinks followed (not created)."""
    if root.strip():
        return Path(root.strip()).expanduser().resolve()
    return (REPO_ROOT / ".cache" / "adapters").resolve()


def under_adapter_root(path: str | Path, root: Path) -> Path | None:
    """``path`` resolved (symlinks followed) when it lies strictly inside ``root`` (itself
    resolved), else None: a LoRA adapter's folder must (``ADAPTER_ROOT``)."""
    resolved = Path(path).expanduser().resolve()
    return resolved if resolved != root and resolved.is_relative_to(root) else None


def adapter_key(name: str, revision: str, digest: str) -> str:
    """What identifies one adapter as registered (hex SHA-256 of its name, its registry revision
    and its weights' digest): a worker's adapter pool, its prefix cache and the queue's affinity
    key adapters by it, so two adapters sharing a weights file (their configs may differ), or an
    adapter uploaded again under its name, are never taken for one another."""
    return hashlib.sha256(f"{name}\0{revision}\0{digest}".encode()).hexdigest()
