"""Turning a request message into an engine submission: the prompt's tokens and the sampling,
and a preempted request's resume state to and from its message (:func:`to_wire`,
:func:`from_wire`).

The worker is the authority on a request's prompt tokens and context length: a chat is rendered
with the model's chat template (:mod:`inference.tokenization`, as the web tier counts it), a
``max_tokens`` left open becomes what is left of the context, and a request that cannot fit is
refused here, before it reaches the engine, with a code and the numbers.
"""

from __future__ import annotations

import base64
import dataclasses
import time
from typing import Any

from inference.engine.backends.base import Tokenizer
from inference.engine.llm_engine import InvalidRequestError
from inference.engine.request import (
    AdapterSpec,
    ChoiceState,
    ErrorCode,
    ErrorInfo,
    ResumeState,
    SamplingParams,
)
from inference.engine.sched.outputs import batch_expired
from inference.protocol.messages import RequestMessage, Resume, ResumeChoice


def queue_timeout(message: RequestMessage, now: float | None = None) -> ErrorInfo | None:
    """The ``queue_timeout`` error of a request whose admission deadline has passed (a batch
    request's ``batch_expired``, past its own deadline), else None.

    The deadline counts from the web tier's acceptance (``enqueued_at``, unix seconds).
    """
    deadline = message.deadline()
    now = time.time() if now is None else now
    if deadline is None or now <= deadline:
        return None
    if message.batch:
        return batch_expired()
    waited = now - message.enqueued_at
    return ErrorInfo(
        code=ErrorCode.QUEUE_TIMEOUT,
        message=f"request waited {waited:.1f} s for a worker, more than the allowed "
                f"{message.queue_deadline_s:g} s",
        retryable=True, details={"max_queue_wait_s": message.queue_deadline_s})


def submit_args(message: RequestMessage, tokenizer: Tokenizer,
                max_model_len: int) -> dict[str, Any]:
    """Keyword arguments of :meth:`inference.engine.llm_engine.LLMEngine.submit` for ``message``.

    The admission deadline becomes the engine's ``queue_wait_s`` (what is left of it now); a
    batch request's own deadline its ``deadline_s`` instead (``batch``).

    Raises:
        InvalidRequestError: the prompt leaves no room in the context (``context_length_exceeded``,
            with both numbers), the chat template refuses the messages, or the sampling settings
            are out of range (``invalid_request``).
    """
    chat = message.chat()
    try:
        ids = (tokenizer.apply_chat_template(chat, message.tools) if chat is not None
               else tokenizer.encode(message.prompt or ""))
    except ValueError as exc:
        raise InvalidRequestError(ErrorInfo(
            code=ErrorCode.INVALID_REQUEST, message=str(exc),
            details={"param": "messages"})) from exc
    sampling = message.sampling.model_dump()
    sampling["structured"] = message.sampling.structured  # the object, not its dict
    if sampling["max_tokens"] is None:
        left = max_model_len - len(ids)
        if left < 1:
            raise InvalidRequestError(ErrorInfo(
                code=ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                message=f"prompt of {len(ids)} tokens leaves no room in the model's context of "
                        f"{max_model_len} tokens",
                details={"prompt_tokens": len(ids), "max_model_len": max_model_len,
                         "param": "messages" if chat is not None else "prompt"}))
        sampling["max_tokens"] = min(message.default_max_tokens, left)
    try:
        params = SamplingParams(**sampling)
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(ErrorInfo(
            code=ErrorCode.INVALID_REQUEST, message=str(exc))) from exc
    deadline = message.deadline()
    left = None if deadline is None else deadline - time.time()
    # A batch request's deadline is its own (it ends it in any phase), not an admission one.
    return {"prompt_token_ids": ids, "sampling": params, "tenant": message.tenant,
            "fairness_key": message.fairness_key, "priority": message.priority,
            "fairness_weight": message.fairness_weight, "request_id": message.request_id,
            "queue_wait_s": None if message.batch else left, "batch": message.batch,
            "deadline_s": left if message.batch else None,
            "adapter": None if message.adapter is None else AdapterSpec(
                **message.adapter.model_dump())}


def _b64(state: bytes | None) -> str | None:
    return None if state is None else base64.b64encode(state).decode()


def _bytes(state: str | None) -> bytes | None:
    return None if state is None else base64.b64decode(state)


def to_wire(state: ResumeState) -> Resume:
    """The resume state a preempted request's message carries to the next worker (each
    choice's of a request of ``n`` > 1 choices)."""
    return Resume(
        prompt_tokens=state.prompt_len, max_tokens=state.sampling.max_tokens,
        generated=state.generated, next_seq=state.next_seq, preemptions=state.preemptions,
        cached_prompt_tokens=state.cached_prompt_tokens, arrived_at=state.arrived_at,
        admitted_at=state.admitted_at, first_token_at=state.first_token_at,
        requeued_at=time.time(), sampler_state=_b64(state.sampler_state),
        choices=tuple(ResumeChoice(index=c.index, generated=c.generated, end=c.end,
                                   sampler_state=_b64(c.sampler_state))
                      for c in state.choices))


def from_wire(message: RequestMessage, sampling: SamplingParams) -> ResumeState:
    """The engine's resume state of a message that carries one (``sampling``: the message's,
    as :func:`inference.worker.preparation.submit_args` resolved it; ``max_tokens`` is the
    state's)."""
    resume = message.resume
    assert resume is not None
    return ResumeState(
        request_id=message.request_id, prompt_len=resume.prompt_tokens,
        sampling=dataclasses.replace(sampling, max_tokens=resume.max_tokens),
        generated=tuple(resume.generated), next_seq=resume.next_seq,
        preemptions=resume.preemptions, cached_prompt_tokens=resume.cached_prompt_tokens,
        arrived_at=resume.arrived_at, admitted_at=resume.admitted_at,
        first_token_at=resume.first_token_at, sampler_state=_bytes(resume.sampler_state),
        choices=tuple(ChoiceState(c.index, generated=tuple(c.generated), end=c.end,
                                  sampler_state=_bytes(c.sampler_state))
                      for c in resume.choices))
