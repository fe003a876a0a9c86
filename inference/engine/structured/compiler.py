"""Compiling a request's grammar off the compute thread, with a bounded cache and per-tenant caps.

:meth:`GrammarCompiler.start` gives a constrained request its :class:`RowGrammar`: from the cache
of compiled grammars at once (a copy of the cached matcher, keyed by the spec's canonical form),
else compiled on one of ``STRUCTURED_COMPILE_THREADS`` threads of its own. llguidance's matcher
construction drops the GIL, and its limits bound it for real: ``STRUCTURED_COMPILE_FUEL`` (the
lexer fuel of building the grammar's regexes, ``initial_lexer_fuel``), the library's default grammar
size limit, and ``STRUCTURED_STEP_FUEL`` for every later mask step (``step_lexer_fuel``): a grammar
over them fails with an error, it never runs on. A tenant may have
``STRUCTURED_COMPILES_PER_TENANT`` compiles in flight on this engine; one more is refused at once
(``grammar_busy``, 429), so one tenant's hostile schemas cannot take every compile thread.

The cache holds compiled matchers in LRU order up to ``STRUCTURED_CACHE_BYTES``. A matcher's memory
is not exposed by the library: an entry is counted as its grammar text plus a fixed
:data:`ENTRY_OVERHEAD_BYTES` (measured in ``docs/engine.md``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import llguidance
import numpy as np

from inference.engine.config import EngineConfig
from inference.engine.request import Request
from inference.engine.structured.row_grammar import MaskStats, RowGrammar, library_message
from inference.protocol.events import ErrorCode, ErrorInfo
from inference.protocol.structured import (
    StructuredOutput,
    StructuredOutputError,
    check,
    is_library_panic,
)
from inference.tokenization import Tokenizer

log = logging.getLogger(__name__)

# Words of llguidance's errors that say a limit was met (the refusal's reason is then "limit").
LIMIT_WORDS = ("limit", "fuel", "max", "too many", "too big", "too large")
# What a cached matcher is counted as besides its grammar text (bytes).
ENTRY_OVERHEAD_BYTES = 256 * 1024


@dataclass
class _Entry:
    matcher: llguidance.LLMatcher
    nbytes: int


class GrammarCompiler:
    """Compiles and caches the grammars of one engine's constrained requests.

    Args:
        tokenizer: the model's tokenizer (its ``tokenizers`` JSON builds llguidance's).
        vocab_size: the width of the model's logits.
        config: the ``STRUCTURED_*`` settings.

    The llguidance tokenizer is built once (about 0.6 s for a 49,152-token vocabulary), on a
    compile thread: from :meth:`warm_up`, else at the first constrained request.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, config: EngineConfig):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.config = config
        self.mask_stats = MaskStats()
        self._limits = llguidance.LLParserLimits(
            initial_lexer_fuel=config.structured_compile_fuel,
            step_lexer_fuel=config.structured_step_fuel, verbose_errors=False)
        self._lltok: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, _Entry] = OrderedDict()
        self._cache_bytes = 0
        self._in_flight: Counter[str] = Counter()
        # Requests waiting for a grammar another request is compiling, by cache key.
        self._waiting: dict[str, list[tuple[Request, Callable[[Request], None]]]] = {}
        self._compiling: dict[str, Request] = {}  # by request id
        self._pool: ThreadPoolExecutor | None = None
        self.counts: Counter[str] = Counter()
        self.compile_s_total = 0.0

    # -- the public API ------------------------------------------------------------------------

    def warm_up(self) -> None:
        """Build the llguidance tokenizer on a compile thread now, not at the first request."""
        self._compile_pool().submit(self._llguidance_tokenizer)

    def compiling(self) -> int:
        """Requests waiting for their grammar here."""
        with self._lock:
            return len(self._compiling)

    def abort(self, request_id: str) -> None:
        """Mark a request whose grammar is compiling as aborted: it ends as it joins the queue."""
        with self._lock:
            request = self._compiling.get(request_id)
            if request is not None:
                request.abort_requested = True

    def start(self, request: Request, done: Callable[[Request], None]) -> ErrorInfo | None:
        """Give ``request`` its grammar (``request.grammar``) or its refusal
        (``request.grammar_error``), then call ``done(request)``: here on a cache hit, else on a
        compile thread.

        Returns:
            None; or, when the tenant has ``STRUCTURED_COMPILES_PER_TENANT`` compiles in flight
            here, the ``grammar_busy`` refusal (then ``done`` is not called).
        """
        out = request.sampling.structured
        assert out is not None
        key = out.cache_key()
        with self._lock:
            self.counts["requests"] += 1
            entry = self._cache.get(key)
            if entry is not None:
                self._cache.move_to_end(key)
                self.counts["cache_hits"] += 1
            elif key in self._waiting:  # the same grammar is compiling: it waits for that one
                self.counts["cache_hits"] += 1
                self._waiting[key].append((request, done))
                self._compiling[request.request_id] = request
                return
            elif self._in_flight[request.tenant] >= self.config.structured_compiles_per_tenant:
                self.counts["refused_busy"] += 1
                return ErrorInfo(
                    code=ErrorCode.GRAMMAR_BUSY, retryable=True,
                    message=f"this tenant already has "
                            f"{self.config.structured_compiles_per_tenant} structured-output "
                            f"grammars compiling; retry when one is done",
                    details={"param": out.param,
                             "max_compiles": self.config.structured_compiles_per_tenant})
            else:
                self.counts["cache_misses"] += 1
                self._in_flight[request.tenant] += 1
                self._waiting[key] = []
            if entry is None:
                self._compiling[request.request_id] = request
        if entry is not None:
            self._attach(request, entry.matcher)
            done(request)
            return None
        self._compile_pool().submit(self._compile_for, request, key, done)
        return None

    def stats(self) -> dict[str, Any]:
        """Counts (constrained requests, cache hits and misses, refusals by reason), the cache's
        entries and estimated bytes, compile seconds and the token masks' cost: every value adds
        up across workers (``gateway.workers.aggregate``)."""
        with self._lock:
            counts = dict(self.counts)
            entries, cache_bytes = len(self._cache), self._cache_bytes
        m = self.mask_stats
        refused = sum(v for k, v in counts.items() if k.startswith("refused_"))
        return {
            "constrained_requests": counts.get("requests", 0),
            "compile_cache_hits": counts.get("cache_hits", 0),
            "compile_cache_misses": counts.get("cache_misses", 0),
            "compile_refusals": refused,
            "compile_refusals_by_reason": {k.removeprefix("refused_"): v for k, v in counts.items()
                                           if k.startswith("refused_")},
            "cache_entries": entries, "cache_bytes": cache_bytes,
            "cache_limit_bytes": self.config.structured_cache_bytes,
            "compile_seconds": round(self.compile_s_total, 4),
            "masks": m.masks, "mask_seconds": round(m.mask_s, 4),
            "mask_wait_seconds": round(m.wait_s, 4), "forced_tokens": m.forced,
            "grammar_errors": m.failed,
        }

    def close(self) -> None:
        """Stop the compile threads (compiles in flight finish first)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    # -- compiling -----------------------------------------------------------------------------

    def _compile_pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    max_workers=self.config.structured_compile_threads,
                    thread_name_prefix="grammar-compile")
            return self._pool

    def _llguidance_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._lltok is None:
                tok = self.tokenizer
                if hasattr(tok, "encode_as_text"):  # inference.tokenization.Tokenizer
                    self._lltok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(
                        _TextTokens(tok)))
                else:  # tokens as bytes, eos/bos ids, bytes -> ids (the reference backend's)
                    self._lltok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(tok))
            return self._lltok

    def _compile_for(self, request: Request, key: str, done: Callable[[Request], None]) -> None:
        """A compile thread's work for one request and those waiting for the same grammar;
        each one's ``done`` is always called."""
        try:
            matcher: llguidance.LLMatcher | ErrorInfo = self._compile(
                request.sampling.structured, key)
        except BaseException as exc:  # the library failed (or panicked): these requests end
            if not isinstance(exc, Exception) and not is_library_panic(exc):
                raise
            log.exception("compiling the grammar of %s failed", request.request_id)
            matcher = ErrorInfo(code=ErrorCode.ENGINE_ERROR, retryable=True,
                                message="compiling the structured-output grammar failed")
        with self._lock:
            self._in_flight[request.tenant] -= 1
            if self._in_flight[request.tenant] <= 0:
                del self._in_flight[request.tenant]
            waiting = self._waiting.pop(key, [])
        for each, each_done in [(request, done), *waiting]:
            if isinstance(matcher, ErrorInfo):
                each.grammar_error = matcher
            else:
                self._attach(each, matcher)
            each_done(each)
            with self._lock:  # after ``done``: a request is always in one place or the other
                self._compiling.pop(each.request_id, None)

    def _compile(self, out: Any, key: str) -> llguidance.LLMatcher | ErrorInfo:
        """The cached matcher of ``out`` (compiled and cached here), or why it is refused."""
        assert isinstance(out, StructuredOutput)
        try:
            grammar = check(out, self.config.structured_max_spec_bytes)
        except StructuredOutputError as exc:
            return self._refused("invalid", exc.param, exc.message)
        lltok = self._llguidance_tokenizer()
        started = time.perf_counter()
        matcher = llguidance.LLMatcher(lltok, grammar, log_level=0, limits=self._limits)
        if not matcher.is_error():  # the lexer is lazy: its first mask meets what it refuses
            probe = matcher.deep_copy()
            first = np.zeros((lltok.vocab_size + 31) // 32, dtype=np.int32)
            probe.unsafe_compute_mask_ptr(first.ctypes.data, first.nbytes)
            matcher = probe if probe.is_error() else matcher
        elapsed = time.perf_counter() - started
        if matcher.is_error():
            error = library_message(matcher.get_error())
            reason = ("limit" if any(word in error.lower() for word in LIMIT_WORDS)
                      else "invalid")
            self._add_compile_time(elapsed)
            return self._refused(reason, out.param, (
                f"'{out.param}' could not be compiled within this server's limits: {error}"
                if reason == "limit" else f"'{out.param}' could not be compiled: {error}"))
        self._add_compile_time(elapsed)
        self._cache_put(key, matcher, len(grammar))
        return matcher

    def _add_compile_time(self, seconds: float) -> None:
        with self._lock:
            self.compile_s_total += seconds

    def _refused(self, reason: str, param: str, message: str) -> ErrorInfo:
        with self._lock:
            self.counts[f"refused_{reason}"] += 1
        return ErrorInfo(code=ErrorCode.INVALID_REQUEST, message=message,
                         details={"param": param})

    def _cache_put(self, key: str, matcher: llguidance.LLMatcher, grammar_bytes: int) -> None:
        nbytes = grammar_bytes + ENTRY_OVERHEAD_BYTES
        limit = self.config.structured_cache_bytes
        with self._lock:
            if key in self._cache or nbytes > limit:
                return
            self._cache[key] = _Entry(matcher, nbytes)
            self._cache_bytes += nbytes
            while self._cache_bytes > limit:
                _, old = self._cache.popitem(last=False)
                self._cache_bytes -= old.nbytes
                self.counts["cache_evictions"] += 1

    def _attach(self, request: Request, matcher: llguidance.LLMatcher) -> None:
        """Give ``request`` its own copy of ``matcher``, advanced by the tokens it generated
        before a preemption (another engine's), if any."""
        lltok = self._llguidance_tokenizer()
        out = request.sampling.structured
        grammar = RowGrammar(matcher.deep_copy(), self.vocab_size, self.tokenizer.eos_token_ids,
                             lltok.eos_token, self.mask_stats,
                             param=out.param if out is not None else "response_format",
                             max_step_s=self.config.structured_max_step_ms / 1000,
                             grammar_vocab=lltok.vocab_size)
        if request.resume is not None:
            for token in request.resume.generated:
                error = grammar.consume(token)
                if error is not None:
                    request.grammar_error = error
                    return
        request.grammar = grammar


class _TextTokens:
    """A model's tokenizer as llguidance's ``TokenizerWrapper`` reads it: every token's bytes,
    its special tokens, and text to ids with special-token text as ordinary text. Text a grammar
    forces (a ``const`` of ``"<|im_end|>"``) is then written as the characters it is, never as
    the control token, which the grammar would refuse."""

    def __init__(self, tok: Any):
        special = tok.special_token_ids()
        self.special_token_ids = sorted(special.values())
        self.tokens = [tok.token_bytes(i) for i in range(tok.vocab_size)]
        self.eos_token_id = min(tok.eos_token_ids) if tok.eos_token_ids else None
        self.bos_token_id = None
        self._tok = tok

    def __call__(self, text: bytes) -> list[int]:
        return self._tok.encode_as_text(text.decode("utf-8", errors="replace"))
