"""Which folder's tokenizer counts a request's prompt in the web tier (:mod:`gateway.tokens`).

Each base model has its tokenizer folder
(:attr:`gateway.model_registry.ModelEntry.tokenizer_folder`); the default model's is
:func:`tokenizer_folder`. A count names its model's folder, or runs
within :func:`use_tokenizer` (a request's task, around a call that counts without naming one);
else it uses the default model's.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from pathlib import Path

from gateway.conf import platform_settings
from inference.protocol.models import model_folder

Folder = Path | str


def tokenizer_folder() -> Path:
    """The folder whose tokenizer counts the default model's prompt tokens: ``TOKENIZER_PATH``,
    else ``MODEL_PATH``, else the prepared default model's folder."""
    conf = platform_settings()
    if configured := (conf.get("TOKENIZER_PATH") or "").strip():
        return Path(configured).expanduser()
    return model_folder(conf["MODEL_PATH"], conf["LLM_CACHE_DIR"])


# The folder of the model whose request is being handled (use_tokenizer), for counts that
# name none; None: the default model's.
_context_folder: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "gateway.tokens.folder", default=None)


@contextlib.contextmanager
def use_tokenizer(folder: Folder) -> Iterator[None]:
    """Within the block (in this task and those it starts), counts that name no folder use the
    tokenizer of ``folder``: a request's model's, around a call that counts its prompt without
    naming it (:func:`gateway.lifecycle.start`)."""
    token = _context_folder.set(str(folder))
    try:
        yield
    finally:
        _context_folder.reset(token)


def counting_folder(folder: Folder | None = None) -> str:
    """The folder a count uses: ``folder``, else that of :func:`use_tokenizer` around the call,
    else :func:`tokenizer_folder`."""
    if folder is not None and str(folder):
        return str(folder)
    return _context_folder.get() or str(tokenizer_folder())
