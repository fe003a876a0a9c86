"""The caller's side of an engine request: the errors ``submit`` raises, the handle its events
arrive on, and the checks that turn a submission into a :class:`~inference.engine.request.Request`
(re-exported by :mod:`inference.engine.llm_engine`)."""

from __future__ import annotations

import queue
import time
import uuid
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

from inference.engine.backends.base import Tokenizer
from inference.engine.request import (
    AdapterSpec,
    ErrorCode,
    ErrorInfo,
    Event,
    FinalEvent,
    Request,
    ResumeState,
    SamplingParams,
    TokenEvent,
)
from inference.engine.sched.choice_resume import resumed_group_request
from inference.engine.sched.preemption import resumed_request


class EngineRefusal(Exception):
    """A request refused before it entered the engine; ``error`` says why (its code)."""

    def __init__(self, error: ErrorInfo):
        super().__init__(error.message)
        self.error = error


class QueueFullError(EngineRefusal):
    """The pending queue holds ``max_pending`` requests (code ``queue_full``, retryable)."""


class GrammarBusyError(EngineRefusal):
    """A constrained request's tenant already has its cap of grammars compiling on this engine
    (``grammar_busy``, ``STRUCTURED_COMPILES_PER_TENANT``)."""


class InvalidRequestError(EngineRefusal):
    """The request can never be valid for this model, e.g. beyond the context."""


class EngineStoppedError(EngineRefusal):
    """The engine is shutting down and takes no new work (code ``worker_shutdown``, retryable)."""


class RequestHandle:
    """The caller's side of one request: its id and its events, in order."""

    def __init__(self, request_id: str, prompt_len: int):
        self.request_id = request_id
        self.prompt_len = prompt_len
        self._queue: queue.SimpleQueue[Event] = queue.SimpleQueue()

    def _put(self, event: Event) -> None:
        self._queue.put(event)

    def events(self, timeout: float | None = None) -> Iterator[Event]:
        """Yield events until (and including) the final one.

        Raises:
            TimeoutError: if no event arrives within ``timeout`` seconds of the previous one.
        """
        while True:
            try:
                event = self._queue.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"no event for {self.request_id} within {timeout} s") from None
            yield event
            if isinstance(event, FinalEvent):
                return

    def result(self, timeout: float | None = None) -> tuple[str, list[int], FinalEvent]:
        """Wait for the end; return (text, generated token ids, final event).

        For a request of ``n`` > 1 choices the text and tokens are every choice's, in event
        order (each event's ``index`` names its choice; ``final.choices`` holds each choice's
        end): read :meth:`events` to tell them apart.
        """
        text, tokens = [], []
        final: FinalEvent | None = None
        for event in self.events(timeout):
            if isinstance(event, TokenEvent):
                text.append(event.text)
                tokens.append(event.token_id)
            else:
                final = event
                text.append(event.text)
        assert final is not None
        return "".join(text), tokens, final


def _invalid(message: str, code: ErrorCode = ErrorCode.INVALID_REQUEST,
             **details: object) -> InvalidRequestError:
    return InvalidRequestError(ErrorInfo(code=code, message=message, details=details))


def gate_one_refusal(stopping: bool, queued: int, max_pending: int, live: bool,
                     request_id: str) -> EngineRefusal | None:
    """Why ``LLMEngine.submit`` refuses a request before queueing it (None: it does not): the
    engine is stopping, gate 1 is full (``queued`` of ``max_pending``), or the id is ``live``."""
    if stopping:
        return EngineStoppedError(ErrorInfo(
            code=ErrorCode.WORKER_SHUTDOWN, message="the engine is shutting down",
            retryable=True))
    if queued >= max_pending:
        return QueueFullError(ErrorInfo(
            code=ErrorCode.QUEUE_FULL,
            message=f"the queue holds {queued} requests (max_pending={max_pending}); retry later",
            gate=1, retryable=True, details={"queued": queued, "max_pending": max_pending}))
    if live:
        return InvalidRequestError(ErrorInfo(code=ErrorCode.INVALID_REQUEST,
                                             message=f"request id {request_id} is already live"))
    return None


def checked_adapter(adapter: AdapterSpec, pool: Any) -> AdapterSpec:
    """``adapter`` for a request of an engine whose adapter pool is ``pool``.

    Raises:
        InvalidRequestError: the engine serves no adapters (``MAX_LORAS=0``, or a backend
            without them), or the adapter's rank is over its ``MAX_LORA_RANK``; ``param``
            ``model``.
    """
    if pool is None:
        raise _invalid(f"this worker serves no LoRA adapters (asked for '{adapter.name}')",
                       param="model")
    if adapter.rank > pool.max_rank:
        raise _invalid(f"the adapter '{adapter.name}' has rank {adapter.rank}, over this "
                       f"worker's MAX_LORA_RANK={pool.max_rank}", param="model")
    return adapter


def build_request(tokenizer: Tokenizer, eos_token_ids: Collection[int], max_model_len: int, *,
                  prompt_token_ids: Sequence[int] | None, prompt: str | None,
                  messages: Sequence[dict[str, str]] | None, sampling: SamplingParams | None,
                  tenant: str, fairness_key: str, priority: int, fairness_weight: float,
                  request_id: str | None, queue_wait_s: float | None,
                  resume: ResumeState | None = None,
                  clock: Callable[[], float] = time.monotonic,
                  max_n: int | None = None, batch: bool = False,
                  deadline_s: float | None = None) -> Request:
    """The request of one ``LLMEngine.submit`` (its arguments are documented there).

    With ``resume`` (a request preempted on this engine or another), the prompt is the original
    one, the sampling is ``resume.sampling`` (``sampling`` is ignored), and the request continues
    where the state stopped; ``queue_wait_s`` then counts from now.

    Raises:
        InvalidRequestError: not exactly one prompt form, an empty prompt, a non-positive
            ``fairness_weight``, ``prompt_len + max_tokens`` beyond ``max_model_len``
            (``context_length_exceeded``, with both numbers), or a ``resume`` that does not
            match the prompt, or ``sampling.n`` choices beyond ``max_n`` (the engine's
            ``max_batch_size``: every choice is a row of the batch; ``param`` ``n``).
    """
    sampling = resume.sampling if resume is not None else sampling or SamplingParams()
    if max_n is not None and sampling.n > max_n:
        raise _invalid(f"n = {sampling.n} choices exceeds this engine's {max_n} rows "
                       "(max_batch_size): each choice decodes in a row of its own",
                       param="n", n=sampling.n, max_n=max_n)
    if sum(x is not None for x in (prompt_token_ids, prompt, messages)) != 1:
        raise _invalid("give exactly one of prompt_token_ids, prompt, messages")
    if prompt_token_ids is not None:
        ids = [int(t) for t in prompt_token_ids]
    elif prompt is not None:
        ids = tokenizer.encode(prompt)
    else:
        ids = tokenizer.apply_chat_template(list(messages or ()))
    if not ids:  # an empty text, or only characters the tokenizer drops (e.g. "\x16")
        raise _invalid("the prompt has no tokens (it is empty, or holds only characters the "
                       "tokenizer drops)", param="prompt")
    if not fairness_weight > 0:
        raise _invalid(f"fairness_weight must be > 0, got {fairness_weight}",
                       param="fairness_weight")
    if len(ids) + sampling.max_tokens > max_model_len:
        raise _invalid(
            f"prompt of {len(ids)} tokens + max_tokens {sampling.max_tokens} = "
            f"{len(ids) + sampling.max_tokens} exceeds the model's context of "
            f"{max_model_len} tokens", ErrorCode.CONTEXT_LENGTH_EXCEEDED,
            prompt_tokens=len(ids), max_tokens=sampling.max_tokens, max_model_len=max_model_len)
    fairness_key = fairness_key or tenant
    if resume is not None:
        try:
            if resume.choices:  # a request of n > 1 choices, preempted as a whole
                request = resumed_group_request(
                    resume, ids, tenant=tenant, fairness_key=fairness_key, priority=priority,
                    fairness_weight=fairness_weight, clock=clock)
            else:
                request = resumed_request(
                    resume, ids, tenant=tenant, fairness_key=fairness_key, priority=priority,
                    fairness_weight=fairness_weight, tokenizer=tokenizer,
                    eos_token_ids=eos_token_ids, clock=clock)
        except ValueError as exc:
            raise _invalid(f"cannot resume the request: {exc}") from exc
        if queue_wait_s is not None:
            request.queue_deadline = clock() + queue_wait_s
        return _service_class(request, batch, deadline_s, clock)
    request = Request(
        request_id=request_id or f"req-{uuid.uuid4().hex}", prompt_token_ids=ids,
        sampling=sampling, tenant=tenant, fairness_key=fairness_key, priority=priority,
        fairness_weight=fairness_weight)
    if queue_wait_s is not None:
        request.queue_deadline = request.arrival_time + queue_wait_s
    return _service_class(request, batch, deadline_s, clock)


def _service_class(request: Request, batch: bool, deadline_s: float | None,
                   clock: Callable[[], float]) -> Request:
    """``request`` made a batch one (``docs/design.md``, "The batch service class"): no
    admission deadline, its own ``deadline_s`` (seconds from now, any phase) instead."""
    if batch:
        request.batch = True
        request.queue_deadline = None
        if request.resume is not None:
            request.resume.queue_wait_s = None
        if deadline_s is not None:
            request.expires_at = clock() + deadline_s
    return request
