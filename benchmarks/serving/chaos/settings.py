"""What a chaos run sends and how it sets the platform up: the prompts, tenants and kinds of
fault, the platform's settings, the bounds its checks allow, and :class:`Options` (one run's
flags)."""

from __future__ import annotations

from dataclasses import dataclass

MODEL = "SmolLM2-135M-Instruct"
# The prompts the clients send (ASCII: with the reference backend's byte tokenizer every generated
# token is one character).
PROMPTS = (
    "The quick brown fox",
    "Once upon a time",
    "In a hole in the ground there lived",
    "It was the best of times",
    "Call me Ishmael.",
    "All happy families are alike;",
    "The sky above the port was",
    "Many years later, as he faced",
    "It is a truth universally acknowledged",
    "Happy families, queues and workers",
)
TENANTS = ("alpha", "beta", "gamma")
# The tenant with a concurrency limit (its 429s are refusals, allowed).
LIMITED_TENANT, LIMITED_CONCURRENCY = "gamma", 4
# The kinds of fault: a kill (SIGKILL or SIGTERM) and restart of a worker, of daphne (SIGKILL:
# the web process dies), Celery, beat or Redis; a pause (SIGSTOP, then SIGCONT) of a worker or of
# Redis longer than the heartbeat TTL; a drain of daphne (SIGTERM) while answers not streamed are
# in flight, then its restart.
KINDS = ("worker", "daphne", "celery", "beat", "redis", "pause-worker", "pause-redis",
         "drain-daphne")
# One round of the fault schedule: every kind, worker kills twice (the most state lives there).
KILL_ROUND = ("worker", "worker", "daphne", "redis", "celery", "beat", "pause-worker",
              "pause-redis", "drain-daphne")
# Error codes that only a fault explains, and the kinds of fault that do (within the request's
# life): any other such error is the platform's own doing.
CAUSED_BY = {
    "worker_lost": frozenset({"worker", "pause-worker"}),
    "worker_shutdown": frozenset({"worker"}),
    "interrupted": frozenset({"drain-daphne"}),
    "state_lost": frozenset({"redis"}),
}
# Error codes that say the client sent a bad request: the load sends none, so each is the
# platform's fault (as is any 4xx but an admission's 429).
CLIENT_FAULT_CODES = frozenset({"invalid_request", "bad_request", "context_length_exceeded"})
# Errors whose client must be told it may retry (``retryable`` in a stream's error event, a
# ``Retry-After`` header on a body).
RETRYABLE_CODES = frozenset({"worker_lost", "interrupted", "state_lost"})
# Codes of a refusal at admission (no work started): allowed outcomes.
ADMISSION_CODES = frozenset({"queue_full", "rate_limit_exceeded", "concurrency_limit_exceeded",
                             "no_worker_available", "service_unavailable",
                             "token_budget_exhausted"})
# Fields of a live worker's stats snapshot that must be 0 once nothing runs.
WORKER_BUSY_FIELDS = ("num_pending", "num_prefilling", "num_active", "active_kv_reserved",
                      "kv_blocks_held", "kv_blocks_reserved")
# A request's usage is recorded within this long of its end (seconds): a Redis without
# persistence restarting in that time may take its ledger entry with it.
USAGE_RECORDED_WITHIN_S = 10.0
# How many examples of each failure the report keeps.
MAX_EXAMPLES = 8
# A request whose web process died (daphne SIGKILL) is billed up to its delivered checkpoint,
# written at most every 0.2 s (gateway.delivery.CHECKPOINT_INTERVAL_S) in the pipeline of the
# next read: the record may be below what the client received by at most the tokens that
# reached it in this long before its connection was lost (seconds).
CHECKPOINT_LAG_S = 0.5
# After a pause is resumed, deaths are still declared for this many heartbeat TTLs (a judge
# whose sight of Redis broke declares none for a TTL, then within two): the log lines declaring a
# death from the pause to then are checked against the processes that were alive.
DEATH_WINDOW_TTLS = 2.0
# The tenant that runs the Batch API jobs (no limits; the interactive load never uses it), and
# the invalid lines planted in each job (a body without its prompt: each must end in the error
# file with a 400).
BATCH_TENANT, BATCH_INVALID_LINES = "delta", 2
# The kinds of fault after which a batch line is sent again (its request ended with a retryable
# error or Redis lost it): a line that failed BATCH_MAX_ATTEMPTS times needs that many of them
# during its batch. A batch line has no web process: a drain or a kill of daphne explains none.
BATCH_RETRY_FAULTS = frozenset({"worker", "pause-worker", "redis"})

# The platform's settings for the run. A request waits at most MAX_QUEUE_WAIT_S for admission and
# at most REQUEST_IDLE_TIMEOUT_S between events, so every request that the platform does not lose
# ends within the client's timeout with a clear outcome.
PLATFORM_ENV = {
    "BACKEND": "reference",
    "MAX_BATCH_SIZE": 8,
    "WORKER_HEARTBEAT_TTL_S": 3,
    "HEARTBEAT_INTERVAL_S": 0.5,
    "REQUEST_IDLE_TIMEOUT_S": 30,
    "MAX_QUEUE_WAIT_S": 20,
    "STATS_SNAPSHOT_INTERVAL_S": 2,
    "CLEANUP_INTERVAL_S": 20,
    # A drain shorter than the longest answers (120 tokens, 2.4 s at 20 ms a step): those in
    # flight at a drain that are not done within it end with `interrupted`.
    "WEB_DRAIN_S": 1,
    # A batch line goes to the error file (503) after this many requests ended with retryable
    # errors (the platform's default, stated: the checks judge such a line by it).
    "BATCH_MAX_ATTEMPTS": 3,
    # A few lines of a batch at once (default 64): its lines run over several faults, and its
    # steps feed and collect many times.
    "BATCH_LINES_IN_FLIGHT": 8,
    "LOG_LEVEL": "INFO",
}


@dataclass
class Options:
    """One chaos run (times in seconds; ``kill_interval_s`` is (min, max) between faults;
    ``pause_ttls`` is (min, max) of a pause, in heartbeat TTLs; ``batch_jobs`` Batch API jobs
    of ``batch_lines`` lines each are created over the first two thirds of the load, and waited
    for at most ``batch_wait_s`` after it)."""

    duration_s: float = 420.0
    concurrency: int = 10
    workers: int = 2
    seed: int = 1
    redis_persistence: str = "aof"
    step_delay_s: float = 0.02
    request_timeout_s: float = 60.0
    settle_s: float = 60.0
    kill_interval_s: tuple[float, float] = (6.0, 14.0)
    pause_ttls: tuple[float, float] = (1.5, 3.0)
    warmup_s: float = 5.0
    stream_fraction: float = 0.8
    max_tokens: tuple[int, int] = (10, 120)
    fresh_worker_ids: bool = False
    batch_jobs: int = 4
    batch_lines: int = 60
    batch_wait_s: float = 120.0
    log_dir: str | None = None
    out: str | None = None
