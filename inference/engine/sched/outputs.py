"""A request's output: each sampled token through the stop rules into a token event, and the end.

The scheduler decides when tokens are sampled and when a row leaves; this module decides what a
token means for its request (EOS, a stop string, ``max_tokens``, ``min_tokens``) and builds the
events the client receives. Text deltas come from the request's incremental detokenizer
(:mod:`inference.engine.detokenizer`), so a stop string is never streamed, not even in part.

A request that asked for logprobs gets each token's entry on the event that emits the token's
text (held back with it, cut with it at a stop string: :func:`released_logprobs`) and the
prompt's entries on its first event (:mod:`inference.engine.logprobs`).

It also builds the errors that end rows: :class:`RowFault` for a failure of one request's own
output (its text or its stop strings: that row ends, nobody else's does), and
:func:`pass_failed` for a forward pass that failed as a whole. Their messages never carry the
underlying exception's text (which may be torch's); the log has it, with the request id.
"""

from __future__ import annotations

import logging
from collections.abc import Set

from inference.engine.logprobs import take_prompt, take_sampled
from inference.engine.request import (
    ErrorCode,
    ErrorInfo,
    FinalEvent,
    FinishReason,
    Request,
    TokenEvent,
)
from inference.protocol.events import PositionLogprobs

log = logging.getLogger(__name__)


class RowFault(Exception):
    """One request's own output failed; ``error`` ends that request only."""

    def __init__(self, error: ErrorInfo):
        super().__init__(error.message)
        self.error = error


def pass_failed(phase: str, num_rows: int) -> ErrorInfo:
    """The error of every row of a ``phase`` ("prefill" or "decode") forward pass that raised."""
    return ErrorInfo(
        code=ErrorCode.ENGINE_ERROR,
        message=f"the model's {phase} pass failed; every request in it was ended",
        retryable=True, details={"phase": phase, "rows": num_rows})


def queue_timeout(waited_s: float) -> ErrorInfo:
    """The error of a request not admitted before its deadline, after ``waited_s`` seconds."""
    return ErrorInfo(
        code=ErrorCode.QUEUE_TIMEOUT,
        message=f"request waited {waited_s:.1f} s in the queue without being admitted, "
                "past its deadline",
        retryable=True, details={"waited_s": round(waited_s, 3)})


def tick_failed() -> ErrorInfo:
    """The error of the requests live when a tick failed (the engine goes on serving)."""
    return ErrorInfo(code=ErrorCode.ENGINE_ERROR, details={"phase": "tick"}, retryable=True,
                     message="the engine failed while serving this request")


def worker_shutdown() -> ErrorInfo:
    """The error of the requests live when the engine shut down."""
    return ErrorInfo(code=ErrorCode.WORKER_SHUTDOWN, retryable=True,
                     message="the inference worker shut down while serving this request")


def adapter_unavailable(name: str, why: str) -> ErrorInfo:
    """The error of a request whose LoRA adapter ``name`` could not be loaded (``why``): it
    ends alone, before its first token; a retry may load it (a file restored)."""
    return ErrorInfo(code=ErrorCode.ADAPTER_UNAVAILABLE,
                     message=f"the adapter '{name}' could not be loaded: {why}",
                     details={"param": "model", "adapter": name})


def batch_expired() -> ErrorInfo:
    """The error of a batch request not done by its own deadline (its completion window),
    in any phase; a retry cannot help (the window has passed)."""
    return ErrorInfo(code=ErrorCode.BATCH_EXPIRED,
                     message="the batch request did not finish before its deadline")


def _text_failed(request: Request, stage: str, token: int | None) -> ErrorInfo:
    log.exception("request %s: turning generated tokens into text failed (%s)",
                  request.request_id, stage)
    details: dict[str, object] = {"phase": stage,
                                  "output_tokens": len(request.output_token_ids),
                                  "stop_strings": len(request.sampling.stop)}
    if token is not None:
        details["token_id"] = token
    return ErrorInfo(
        code=ErrorCode.ENGINE_ERROR,
        message="turning this request's generated tokens into text failed; only this request "
                "was ended", retryable=True, details=details)


def append_token(request: Request, token: int, eos_token_ids: Set[int]) -> TokenEvent | None:
    """Record a generated ``token`` and apply the stop rules.

    Sets ``request.finish_reason`` when the request stopped (``stop`` for EOS or a stop string,
    ``length`` at ``max_tokens``); the row leaves the batch in the next eviction phase.

    Returns:
        The token's event to stream, or None for an EOS token that ends the answer (EOS is never
        streamed; before ``min_tokens``, or with ``ignore_eos``, it is streamed as empty text).
        The event carries the logprobs of the tokens whose text it completes
        (:func:`released_logprobs`), and on the request's first event its prompt's, where the
        request asked for them.

    Raises:
        RowFault: detokenizing the token or looking for the stop strings failed; the token is
            not recorded (nor counted in the usage), and the request must end with the error.
    """
    params = request.sampling
    logprobs = take_sampled(request)  # taken in any case: it belongs to this token only
    request.output_token_ids.append(token)
    n_out = len(request.output_token_ids)
    detokenizer = request.detokenizer
    start = len(detokenizer.text)
    if token in eos_token_ids:
        if not params.ignore_eos and n_out > params.min_tokens:
            request.finish_reason = FinishReason.STOP
            return None
        text = ""
    else:
        try:
            text = request.detokenizer.add_token(token, check_stop=n_out > params.min_tokens)
            if not isinstance(text, str):
                raise TypeError(f"the detokenizer returned {type(text).__name__}, not text")
        except Exception as exc:
            request.output_token_ids.pop()
            raise RowFault(_text_failed(request, "detokenize", token)) from exc
    if logprobs is not None:
        detokenizer.hold(logprobs, start)
    event = TokenEvent(request_id=request.event_id, seq=request.next_event_seq(),
                       token_id=token, text=text, logprobs=released_logprobs(request),
                       prompt_logprobs=take_prompt(request), index=request.choice_index)
    if request.detokenizer.stopped:
        request.finish_reason = FinishReason.STOP
    elif n_out >= params.max_tokens:
        request.finish_reason = FinishReason.LENGTH
    return event


def final_event(request: Request, reason: FinishReason, error: ErrorInfo | None,
                now: float) -> FinalEvent:
    """The request's final event: its usage, any text held back, its timings (seconds), and
    its prompt's logprobs where it asked for them and no token event carried them.

    ``now`` is the scheduler's clock (monotonic seconds, as ``request.arrival_time``). Text held
    back while a stop string might have been forming is released unless the request failed.
    Never raises: if releasing that text fails, an answer that ended normally ends with an
    ``engine_error`` instead (its tail could not be delivered), and an aborted one stays aborted
    without it. The caller reads the reason and error from the event.
    """
    held_text, logprobs, reason, error = released_end(request, reason, error)
    timings = {"queue_s": (request.admitted_time or now) - request.arrival_time,
               "e2e_s": now - request.arrival_time}
    if request.first_token_time is not None:
        timings["ttft_s"] = request.first_token_time - request.arrival_time
    return FinalEvent(request_id=request.request_id, seq=request.next_event_seq(),
                      finish_reason=reason, usage=request.usage(), text=held_text, error=error,
                      timings=timings, prompt_logprobs=take_prompt(request), logprobs=logprobs)


def released_end(request: Request, reason: FinishReason, error: ErrorInfo | None
                 ) -> tuple[str, tuple[PositionLogprobs, ...] | None, FinishReason,
                            ErrorInfo | None]:
    """What a row that ends releases: ``(held text, held logprobs, reason, error)``.

    Text held back while a stop string might have been forming is released unless the row
    failed. Never raises: if releasing it fails, a normal end becomes an ``engine_error`` (its
    tail could not be delivered) and an aborted row stays aborted without it.
    """
    held_text = ""
    logprobs = None
    if request.detokenizer is not None and reason is not FinishReason.ERROR:
        try:
            held_text = request.detokenizer.flush()
            logprobs = released_logprobs(request, final=True)
            if not isinstance(held_text, str):
                raise TypeError(f"the detokenizer returned {type(held_text).__name__}, not text")
        except Exception:
            held_text, logprobs = "", None
            failure = _text_failed(request, "flush", None)
            if reason is not FinishReason.ABORT:
                reason, error = FinishReason.ERROR, failure
    return held_text, logprobs, reason, error


def released_logprobs(request: Request,
                      final: bool = False) -> tuple[PositionLogprobs, ...] | None:
    """The entries of the generated tokens whose text is now out (None: the request did not
    ask for logprobs, or none is out).

    An entry waits with its token's text (held back for a possible stop string); entries of
    tokens past a stop string are dropped, and the token a stop string starts inside keeps its
    entry with its text cut to the returned part (its ``raw_bytes`` then those of the cut
    text; its log-probabilities the whole token's). ``final``: the request ends, every entry
    still held goes out.
    """
    if request.logprobs is None or request.sampling.logprobs is None:
        return None
    out = tuple(entry if cut is None else entry.model_copy(update={"token": cut, "raw_bytes": None})
                for entry, cut in request.detokenizer.release(final))
    return out or None
