"""One constrained row's grammar: its token mask, the tokens it consumes, the tokens it forces.

The mask of a row's next token depends only on the tokens it has so far, so it can be computed
before the forward pass that gives the row's logits: :func:`prefetch_masks` starts every mask of a
pass on the mask thread (llguidance drops the GIL while it computes) as the pass starts, and
:meth:`RowGrammar.allowed` waits for it when the row is sampled. No torch work runs there: the
mask thread writes a numpy bitmask; the compute thread turns it into the row's allowed tokens.

Errors never raise: a matcher that fails (its grammar exceeds a step limit, a token it cannot
take) or leaves no token allowed gives an :class:`~inference.protocol.events.ErrorInfo` that ends
that row alone.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import numpy as np
import torch

from inference.protocol.events import ErrorCode, ErrorInfo
from inference.protocol.structured import is_library_panic

log = logging.getLogger(__name__)

# A row whose last mask took more CPU seconds than this computes its next one on the compute
# thread, before the pass, instead of beside it (RowGrammar.prefetch).
OVERLAP_MAX_S = 0.001
# The one thread that computes masks ahead of a pass (created on first use).
_mask_pool: ThreadPoolExecutor | None = None
_mask_pool_lock = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    global _mask_pool
    with _mask_pool_lock:
        if _mask_pool is None:
            _mask_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")
        return _mask_pool


@dataclass
class MaskStats:
    """Counters every row of an engine adds to (read for stats).

    ``masks``: token masks computed; ``mask_s``: seconds spent computing them (on the mask thread
    or, without overlap, on the compute thread); ``wait_s``: seconds the compute thread waited
    for a mask computed ahead; ``forced``: tokens appended without sampling (jump-forward);
    ``failed``: rows their grammar ended mid-answer (a limit, a dead end, a failure).
    """

    masks: int = 0
    mask_s: float = 0.0
    wait_s: float = 0.0
    forced: int = 0
    failed: int = 0


class RowGrammar:
    """The grammar state of one constrained row.

    Args:
        matcher: an ``llguidance.LLMatcher`` in its initial state, this row's own.
        vocab_size: the width of the model's logits (tokens the mask covers; ids past the
            tokenizer's vocabulary are never allowed).
        eos_token_ids: the ids that end an answer; all are allowed where the grammar allows its
            end, and each is consumed as the grammar's EOS.
        grammar_eos: the EOS id the matcher's tokenizer knows.
        stats: the engine's counters.
        grammar_vocab: the matcher's tokenizer's vocabulary (its bitmask's bits; default
            ``vocab_size``).
        param: the request field that asked for the grammar (its errors name it).
        max_step_s: CPU seconds the grammar may take for one token (consuming the last, the
            forced tokens after it, the next mask: ``STRUCTURED_MAX_STEP_MS``); more ends the row,
            so one costly grammar cannot slow every row of the batch for long.
    """

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int,
                 eos_token_ids: Collection[int], grammar_eos: int, stats: MaskStats,
                 param: str = "response_format", max_step_s: float = float("inf"),
                 grammar_vocab: int | None = None):
        self.matcher = matcher
        self.param = param
        self.max_step_s = max_step_s
        self._step_s = 0.0  # CPU seconds of this token's grammar work so far
        self._last_fill_s = 0.0  # CPU seconds of the last mask
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(sorted(eos_token_ids))
        self.grammar_eos = grammar_eos
        self.stats = stats
        self._words = ((grammar_vocab or vocab_size) + 31) // 32  # the matcher's bitmask
        self._mask = np.zeros(self._words, dtype=np.int32)
        self._ready = False
        self._future: Future[None] | None = None

    def fork(self) -> RowGrammar:
        """This grammar state for another row (a choice forked from the same prompt): its own
        copy of the matcher (``deep_copy``) and of the next token's mask, the same limits."""
        if self._future is not None:  # the mask being computed for this state: done first
            future, self._future = self._future, None
            future.result()
            self._ready = True
        clone = copy.copy(self)
        clone.matcher = self.matcher.deep_copy()
        clone._mask = self._mask.copy()
        return clone

    # -- the mask ------------------------------------------------------------------------------

    def _fill(self) -> None:
        """Compute the mask of the next token into ``_mask`` (any thread; drops the GIL)."""
        started, cpu = time.perf_counter(), time.thread_time()
        self._mask.fill(0)
        self.matcher.unsafe_compute_mask_ptr(self._mask.ctypes.data, self._mask.nbytes)
        self._last_fill_s = time.thread_time() - cpu
        self._step_s += self._last_fill_s
        self.stats.masks += 1
        self.stats.mask_s += time.perf_counter() - started

    def prefetch(self) -> None:
        """Start computing the next token's mask on the mask thread (nothing if it is known).

        Not for a row whose last mask took over :data:`OVERLAP_MAX_S`: on a machine whose cores
        the forward pass keeps busy, a costly mask beside it slows the whole pass (its threads
        wait for the core the mask holds) more than computing it before the pass does.
        """
        if not self._ready and self._future is None and self._last_fill_s <= OVERLAP_MAX_S:
            self._future = _pool().submit(self._fill)

    def allowed(self) -> torch.Tensor | ErrorInfo:
        """``[vocab_size]`` bool: the tokens the grammar allows next; or the row's error.

        Waits for a mask started by :meth:`prefetch`, or computes it here.
        """
        try:
            if self._future is not None:
                started = time.perf_counter()
                future, self._future = self._future, None
                future.result()
                self.stats.wait_s += time.perf_counter() - started
            elif not self._ready:
                self._fill()
        except BaseException as exc:  # the library failed (or panicked): this row alone ends
            if not isinstance(exc, Exception) and not is_library_panic(exc):
                raise
            log.exception("computing a token mask failed")
            return self._error(ErrorCode.ENGINE_ERROR, "mask_failed",
                               f"computing the grammar's token mask failed: {exc}")
        self._ready = True
        if self.matcher.is_error():
            return self.failure()
        spent, self._step_s = self._step_s, 0.0  # the next step starts with the next token
        if spent > self.max_step_s:
            return self._error(ErrorCode.INVALID_REQUEST, "grammar_too_slow", (
                f"'{self.param}' took {spent * 1000:.0f} ms of CPU for one token, over this "
                f"server's limit of {self.max_step_s * 1000:.0f} ms"))
        bits = np.unpackbits(self._mask.view(np.uint8), bitorder="little")[:self.vocab_size]
        if bits.shape[0] < self.vocab_size:  # logits past the tokenizer's ids: never allowed
            bits = np.pad(bits, (0, self.vocab_size - bits.shape[0]))
        allowed = torch.from_numpy(bits.astype(np.bool_))
        if self.grammar_eos < self.vocab_size and allowed[self.grammar_eos]:
            allowed[[i for i in self.eos_token_ids if i < self.vocab_size]] = True
        if not bool(allowed.any()):
            return self._error(ErrorCode.INVALID_REQUEST, "grammar_dead_end",
                               f"'{self.param}' allows no next token (a dead end)")
        return allowed

    # -- tokens --------------------------------------------------------------------------------

    def consume(self, token: int) -> ErrorInfo | None:
        """Advance the grammar by ``token`` (an EOS id as the grammar's EOS); its error if the
        grammar does not take it."""
        self._ready = False
        if self._future is not None:  # a mask computed ahead for the state before this token
            self._future.result()
            self._future = None
        grammar_token = self.grammar_eos if token in self.eos_token_ids else token
        cpu = time.thread_time()
        try:
            if self.matcher.consume_token(grammar_token):
                self._step_s += time.thread_time() - cpu
                return None
        except BaseException as exc:
            if not isinstance(exc, Exception) and not is_library_panic(exc):
                raise
            log.exception("the grammar failed on token %d", token)
            return self._error(ErrorCode.ENGINE_ERROR, "grammar_failed",
                               f"'{self.param}' failed on a token", token_id=token)
        return self.failure(token)

    def forced_tokens(self, limit: int) -> list[int]:
        """At most ``limit`` tokens the grammar allows as its only continuation now (not yet
        consumed: each goes through :meth:`consume` as it is appended). Never an EOS."""
        if limit <= 0 or self.matcher.is_stopped():
            return []
        cpu = time.thread_time()
        try:
            forced = self.matcher.compute_ff_tokens()[:limit]
            self._step_s += time.thread_time() - cpu
        except BaseException as exc:  # none forced: the next mask step meets the failure
            if not isinstance(exc, Exception) and not is_library_panic(exc):
                raise
            log.exception("computing the forced tokens failed")
            return []
        return [t for t in forced if t not in self.eos_token_ids and t != self.grammar_eos]

    def complete(self) -> bool:
        """Whether the grammar is matched and allows nothing more but its end."""
        return self.matcher.is_stopped() and not self.matcher.is_error()

    def failure(self, token: int | None = None) -> ErrorInfo:
        """The row's error once its matcher failed (a limit of the library's, most often)."""
        message = library_message(self.matcher.get_error()) or "it did not accept the token"
        details = {"token_id": token} if token is not None else {}
        return self._error(ErrorCode.INVALID_REQUEST, "grammar_error",
                           f"'{self.param}' could not go on within this server's limits: "
                           f"{message}", **details)

    def _error(self, code: ErrorCode, reason: str, message: str, **details: object) -> ErrorInfo:
        self.stats.failed += 1
        return ErrorInfo(code=code, message=f"{message}; only this request was ended",
                         retryable=False,
                         details={"phase": "structured_output", "reason": reason,
                                  "param": self.param, **details})


def library_message(error: str) -> str:
    """llguidance's error text without its markup (``<non-verbose/>``) and trailing blanks."""
    return error.replace("<non-verbose/>", "").strip().rstrip(";").strip()


def prefetch_masks(grammars: Sequence[RowGrammar | None]) -> None:
    """Start the next-token mask of each grammar given (None: an unconstrained row)."""
    for grammar in grammars:
        if grammar is not None:
            grammar.prefetch()
