"""Prompt token counts in the web tier, for rate limits, budgets and the context (never torch).

The count is the worker's own: the same tokenizer and chat template (:mod:`inference.tokenization`,
which the worker builds its prompts with), read from the tokenizer folder of the request's model
(:attr:`gateway.model_registry.ModelEntry.tokenizer_folder`; the default model's is
``TOKENIZER_PATH``, else ``MODEL_PATH``, else the prepared default model's folder). Each
function takes that ``folder``; one given none counts with the folder of
:func:`gateway.tokenizer_folders.use_tokenizer` around the call, else the default model's.
Without a ``tokenizer.json`` there (a web-only install given no tokenizer), counts are an
estimate from the text's length, which can be short of the worker's (it cannot know the
template's additions). The worker stays the authority: reservations are settled to its real
usage, and the web tier refuses only prompts every worker would refuse.

**Where counting runs.** Tokenizing is CPU-bound and the ``tokenizers`` encoder holds the GIL for
the whole call (about 0.4 s for 1 MB of text), so neither the event loop nor a thread of the web
process may do it: every count runs in a pool of :data:`POOL_PROCESSES` counting processes
(:class:`~concurrent.futures.ProcessPoolExecutor`), started with ``spawn`` (a fresh interpreter
that inherits none of the threaded server's sockets or locks, alike on every OS), each loading
the default model's tokenizer when it starts (about 0.5 s), another model's at its first call
for it (every call names its folder), and keeping each. They start with the first request the
web process serves, whatever its path (Django's ``request_started``: a readiness probe is
enough), or :func:`start_pool`. A counting process that dies (killed, out of memory) breaks the
pool: it is replaced by a fresh one and the count retried once; a second failure is a retryable
503. The async functions (:func:`count_chat_tokens`, :func:`count_text_tokens`, :func:`run`) are
the interface; the ``*_here`` functions count in the calling process, for the counting
processes.

**Byte bounds.** A byte-level BPE token covers at least one byte of the prompt and at most the
longest token of the vocabulary (:class:`ByteBounds`, derived from ``tokenizer.json``), so a
prompt of ``b`` bytes has between ``ceil(b / longest)`` and ``b`` tokens (bytes the vocabulary
cannot hold count for none: :mod:`gateway.byte_bounds`). A prompt whose lower
bound is already over the most it may have is not tokenized at all: a 2.4 MB prompt against a
context of 8,192 tokens costs a byte count, not 2.7 s of tokenizing.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import multiprocessing
import os
import sys
import threading
import time
import types
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from django.core.signals import request_started

from gateway.byte_bounds import ByteBounds, byte_bounds
from gateway.conf import platform_settings
from gateway.tokenizer_folders import Folder, counting_folder, tokenizer_folder
from inference.tokenization import Tokenizer, TokenizerLoadError

log = logging.getLogger(__name__)

T = TypeVar("T")

# Byte-level BPE tokenizers average about 4 bytes per token on English text; 3 over-counts.
ESTIMATE_BYTES_PER_TOKEN = 3
# Without the chat template: role markers around each message, a generation prompt at the end.
ESTIMATE_TOKENS_PER_MESSAGE = 5
ESTIMATE_TOKENS_PER_PROMPT = 3
# Counting processes per web process (``LLM_PLATFORM["TOKENIZER_PROCESSES"]`` overrides it).
POOL_PROCESSES = 2


def utf8_length(text: str) -> int:
    """Bytes of ``text`` in UTF-8 (a lone surrogate counts as its 3 bytes)."""
    return len(text.encode("utf-8", "surrogatepass"))


@dataclass(frozen=True)
class _Local:
    tokenizer: Tokenizer | None
    bounds: ByteBounds | None


@functools.cache
def _load(folder: str) -> _Local:
    try:
        tok = Tokenizer.from_folder(folder)
    except TokenizerLoadError as exc:
        log.warning("counting tokens by estimate: %s", exc)
        return _Local(None, None)
    try:
        spec = json.loads((Path(folder) / "tokenizer.json").read_text(encoding="utf-8"))
        bounds = byte_bounds(spec) if isinstance(spec, dict) else None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("no byte bounds for the tokenizer of %s: %s", folder, exc)
        bounds = None
    return _Local(tok, bounds)


# In a counting process, the folder of the call it runs (set for each call by :func:`run`);
# None elsewhere.
_process_folder: str | None = None


def _local(folder: Folder | None = None) -> _Local:
    if folder is None and _process_folder is not None:
        return _load(_process_folder)
    return _load(counting_folder(folder))


def tokenizer(folder: Folder | None = None) -> Tokenizer | None:
    """The tokenizer of ``folder`` (see :func:`counting_folder`; in a counting process, its
    call's) in this process, loaded once; None when the folder has none."""
    return _local(folder).tokenizer


def local_bounds(folder: Folder | None = None) -> ByteBounds | None:
    """The byte bounds of the tokenizer of ``folder`` (as :func:`tokenizer`), or None (see
    :func:`byte_bounds`)."""
    return _local(folder).bounds


def prompt_text(messages: Sequence[dict[str, Any]] | None, prompt: str | None,
                tools: Sequence[dict[str, Any]] | None = None, *,
                folder: Folder | None = None) -> str | None:
    """The text the worker tokenizes: the rendered chat (offering ``tools``), or the prompt;
    None without the tokenizer of ``folder`` (as :func:`tokenizer`), or, for a chat, without
    its chat template.

    Raises:
        ValueError: the chat template refuses the messages.
    """
    tok = tokenizer(folder)
    if tok is None or (messages is not None and not tok.chat_template):
        return None
    return tok.render_chat(messages, tools) if messages is not None else prompt or ""


def _estimate(messages: Sequence[dict[str, str]] | None, prompt: str | None) -> int:
    if messages is None:
        return math.ceil(utf8_length(prompt or "") / ESTIMATE_BYTES_PER_TOKEN)
    content = sum(math.ceil(utf8_length(m["content"]) / ESTIMATE_BYTES_PER_TOKEN)
                  for m in messages)
    return content + ESTIMATE_TOKENS_PER_MESSAGE * len(messages) + ESTIMATE_TOKENS_PER_PROMPT


def bounds_here(messages: Sequence[dict[str, str]] | None,
                prompt: str | None = None, *,
                folder: Folder | None = None) -> tuple[int, int] | None:
    """``(fewest, most)`` tokens of a chat or completion prompt from its bytes, or None.

    None when the tokenizer of ``folder`` (as :func:`tokenizer`) has no byte bounds (or no chat
    template). Cheap: the chat is rendered, not tokenized.

    Raises:
        ValueError: the chat template refuses the messages.
    """
    bounds = local_bounds(folder)
    text = prompt_text(messages, prompt, folder=folder) if bounds is not None else None
    if bounds is None or text is None:
        return None
    data = text.encode("utf-8", "surrogatepass")
    return bounds.at_least(bounds.countable_bytes(data)), bounds.at_most(len(data))


@dataclass(frozen=True)
class PromptCount:
    """A prompt's token count.

    Attributes:
        tokens: the exact count when ``exact``; else the fewest tokens the prompt's bytes allow,
            which is over the ``most`` the count was asked with (the prompt was not tokenized).
        exact: whether the prompt was tokenized.
        prompt_bytes: UTF-8 bytes of the text the worker would tokenize (the rendered chat).
        pid: the process that counted (diagnostics).
        estimated: counted without the model's tokenizer (or chat template): a guess.
    """

    tokens: int
    exact: bool
    prompt_bytes: int
    pid: int
    estimated: bool = False


def measure_here(messages: Sequence[dict[str, Any]] | None, prompt: str | None,
                 most: int | None = None,
                 tools: Sequence[dict[str, Any]] | None = None, *,
                 folder: Folder | None = None) -> PromptCount:
    """The token count of a chat (``messages``) or completion (``prompt``), in this process,
    with the tokenizer of ``folder`` (the model's tokenizer folder; None: as :func:`tokenizer`).

    A chat is rendered with the model's chat template and its additions count too (a default
    system prompt, role markers, the generation prompt), and special-token text inside a content
    counts as the ordinary text it is tokenized as (:meth:`Tokenizer.chat_ids`); a completion
    prompt gets no special tokens added (its own special-token text stays control tokens, as the
    worker tokenizes it). Blocking (the tokenizer holds the GIL): for the counting processes,
    never on an event loop.

    Args:
        most: tokens the prompt may have at most (None: no limit). A prompt whose byte bound
            alone shows more is not tokenized: its count is that bound, not exact.
        tools: the function tools a chat offers (rendered into its prompt), or None.

    Raises:
        ValueError: the chat template refuses the messages (or changes a content holding
            special-token text).
    """
    text = prompt_text(messages, prompt, tools, folder=folder)
    if text is None:  # no tokenizer, or no template: an estimate
        size = (utf8_length(prompt or "") + sum(utf8_length(m["content"]) for m in messages or ())
                + (utf8_length(json.dumps(list(tools))) if tools else 0))
        guess = _estimate(messages, prompt) + (math.ceil(
            utf8_length(json.dumps(list(tools))) / ESTIMATE_BYTES_PER_TOKEN) if tools else 0)
        return PromptCount(guess, True, size, os.getpid(), estimated=True)
    data = text.encode("utf-8", "surrogatepass")
    n_bytes = len(data)
    bounds = local_bounds(folder)
    if bounds is not None and most is not None and (
            fewest := bounds.at_least(bounds.countable_bytes(data))) > most:
        return PromptCount(fewest, False, n_bytes, os.getpid())
    tok = tokenizer(folder)
    ids = tok.encode(text) if messages is None else tok.chat_ids(text, messages, tools)
    return PromptCount(len(ids), True, n_bytes, os.getpid())


def _start_process(folder: str) -> None:
    """Initializer of a counting process: load the tokenizer of ``folder`` (the default
    model's) now; exit with the web process (a ``kill -9`` of it leaves no orphan)."""
    threading.Thread(target=_exit_with, args=(os.getppid(),), daemon=True).start()
    _load(folder)


def _call(folder: str, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a counting process, its ``*_here`` functions counting with the
    tokenizer of ``folder``."""
    global _process_folder
    _process_folder = folder
    try:
        return fn(*args)
    finally:
        _process_folder = None


def _exit_with(parent: int) -> None:  # a counting process's watch on its web process
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def _ready() -> int:
    return os.getpid()


_lock = threading.Lock()
_pool: ProcessPoolExecutor | None = None


def pool_processes() -> int:
    """Counting processes per web process: ``TOKENIZER_PROCESSES``, else :data:`POOL_PROCESSES`."""
    return max(1, int(platform_settings().get("TOKENIZER_PROCESSES") or POOL_PROCESSES))


def _executor() -> ProcessPoolExecutor:
    """The pool of counting processes, started (all of them) if need be."""
    global _pool
    with _lock:
        if _pool is not None:
            return _pool
        size = pool_processes()
        _pool = ProcessPoolExecutor(max_workers=size,
                                    mp_context=multiprocessing.get_context("spawn"),
                                    initializer=_start_process,
                                    initargs=(str(tokenizer_folder()),))
        # Start them all now, not one per call as calls arrive. A spawned process runs the
        # parent's main script again unless told otherwise (daphne's: 0.6 s of imports, and a
        # script without a ``__main__`` guard would start a pool itself): it needs none of it.
        main = sys.modules["__main__"]
        sys.modules["__main__"] = types.ModuleType("__main__")
        try:
            for _ in range(size):
                _pool.submit(_ready)
        finally:
            sys.modules["__main__"] = main
        return _pool


def start_pool(**_: Any) -> None:
    """Start the counting processes if they are not running (returns at once, never waits).

    Connected to Django's ``request_started`` until the first request; a web process may also
    call it when it starts.
    """
    request_started.disconnect(dispatch_uid="gateway.tokens.start_pool")
    _executor()


request_started.connect(start_pool, dispatch_uid="gateway.tokens.start_pool")


def _discard(pool: ProcessPoolExecutor) -> None:
    global _pool
    with _lock:
        if _pool is pool:
            _pool = None
    pool.shutdown(wait=False, cancel_futures=True)


async def run(fn: Callable[..., T], *args: Any, folder: Folder | None = None) -> T:
    """``fn(*args)`` in a counting process; its result, or its exception, here.

    ``fn`` and its arguments must be picklable (a module-level function); it may use this
    module's ``*_here`` functions, which count there with the tokenizer of ``folder`` (a
    model's tokenizer folder; None: :func:`counting_folder`'s).

    Raises:
        APIError: 503 ``service_unavailable`` when a counting process died twice (the pool
            is replaced each time).
        Exception: whatever ``fn`` raised.
    """
    folder = counting_folder(folder)
    for attempt in (1, 2):
        pool = _executor()
        try:
            return await asyncio.wrap_future(pool.submit(_call, folder, fn, *args))
        except BrokenProcessPool as exc:
            _discard(pool)
            log.warning("a token-counting process died (attempt %d): %s", attempt, exc)
    # Imported here: each counting process imports this module, and gateway.errors would load
    # django.http, pydantic and redis into it (about 0.5 s of its start) for nothing.
    from gateway.errors import APIError

    raise APIError(503, "The server could not count the prompt's tokens; retry shortly.",
                   code="service_unavailable", retry_after_s=1)


async def warm_up() -> list[int]:
    """Start the counting processes and load their tokenizer now; the ids of those answering."""
    pool_size = pool_processes()
    return sorted(set(await asyncio.gather(*(run(_ready) for _ in range(pool_size)))))


async def count_chat_tokens(messages: Sequence[dict[str, Any]], *, most: int | None = None,
                            tools: Sequence[dict[str, Any]] | None = None,
                            folder: Folder | None = None) -> PromptCount:
    """Tokens of a chat prompt as the worker counts it (template included), off the event loop.

    Args:
        most: tokens the prompt may have at most; a prompt whose bytes alone show more is not
            tokenized (see :func:`measure_here`).
        tools: the function tools the chat offers, or None.
        folder: the tokenizer folder of the request's model (None: :func:`counting_folder`).

    Raises:
        ValueError: the chat template refuses the messages.
        APIError: 503 ``service_unavailable`` when the counting processes keep dying.
    """
    return await run(measure_here, [dict(m) for m in messages], None, most,
                     list(tools) if tools else None, folder=folder)


async def count_text_tokens(text: str, *, most: int | None = None,
                            folder: Folder | None = None) -> PromptCount:
    """Tokens of a completion prompt as the worker counts it, off the event loop, with the
    tokenizer of ``folder`` (None: :func:`counting_folder`).

    Raises:
        APIError: 503 ``service_unavailable`` when the counting processes keep dying.
    """
    return await run(measure_here, None, text, most, folder=folder)
