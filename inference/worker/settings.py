"""The inference worker's settings: the one place the engine's settings come from the environment.

:class:`WorkerSettings` reads, from environment variables of the same names in upper case (or a
``.env`` file in the working directory):

- the settings the web tier reads too (:class:`inference.protocol.settings.PlatformSettings`:
  ``REDIS_URL``, ``REDIS_PREFIX``, ``MAX_QUEUE_SIZE``, ``MAX_QUEUE_WAIT_S``,
  ``WORKER_HEARTBEAT_TTL_S``, ``MODEL_PATH``, ...);
- the engine's (:class:`inference.engine.config.EngineConfig`: ``MAX_BATCH_SIZE``,
  ``PREFILL_CHUNK_SIZE``, ``KV_NUM_BLOCKS``, ``SCHEDULING_POLICY``, ...), validated as the engine
  validates them;
- the worker process's own (``WORKER_ID``, ``WORKER_PREFETCH``, ``HEARTBEAT_INTERVAL_S``, ...).

The engine library itself reads no environment variable; :meth:`WorkerSettings.engine_config`
hands it its configuration.
"""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from inference.engine.config import EngineConfig, SchedulingPolicyName
from inference.protocol.settings import PlatformSettings


class WorkerSettings(PlatformSettings, EngineConfig):
    """Every setting of one inference worker process (times in seconds).

    Raises:
        pydantic.ValidationError: at construction, for a value out of range or an engine
            configuration the engine would refuse (e.g. a budget that does not fit the pool).
    """

    model_config = SettingsConfigDict(case_sensitive=False, extra="ignore", frozen=True,
                                      env_file=".env")

    # The platform runs the fair policy by default (the engine library's default is FCFS).
    scheduling_policy: SchedulingPolicyName = SchedulingPolicyName.VTC
    worker_id: str = Field("", description="Consumer name and stats key; empty: host-pid.")
    # Requests this worker takes from the shared queue beyond its free rows: it takes only what
    # it can start soon, so each request's place is decided by the queue's fair order.
    worker_prefetch: int = Field(1, ge=0)
    # Batch requests (the Batch API's lines) it may hold beyond its free rows; None: a batch
    # (MAX_BATCH_SIZE). No one waits on a batch line's stream and every interactive request
    # sorts before them, so a deeper prefetch only refills a freed row at the next tick instead
    # of after a take from Redis.
    worker_batch_prefetch: int | None = Field(None, ge=0)
    heartbeat_interval_s: float = Field(1.0, gt=0)
    # How long a stopping worker lets its engine finish a tick before ending what is in flight.
    shutdown_timeout_s: float = Field(10.0, ge=0)
    poll_block_ms: int = Field(50, ge=1)
    # How long a tick's token events (after each request's first) may wait for the next tick's,
    # to go out with them: two tokens a write per stream, halving the web tier's cost per token
    # (inference.worker.publisher). A token waits at most one tick; 0: every tick at once.
    event_hold_ms: int = Field(250, ge=0)
    # The fewest streams a tick's tokens must go to for the tick to be held: a lone stream's
    # tokens go one at a time (its inter-token latency is the step's, not two steps'), while
    # many streams, where the web tier's cost per write adds up, get two a write.
    event_hold_min_streams: int = Field(2, ge=1)
    # Adapter affinity: the most a request of a LoRA adapter waits at the head of the order for a
    # worker that holds its adapter loaded, before any worker takes it (take.lua); 0: none.
    adapter_affinity_ms: int = Field(200, ge=0)

    def batch_prefetch(self) -> int:
        """``WORKER_BATCH_PREFETCH``, or ``MAX_BATCH_SIZE`` when it is not set."""
        return (self.max_batch_size if self.worker_batch_prefetch is None
                else self.worker_batch_prefetch)

    def engine_config(self) -> EngineConfig:
        """The engine's configuration: its fields as read here; its pending queue holds at most
        a batch and the prefetch of each service class (the worker's own bound, beside the
        global gate 1): interactive requests are taken beside batch ones that wait."""
        fields = {name: getattr(self, name) for name in EngineConfig.model_fields}
        fields["max_pending"] = (2 * self.max_batch_size + self.worker_prefetch
                                 + self.batch_prefetch())
        return EngineConfig(**fields)
