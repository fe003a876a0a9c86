"""Log-probabilities of generated and prompt tokens (OpenAI's ``logprobs`` and ``echo``).

A request asks with :class:`~inference.engine.request.SamplingParams` ``logprobs`` (each generated
token's log-probability and that many likeliest tokens) and ``prompt_logprobs`` (the same for
every prompt token). Values are the log-softmax, in fp32, of the model's raw logits: before
temperature, top-k, top-p and the ``min_tokens`` EOS mask (vLLM's default). Nothing here runs
for a request that did not ask: no log-softmax over the vocabulary, no extra logits.

- Generated tokens: :func:`inference.engine.sampling.sample` calls :func:`record_sampled` with the
  logits it drew from; the entry waits on the request's :class:`LogprobState` until
  :func:`inference.engine.sched.outputs.append_token` puts it into the token's event
  (:func:`take_sampled`).
- Prompt tokens: while :attr:`~inference.engine.request.Request.needs_prompt_logprobs`, each prompt
  chunk of the request asks the backend for every position's logits
  (:attr:`~inference.engine.backends.base.PrefillChunk.all_logits`) and gets no prefix-cache hit;
  :func:`keep_prompt_logprobs` turns those logits into entries as each pass returns. The whole
  list goes out once, on the request's first event (:func:`take_prompt`). The first prompt
  token has no log-probability (nothing predicts it): its entry's ``logprob`` is None.

Token texts are rendered here, in the worker, which has the model's tokenizer
(:class:`TokenRenderer`); the web tier only reshapes the entries.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from inference.engine.backends.base import PrefillChunk, Tokenizer
from inference.engine.request import ErrorInfo, Request
from inference.protocol.events import LOGPROB_FLOOR, PositionLogprobs, TokenLogprob

log = logging.getLogger(__name__)

_renderers: weakref.WeakKeyDictionary[Any, TokenRenderer] = weakref.WeakKeyDictionary()


class TokenRenderer:
    """Each token id's text and bytes, as the OpenAI API reports them (cached per id).

    The bytes come from the tokenizer's ``token_bytes(id)`` where it has one (the exact bytes
    of a byte-level token, special tokens included), else from decoding the token alone. A
    token whose bytes are whole UTF-8 characters is its text; another (part of a character
    split across tokens) is ``"bytes:"`` and ``\\xNN`` escapes, with its bytes given apart.
    """

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[str, tuple[int, ...] | None]] = {}

    def render(self, token_id: int) -> tuple[str, tuple[int, ...] | None]:
        """``(token text, its bytes or None when they are the text's UTF-8)``."""
        cached = self._cache.get(token_id)
        if cached is None:
            token_bytes = getattr(self._tokenizer, "token_bytes", None)
            try:
                raw = (token_bytes(token_id) if token_bytes is not None
                       else self._tokenizer.decode([token_id]).encode("utf-8"))
            except Exception:  # noqa: BLE001 - an id the tokenizer cannot show: no text
                log.warning("cannot render token %d", token_id, exc_info=True)
                raw = b""
            try:
                cached = (raw.decode("utf-8"), None)
            except UnicodeDecodeError:
                cached = ("bytes:" + "".join(f"\\x{b:02x}" for b in raw), tuple(raw))
            self._cache[token_id] = cached
        return cached


def renderer_for(tokenizer: Tokenizer) -> TokenRenderer:
    """The tokenizer's :class:`TokenRenderer`, shared by every request over it."""
    try:
        renderer = _renderers.get(tokenizer)
        if renderer is None:
            renderer = _renderers[tokenizer] = TokenRenderer(tokenizer)
    except TypeError:  # an object that takes no weak reference: a renderer of its own
        renderer = TokenRenderer(tokenizer)
    return renderer


@dataclass
class LogprobState:
    """What a request that asked for logprobs carries between its passes and its events.

    Attributes:
        sampled: the entry of the token just sampled, until its event takes it.
        prompt: the prompt's entries so far (one per prompt token once complete).
        prompt_pending: prompt entries are still to be computed.
        prompt_sent: the prompt's entries went out (they are sent once).
    """

    renderer: TokenRenderer
    sampled: PositionLogprobs | None = None
    prompt: list[PositionLogprobs] = field(default_factory=list)
    prompt_pending: bool = False
    prompt_sent: bool = False


def new_logprob_state(request: Request, tokenizer: Tokenizer) -> LogprobState | None:
    """The state of a request that asks for logprobs, or None (it asks for none).

    A request that continues after a preemption (``request.resume``: its prompt is the original
    prompt and the tokens it streamed) owes no prompt logprobs: its first admission sent them
    with its first token. It is recomputed like any other, prefix-cache hits included.
    """
    params = request.sampling
    if params.logprobs is None and params.prompt_logprobs is None:
        return None
    resumed = request.resume is not None
    return LogprobState(renderer_for(tokenizer),
                        prompt_pending=params.prompt_logprobs is not None and not resumed)


def _positions(renderer: TokenRenderer, logits: torch.Tensor, targets: Sequence[int],
               top_k: int) -> list[PositionLogprobs]:
    """Entries of ``targets`` (one token id per row of ``logits [len(targets), vocab]``) with
    each row's ``top_k`` likeliest tokens."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, torch.tensor(targets, dtype=torch.long)[:, None])[:, 0].tolist()
    top_ids: list[list[int]] = [[] for _ in targets]
    top_values: list[list[float]] = [[] for _ in targets]
    k = min(top_k, logprobs.shape[-1])
    if k > 0:
        values, ids = torch.topk(logprobs, k, dim=-1)  # sorted, most likely first
        top_ids, top_values = ids.tolist(), values.tolist()
    out = []
    for token_id, value, ids_row, values_row in zip(targets, chosen, top_ids, top_values,
                                                    strict=True):
        text, raw = renderer.render(token_id)
        top = []
        for top_id, top_value in zip(ids_row, values_row, strict=True):
            top_text, top_raw = renderer.render(top_id)
            top.append(TokenLogprob(token_id=top_id, token=top_text, raw_bytes=top_raw,
                                    logprob=_bounded(top_value)))
        out.append(PositionLogprobs(token_id=token_id, token=text, raw_bytes=raw,
                                    logprob=_bounded(value), top=tuple(top)))
    return out


def _bounded(value: float) -> float:
    """A log-probability JSON can carry: -inf (and NaN) as :data:`LOGPROB_FLOOR`, at most 0."""
    return min(value, 0.0) if value >= LOGPROB_FLOOR else LOGPROB_FLOOR


def record_sampled(logits: torch.Tensor, requests: Sequence[Request],
                   tokens: Sequence[int | ErrorInfo]) -> None:
    """Keep the entry of each sampled token of a row that asked ``logprobs``.

    Args:
        logits: ``[len(requests), vocab]`` the raw logits the tokens were drawn from.
        requests: the rows; only those with a :class:`LogprobState` and ``logprobs`` set count.
        tokens: each row's token, or its error (no entry then).
    """
    rows = [i for i, r in enumerate(requests)
            if r.logprobs is not None and r.sampling.logprobs is not None
            and isinstance(tokens[i], int)]
    if not rows:
        return
    top_k = max(requests[i].sampling.logprobs or 0 for i in rows)
    picked = [int(tokens[i]) for i in rows]  # type: ignore[arg-type]
    entries = _positions(requests[rows[0]].logprobs.renderer,
                         logits.index_select(0, torch.tensor(rows)), picked, top_k)
    for i, entry in zip(rows, entries, strict=True):
        k = requests[i].sampling.logprobs or 0
        requests[i].logprobs.sampled = (entry if len(entry.top) == k
                                        else entry.model_copy(update={"top": entry.top[:k]}))


def keep_prompt_logprobs(logits: torch.Tensor, chunks: Sequence[PrefillChunk],
                         requests: Sequence[Request], rows: int) -> torch.Tensor:
    """Record the prompt entries of the chunks that asked for every position's logits.

    Args:
        logits: a pass's logits: ``rows`` rows (each chunk's last token first, in order, then
            any decode rows), followed by the other tokens' logits of each chunk with
            ``all_logits`` (:meth:`~inference.engine.backends.base.ModelBackend.prefill`).
        chunks: the pass's prompt chunks; ``requests[i]`` is the row of ``chunks[i]``.
        rows: the pass's chunks and decode rows.

    Returns:
        ``logits[:rows]``: the pass's logits without the extra rows.

    Raises:
        ValueError: the backend gave another number of rows.
    """
    asked = [i for i, chunk in enumerate(chunks) if chunk.all_logits]
    if not asked:
        return logits
    extra = sum(len(chunks[i].token_ids) - 1 for i in asked)
    if logits.dim() != 2 or logits.shape[0] != rows + extra:
        raise ValueError(f"the pass returned {tuple(logits.shape)} logits for {rows} rows and "
                         f"{extra} more prompt positions")
    offset = rows
    for i in asked:
        chunk, request = chunks[i], requests[i]
        n = len(chunk.token_ids)
        positions = torch.cat([logits[offset:offset + n - 1], logits[i:i + 1]])
        offset += n - 1
        _record_prompt_chunk(request, chunk.start_pos, positions)
    return logits[:rows]


def _record_prompt_chunk(request: Request, start: int, logits: torch.Tensor) -> None:
    """Entries of the prompt tokens that positions ``[start, start + len(logits))`` predict."""
    state: LogprobState | None = request.logprobs
    if state is None or not state.prompt_pending:
        return
    prompt = request.prompt_token_ids
    renderer = state.renderer
    if start == 0 and not state.prompt:
        text, raw = renderer.render(prompt[0])
        state.prompt.append(PositionLogprobs(token_id=prompt[0], token=text, raw_bytes=raw,
                                             logprob=None))
    if len(state.prompt) != start + 1:  # a position skipped (never expected): give up on them
        log.warning("request %s: prompt logprobs from position %d after %d entries; dropped",
                    request.request_id, start, len(state.prompt))
        state.prompt, state.prompt_pending = [], False
        return
    # Position p predicts token p + 1; the prompt's last position predicts the first output.
    targets = prompt[start + 1:start + len(logits) + 1]
    if targets:
        state.prompt.extend(_positions(renderer, logits[:len(targets)], targets,
                                       request.sampling.prompt_logprobs or 0))
    if len(state.prompt) == len(prompt):
        state.prompt_pending = False


def take_sampled(request: Request) -> PositionLogprobs | None:
    """The entry of the token just sampled (once), or None."""
    state: LogprobState | None = request.logprobs
    if state is None:
        return None
    entry, state.sampled = state.sampled, None
    return entry


def take_prompt(request: Request) -> tuple[PositionLogprobs, ...] | None:
    """The prompt's entries, the first time they are complete and asked for; else None."""
    state: LogprobState | None = request.logprobs
    if state is None or state.prompt_sent or state.prompt_pending or not state.prompt:
        return None
    state.prompt_sent = True
    return tuple(state.prompt)
