"""A request's output: each sampled token through the stop rules into a token event, and the end.

The scheduler decides when tokens are sampled and when a row leaves; this module decides what a
token means for its request (EOS, a stop string, ``max_tokens``, ``min_tokens``) and builds the
events the client receives. Text deltas come from the request's incremental detokenizer
(:mod:`inference.detokenizer`), so a stop string is never streamed, not even in part.
"""

from __future__ import annotations

from collections.abc import Set

from inference.request import (
    ErrorInfo,
    FinalEvent,
    FinishReason,
    Request,
    TokenEvent,
)


def append_token(request: Request, token: int, eos_token_ids: Set[int]) -> TokenEvent | None:
    """Record a generated ``token`` and apply the stop rules.

    Sets ``request.finish_reason`` when the request stopped (``stop`` for EOS or a stop string,
    ``length`` at ``max_tokens``); the row leaves the batch in the next eviction phase.

    Returns:
        The token's event to stream, or None for an EOS token that ends the answer (EOS is never
        streamed; before ``min_tokens``, or with ``ignore_eos``, it is streamed as empty text).
    """
    params = request.sampling
    request.output_token_ids.append(token)
    n_out = len(request.output_token_ids)
    if token in eos_token_ids:
        if not params.ignore_eos and n_out > params.min_tokens:
            request.finish_reason = FinishReason.STOP
            return None
        text = ""
    else:
        text = request.detokenizer.add_token(token, check_stop=n_out > params.min_tokens)
    event = TokenEvent(request_id=request.request_id, seq=request.next_event_seq(),
                       token_id=token, text=text)
    if request.detokenizer.stopped:
        request.finish_reason = FinishReason.STOP
    elif n_out >= params.max_tokens:
        request.finish_reason = FinishReason.LENGTH
    return event


def final_event(request: Request, reason: FinishReason, error: ErrorInfo | None,
                now: float) -> FinalEvent:
    """The request's final event: its usage, any text held back, its timings (seconds).

    ``now`` is the scheduler's clock (monotonic seconds, as ``request.arrival_time``). Text held
    back while a stop string might have been forming is released unless the request failed.
    """
    held_text = request.detokenizer.flush() if (
        request.detokenizer and reason is not FinishReason.ERROR) else ""
    timings = {"queue_s": (request.admitted_time or now) - request.arrival_time,
               "e2e_s": now - request.arrival_time}
    if request.first_token_time is not None:
        timings["ttft_s"] = request.first_token_time - request.arrival_time
    return FinalEvent(request_id=request.request_id, seq=request.next_event_seq(),
                      finish_reason=reason, usage=request.usage(), text=held_text, error=error,
                      timings=timings)
