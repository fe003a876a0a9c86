"""The contract between the web tier and the inference workers: keys, messages and settings.

The two processes speak only through Redis, in the terms of this module: the key names
(:class:`Keys`), the messages both sides build and validate (pydantic models: a request, the
events of its answer, an abort, a usage report), and the settings both read
(:class:`PlatformSettings`). It imports neither torch nor Django; the web tier imports it, and so
do the engine and the worker. ``docs/design.md`` describes the processes around it.

Keys, under a configurable prefix (``REDIS_PREFIX``, default ``llm``):

================================  ===========================================================
``{p}:fq:*``                      the shared request queue: requests waiting, in the
                                  deployment's fair order, and those each worker took or runs
                                  (``inference/lua/fair_queue.lua`` lists its keys)
``{p}:events:{request_id}``       stream of one request's events, in order: :class:`TokenEvent`
                                  ... then exactly one :class:`FinalEvent`
``{p}:control``                   pub/sub channel of :class:`ControlMessage` (aborts)
``{p}:aborted:{request_id}``      set when a request is aborted, so a worker that reads it later
                                  drops it
``{p}:workers``                   sorted set: worker id -> time of its last heartbeat (unix s)
``{p}:stats:{worker_id}``         the worker's latest stats snapshot (JSON, expires)
================================  ===========================================================

The queue hands requests out in one order for the whole deployment: priority tier first, then
(with VTC) the fairness key with the least weighted service, counters shared by every worker, then
arrival. A worker takes only what it can start soon (its free rows and ``WORKER_PREFETCH``
more), so a request's place is decided by the queue, not by which worker read it. Every change of
the queue is a Lua script made of one library (``inference/lua/fair_queue.lua``) and the script's
own body (:func:`queue_script`), the web tier's admission script included: each state change is
written once. A request a worker took stays its own until the worker writes the request's first
event; if the worker's heartbeat lapses first, the request goes back to its place, once.

Gate 1 (requests accepted and not yet admitted by any worker) is the number of requests waiting
plus those each worker holds taken and not yet admitted by its engine: the web tier refuses when
it would pass ``MAX_QUEUE_SIZE``.

Errors carry a :class:`ErrorCode`, never an HTTP status: the web tier maps codes to statuses.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

# Events streams outlive their request briefly so a slow reader still gets the final event.
EVENTS_TTL_S = 600
ABORT_MARK_TTL_S = 600
# The Celery task (by name: the worker does not import Django) that records a UsageReport.
USAGE_TASK_NAME = "gateway.tasks.record_usage"

_LUA = Path(__file__).parent / "lua"
# The shared queue's state changes, written once (see queue_script).
FAIR_QUEUE_LUA = (_LUA / "fair_queue.lua").read_text()

REPO_ROOT = Path(__file__).resolve().parent.parent
# The default model's folder under the model cache (prepared by ``inference.model_store``).
DEFAULT_MODEL_DIRNAME = "SmolLM2-135M-Instruct"


class PlatformSettings(BaseSettings):
    """The settings that the web tier and the workers both read, from environment variables.

    Each field is read from the variable of the same name in upper case (``REDIS_URL``,
    ``REDIS_PREFIX``, ``MAX_QUEUE_SIZE``, ...), or from a ``.env`` file in the working directory.
    This is the one place their defaults are written: ``llm_platform.settings`` and the worker
    both build their settings from it. Times in seconds.
    """

    model_config = SettingsConfigDict(case_sensitive=False, extra="ignore", frozen=True,
                                      env_file=".env")

    redis_url: str = Field("redis://127.0.0.1:6379/0", min_length=1)
    # Web tiers and workers with the same Redis and prefix form one deployment.
    redis_prefix: str = Field("llm", min_length=1)
    # Gate 1: requests accepted and not yet admitted by any worker, over the whole deployment.
    max_queue_size: int = Field(256, ge=1)
    # A request not admitted this long after the web tier accepted it ends with queue_timeout,
    # whether it still waits in Redis or in a worker's pending queue. 0 disables the deadline.
    max_queue_wait_s: float = Field(120.0, ge=0)
    # A worker whose heartbeat is older than this is dead.
    worker_heartbeat_ttl_s: float = Field(10.0, gt=0)
    # Celery's broker (usage reports go through it); empty: REDIS_URL.
    celery_broker_url: str = ""
    # Celery's queue; empty: "{REDIS_PREFIX}-celery", so deployments sharing a Redis keep apart.
    celery_task_default_queue: str = ""
    # A local Hugging Face causal-LM folder; empty: the prepared default model. The worker loads
    # it; the web tier reads its tokenizer unless TOKENIZER_PATH names another folder.
    model_path: str = ""
    # Where the default model is prepared; empty: .cache/models at the repository root.
    llm_cache_dir: str = ""
    log_level: str = "INFO"

    @property
    def broker_url(self) -> str:
        """Celery's broker URL: ``CELERY_BROKER_URL``, else ``REDIS_URL``."""
        return self.celery_broker_url or self.redis_url

    @property
    def celery_queue(self) -> str:
        """Celery's queue: ``CELERY_TASK_DEFAULT_QUEUE``, else ``{REDIS_PREFIX}-celery``."""
        return self.celery_task_default_queue or f"{self.redis_prefix}-celery"

    @property
    def keys(self) -> Keys:
        return Keys(self.redis_prefix)

    @property
    def model_folder(self) -> Path:
        """The model's folder: ``MODEL_PATH``, else the default model's (prepared or not)."""
        return model_folder(self.model_path, self.llm_cache_dir)

    @property
    def model_cache_dir(self) -> Path:
        """The folder holding prepared models (``LLM_CACHE_DIR``)."""
        return model_cache_dir(self.llm_cache_dir)


def model_cache_dir(llm_cache_dir: str = "") -> Path:
    """The folder holding prepared models: ``llm_cache_dir``, else ``<repo>/.cache/models``."""
    if llm_cache_dir.strip():
        return Path(llm_cache_dir.strip()).expanduser()
    return REPO_ROOT / ".cache" / "models"


def model_folder(model_path: str = "", llm_cache_dir: str = "") -> Path:
    """The model's folder: ``model_path``, else the default model's under the model cache."""
    if model_path.strip():
        return Path(model_path.strip()).expanduser()
    return model_cache_dir(llm_cache_dir) / DEFAULT_MODEL_DIRNAME


@dataclass(frozen=True)
class Keys:
    """Redis key names under one prefix (see the module docstring)."""

    prefix: str = "llm"

    def fq(self, *parts: str | int) -> str:
        """A key of the shared request queue (``inference/lua/fair_queue.lua``)."""
        return ":".join([self.prefix, "fq", *map(str, parts)])

    @property
    def control(self) -> str:
        return f"{self.prefix}:control"

    @property
    def workers(self) -> str:
        return f"{self.prefix}:workers"

    def events(self, request_id: str) -> str:
        return f"{self.prefix}:events:{request_id}"

    def aborted(self, request_id: str) -> str:
        return f"{self.prefix}:aborted:{request_id}"

    def stats(self, worker_id: str) -> str:
        return f"{self.prefix}:stats:{worker_id}"


def queue_script(name: str) -> str:
    """The Lua source of the queue script ``inference/lua/{name}.lua``, after the queue library.

    The web tier's admission script is built the same way from its own body.
    """
    return FAIR_QUEUE_LUA + "\n" + (_LUA / f"{name}.lua").read_text()


def queue_library_with(body: str) -> str:
    """The Lua source of a script that changes the queue: the library, then ``body``."""
    return FAIR_QUEUE_LUA + "\n" + body


# -- messages ------------------------------------------------------------------------------------


class Message(BaseModel):
    """Base of every message that crosses Redis: strict about unknown fields, immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    def to_json(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_json(cls, data: str | bytes) -> Self:
        """Parse and validate a message.

        Raises:
            pydantic.ValidationError: malformed JSON or a field of the wrong shape.
        """
        return cls.model_validate_json(data)


class FinishReason(StrEnum):
    """Why a request ended; ``error`` carries an :class:`ErrorInfo`."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


class ErrorCode(StrEnum):
    """Why a request was refused or failed. The web tier maps each code to an HTTP status."""

    QUEUE_FULL = "queue_full"  # gate 1
    KV_BUDGET_EXCEEDED = "kv_budget_exceeded"  # gate 2, hard-reject
    KV_POOL_EXCEEDED = "kv_pool_exceeded"  # gate 3, hard-reject
    QUEUE_TIMEOUT = "queue_timeout"  # not admitted within MAX_QUEUE_WAIT_S
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    INVALID_REQUEST = "invalid_request"
    ENGINE_ERROR = "engine_error"
    WORKER_SHUTDOWN = "worker_shutdown"
    WORKER_LOST = "worker_lost"  # its worker died while running it


class ErrorInfo(Message):
    """A structured refusal or failure.

    ``gate`` is the backpressure gate (1 to 3) of a refusal; ``retryable`` says whether the same
    request may succeed later; ``details`` carries the numbers (and ``param``, the request field
    at fault, when there is one).
    """

    code: ErrorCode
    message: str
    gate: int | None = Field(None, ge=1, le=3)
    retryable: bool = False
    details: dict[str, Any] = Field(default_factory=dict)


class Usage(Message):
    """Token counts of one request; ``cached_prompt_tokens`` were prefix-cache hits."""

    prompt_tokens: int = Field(0, ge=0)
    cached_prompt_tokens: int = Field(0, ge=0)
    completion_tokens: int = Field(0, ge=0)


class TokenEvent(Message):
    """One generated token: its id and the text it adds (valid UTF-8, maybe empty)."""

    type: Literal["token"] = "token"
    request_id: str
    seq: int = Field(ge=0)
    token_id: int
    text: str


class FinalEvent(Message):
    """The last event of a request: exactly one, and nothing after it.

    ``text`` is text held back while a stop string might have been forming and released at the
    end (usually empty). ``error`` is set exactly when ``finish_reason`` is ``error``.
    ``timings`` (seconds) may hold ``queue_s``, ``ttft_s`` and ``e2e_s``.
    """

    type: Literal["final"] = "final"
    request_id: str
    seq: int = Field(0, ge=0)
    finish_reason: FinishReason
    usage: Usage = Usage()
    text: str = ""
    error: ErrorInfo | None = None
    timings: dict[str, float] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _error_iff_failed(self) -> FinalEvent:
        if (self.error is not None) != (self.finish_reason is FinishReason.ERROR):
            raise ValueError("error is set exactly when finish_reason is 'error'")
        return self


Event = TokenEvent | FinalEvent
_EVENT = TypeAdapter(Annotated[Event, Field(discriminator="type")])


def encode_event(event: Event) -> dict[str, str]:
    """Stream fields of one event: ``{"data": json}``."""
    return {"data": event.model_dump_json()}


def decode_event(fields: dict[bytes | str, bytes | str]) -> Event:
    """The event of a stream entry's fields.

    Raises:
        pydantic.ValidationError: the entry is not a valid event.
    """
    raw = fields.get(b"data", fields.get("data"))
    return _EVENT.validate_json(raw or b"")


class ChatTurn(Message):
    """One chat message of a request; ``content`` is text."""

    role: Literal["system", "user", "assistant"]
    content: str


class Sampling(Message):
    """Decoding settings of a request (the engine's ``SamplingParams`` fields).

    ``max_tokens`` None means what is left of the model's context, capped by the request's
    ``default_max_tokens``. ``top_k`` 0 disables it.
    """

    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(0.0, ge=0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False


class RequestMessage(Message):
    """One generation request, from the web tier to a worker.

    Exactly one of ``messages`` (chat) and ``prompt`` (completion) is set. ``enqueued_at`` is
    unix time (seconds) when the web tier accepted it; ``queue_deadline_s`` bounds the wait from
    then until a worker admits it (0: no deadline). ``meta`` is opaque to the worker and handed
    back in the :class:`UsageReport` (tenant and key ids, the reservations to settle).
    """

    request_id: str = Field(min_length=1)
    tenant: str
    fairness_key: str
    priority: int = 0
    fairness_weight: float = Field(1.0, gt=0, allow_inf_nan=False)
    messages: tuple[ChatTurn, ...] | None = None
    prompt: str | None = None
    sampling: Sampling = Sampling()
    default_max_tokens: int = Field(512, ge=1)
    enqueued_at: float = Field(default_factory=time.time)
    queue_deadline_s: float = Field(0.0, ge=0)
    meta: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _one_prompt(self) -> RequestMessage:
        if (self.messages is None) == (self.prompt is None):
            raise ValueError("give exactly one of messages and prompt")
        return self

    def chat(self) -> list[dict[str, str]] | None:
        """``messages`` as plain dicts (for a chat template), or None for a completion."""
        if self.messages is None:
            return None
        return [{"role": m.role, "content": m.content} for m in self.messages]

    def deadline(self) -> float | None:
        """Unix time by which a worker must admit the request, or None."""
        return self.enqueued_at + self.queue_deadline_s if self.queue_deadline_s else None


class ControlMessage(Message):
    """A command to every worker: ``abort`` one request."""

    type: Literal["abort"]
    request_id: str = Field(min_length=1)


class UsageReport(Message):
    """What a worker reports of one finished request, for billing (the Celery usage task).

    ``first_token_at`` and ``finished_at`` are unix times (seconds); ``meta`` is the request
    message's. The web tier derives the HTTP status to record from the finish reason and error.
    """

    request_id: str
    meta: dict[str, Any] = Field(default_factory=dict)
    usage: Usage
    finish_reason: FinishReason
    error: ErrorInfo | None = None
    enqueued_at: float
    first_token_at: float | None = None
    finished_at: float

    @property
    def ttft_s(self) -> float | None:
        return self.first_token_at - self.enqueued_at if self.first_token_at else None

    @property
    def duration_s(self) -> float:
        return self.finished_at - self.enqueued_at
