"""Set-up: ``python -m inference.worker.prepare_model`` builds the default model folder once (or
checks ``MODEL_PATH``) and prints the folder a worker will load. Idempotent: a second run only
checks. ``MODEL_PATH`` and ``LLM_CACHE_DIR`` are read as the worker reads them
(:class:`inference.protocol.settings.PlatformSettings`); exit status 1 with the reason on stderr
when the model cannot be prepared.
"""

from __future__ import annotations

import argparse
import sys

from inference.engine.model_store import ModelLoadError, resolve_model_path
from inference.protocol.settings import PlatformSettings


def main(argv: list[str] | None = None) -> int:
    """Prepare (or check) the model folder and print it; returns the exit status.

    Raises:
        SystemExit: after printing the help (status 0), or for any argument (status 2).
    """
    argparse.ArgumentParser(
        prog="python -m inference.worker.prepare_model",
        description="Build the default model folder once (or check MODEL_PATH) and print the "
                    "folder a worker loads.",
        epilog="Reads MODEL_PATH and LLM_CACHE_DIR as the worker does.").parse_args(argv)
    try:
        settings = PlatformSettings()
        print(resolve_model_path(settings.model_path, settings.model_cache_dir))
    except ModelLoadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
