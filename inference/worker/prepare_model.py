"""Set-up: ``python -m inference.worker.prepare_model`` builds the default model folder once (or
checks ``MODEL_PATH``) and prints the folder a worker will load. Idempotent: a second run only
checks. ``MODEL_PATH`` and ``LLM_CACHE_DIR`` are read as the worker reads them
(:class:`inference.protocol.settings.PlatformSettings`); exit status 1 with the reason on stderr
when the model cannot be prepared.
"""

from __future__ import annotations

import sys

from inference.engine.model_store import ModelLoadError, resolve_model_path
from inference.protocol.settings import PlatformSettings


def main() -> int:
    try:
        settings = PlatformSettings()
        print(resolve_model_path(settings.model_path, settings.model_cache_dir))
    except ModelLoadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
