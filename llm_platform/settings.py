"""Django settings, every one read from the environment.

The variables, their defaults and what they do are listed in ``docs/platform.md``. A ``.env``
file at the repository root is read too when present. The variables that the inference worker
reads too (Redis, gate 1, the admission deadline, heartbeats, the model's folder, the largest
structured-output spec) come from :class:`inference.protocol.settings.PlatformSettings`, where
their defaults are written once; Django's own and the web tier's come through django-environ.
Engine settings (``MAX_BATCH_SIZE``, ``BACKEND``, ...) are the worker's alone
(:mod:`inference.worker.settings`).
"""

from pathlib import Path

import environ

from dashboard.conf import beat_schedule
from gateway.pricing import DEFAULT_BATCH_TOKEN_PRICE, parse_token_price
from inference.protocol.settings import PlatformSettings
from llm_platform import private_files
from llm_platform.secret_key import load_secret_key

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = BASE_DIR / "var"

env = environ.Env()
if (BASE_DIR / ".env").is_file():
    environ.Env.read_env(BASE_DIR / ".env")
# The settings the worker reads too.
SHARED = PlatformSettings(_env_file=BASE_DIR / ".env")

DEBUG = env.bool("DEBUG", default=False)
# No public default: SECRET_KEY when set, else this install's own key, generated once into
# SECRET_KEY_FILE (var/secret_key) and shared by every process (llm_platform/secret_key.py).
SECRET_KEY = load_secret_key(env.str("SECRET_KEY", default=""), debug=DEBUG,
                             path=BASE_DIR / env.str("SECRET_KEY_FILE", default="var/secret_key"))
ALLOWED_HOSTS = env.list("ALLOWED_HOSTS", default=["localhost", "127.0.0.1", "[::1]"])
CSRF_TRUSTED_ORIGINS = env.list("CSRF_TRUSTED_ORIGINS", default=[])

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "channels",
    "tenants",
    "api",
    "chat",
    "dashboard",
]

# Django's and django-csp's middlewares, each run on the event loop where it does no I/O, and the
# pages' ones (sessions, CSRF, login, messages) not at all for the REST API
# (llm_platform.middleware).
MIDDLEWARE = [
    "llm_platform.middleware.SecurityMiddleware",
    # Above CommonMiddleware: its own answers (the APPEND_SLASH redirect, a Host refused) too.
    "llm_platform.middleware.XFrameOptionsMiddleware",
    # A NUL in the path or query string is read as U+FFFD, not a 500 from PostgreSQL.
    "llm_platform.middleware.NulCharacterMiddleware",
    "llm_platform.middleware.CSPMiddleware",
    "llm_platform.middleware.SessionMiddleware",
    "llm_platform.middleware.CommonMiddleware",
    "llm_platform.middleware.CsrfViewMiddleware",
    "llm_platform.middleware.AuthenticationMiddleware",
    "llm_platform.middleware.MessageMiddleware",
    # A database outage raised by a page is a retryable 503, not a 500 (llm_platform.outages).
    "llm_platform.outages.DatabaseOutageMiddleware",
]

# Content-Security-Policy on every response (django-csp): the pages load scripts, styles,
# images and fonts from this site only, with no inline script or style (not even a style
# attribute), connect (fetch, the chat's websocket) to this site only, post forms to this site
# only, and are never framed. A policy a browser would have enforced against untrusted text that
# got past the chat's sanitizer (a remote image, a style overlay, a form posting elsewhere).
CONTENT_SECURITY_POLICY = {
    "DIRECTIVES": {
        "default-src": ["'self'"],
        "script-src": ["'self'"],
        "style-src": ["'self'"],
        "img-src": ["'self'"],
        "font-src": ["'self'"],
        "connect-src": ["'self'"],
        "form-action": ["'self'"],
        "frame-ancestors": ["'none'"],
        "frame-src": ["'none'"],
        "object-src": ["'none'"],
        "base-uri": ["'none'"],
    },
}
# Behind a reverse proxy: which host and scheme a request was made to (Django's settings; the
# chat's websocket origin check and CSRF read them). Set only where the proxy sets these headers.
USE_X_FORWARDED_HOST = env.bool("USE_X_FORWARDED_HOST", default=False)
SECURE_PROXY_SSL_HEADER = (("HTTP_X_FORWARDED_PROTO", "https")
                           if env.bool("SECURE_PROXY_SSL_HEADER", default=False) else None)

ROOT_URLCONF = "llm_platform.urls"
# Database sessions, looking up only keys the store could have issued.
SESSION_ENGINE = "llm_platform.sessions"
ASGI_APPLICATION = "llm_platform.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

DATABASES = {
    "default": env.db_url("DATABASE_URL", default=f"sqlite:///{VAR_DIR / 'db.sqlite3'}"),
}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    private_files.private_folder(VAR_DIR)
    # A file, not memory, so the end-to-end tests' server processes share the test database.
    DATABASES["default"]["TEST"] = {"NAME": str(VAR_DIR / "test_db.sqlite3")}
    # A connection never creates the file: a missing database is an outage (503), not an empty
    # one (llm_platform.sqlite.base).
    DATABASES["default"]["ENGINE"] = "llm_platform.sqlite"
    # Concurrent async views and Celery write at once; wait for the lock instead of failing.
    # A transaction takes the write lock when it begins (IMMEDIATE): one that read first and
    # then asked for it could only fail at once ("database is locked") while another writes.
    # WAL lets readers go on while one writes.
    _sqlite_options = DATABASES["default"].setdefault("OPTIONS", {})
    _sqlite_options.setdefault("timeout", 20)
    _sqlite_options.setdefault("transaction_mode", "IMMEDIATE")
    _sqlite_options.setdefault("init_command", "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL")
elif DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql":
    # A database host that does not answer fails a request (503) after this long, instead of
    # the system's TCP timeout (minutes). libpq takes whole seconds, at least 2.
    DATABASES["default"].setdefault("OPTIONS", {}).setdefault(
        "connect_timeout", env.int("DATABASE_CONNECT_TIMEOUT_S", default=5))
# Files holding secrets are their owner's only (llm_platform.private_files): var/ and every file
# in it (the SQLite database, the keys, the logs), and a SQLite database kept elsewhere; a looser
# mode found when a process starts is tightened.
private_files.make_private(VAR_DIR, private_files.sqlite_files(DATABASES["default"]["NAME"])
                           if DATABASES["default"]["ENGINE"] == "llm_platform.sqlite" else ())
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = env.str("TIME_ZONE", default="UTC")
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
# The Files API's files (api.file_store) are kept in the "files" storage: by default local files
# under FILES_ROOT (var/files), the folder 0700 and each file 0600 (llm_platform.private_files);
# FILES_STORAGE_BACKEND (and its FILES_STORAGE_OPTIONS, a JSON object) may name any Django storage
# back end instead (django-storages' S3Storage, ...).
FILES_ROOT = env.path("FILES_ROOT", default=VAR_DIR / "files")
_FILES_BACKEND = env.str("FILES_STORAGE_BACKEND",
                         default="django.core.files.storage.FileSystemStorage")
_FILES_OPTIONS = env.json("FILES_STORAGE_OPTIONS", default={})
if _FILES_BACKEND == "django.core.files.storage.FileSystemStorage":
    _FILES_OPTIONS = {"location": str(FILES_ROOT), "file_permissions_mode": 0o600,
                      "directory_permissions_mode": 0o700, **_FILES_OPTIONS}
    private_files.private_folder(_FILES_OPTIONS["location"])
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"},
    "files": {"BACKEND": _FILES_BACKEND, "OPTIONS": _FILES_OPTIONS},
}
STATIC_ROOT = env.path("STATIC_ROOT", default=BASE_DIR / "staticfiles")
STATICFILES_DIRS = [p for p in [BASE_DIR / "static"] if p.is_dir()]

REDIS_URL = SHARED.redis_url

CHANNEL_LAYERS = {
    "default": {
        "BACKEND": "channels_redis.core.RedisChannelLayer",
        # channels_redis blocks 5 s per receive (BZPOPMIN); redis-py's default 5 s socket
        # timeout would cut that read and kill the websocket, so reads may take longer.
        "CONFIG": {"hosts": [{"address": REDIS_URL, "socket_timeout": 30}],
                   # Deployments sharing a Redis keep their channels apart, as their keys.
                   "prefix": f"{SHARED.redis_prefix}:asgi"},
    },
}

CELERY_BROKER_URL = SHARED.broker_url
CELERY_RESULT_BACKEND = None
CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_DEFAULT_QUEUE = SHARED.celery_queue
# The usage task lives in the web tier's protocol package, which is not a Django app.
CELERY_IMPORTS = ("gateway.tasks",)
CELERY_TASK_ALWAYS_EAGER = env.bool("CELERY_TASK_ALWAYS_EAGER", default=False)
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# A task is acknowledged when it has run, not when it is taken: a Celery worker killed mid-task
# leaves it to be delivered again (usage records are idempotent per request id; the usage ledger's
# reconciliation records whatever is still lost: gateway.usage).
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
# Unacknowledged tasks go back to the queue after this (seconds; Redis broker). Every task is
# short, so a task unacknowledged this long belonged to a Celery worker that died.
CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": env.int("CELERY_VISIBILITY_TIMEOUT_S",
                                                                 default=300)}

# The platform's own settings, in one namespace (read through gateway.conf.platform_settings()).
LLM_PLATFORM = {
    # Shared with the workers (inference.protocol.settings.PlatformSettings documents each).
    "REDIS_PREFIX": SHARED.redis_prefix,
    "MAX_QUEUE_SIZE": SHARED.max_queue_size,
    "MAX_QUEUE_WAIT_S": SHARED.max_queue_wait_s,
    "WORKER_HEARTBEAT_TTL_S": SHARED.worker_heartbeat_ttl_s,
    "WEB_HEARTBEAT_TTL_S": SHARED.web_heartbeat_ttl_s,
    "MODEL_PATH": SHARED.model_path,
    "LLM_CACHE_DIR": SHARED.llm_cache_dir,
    "STRUCTURED_MAX_SPEC_BYTES": SHARED.structured_max_spec_bytes,
    # LoRA adapters (docs/platform.md, "LoRA adapters"): the folder their files live under
    # (empty: <repo>/.cache/adapters) and the largest rank; and, the web tier's own, the most
    # bytes of an adapter's two files (an upload's, a registered folder's).
    "ADAPTER_ROOT": SHARED.adapter_root,
    "MAX_LORA_RANK": SHARED.max_lora_rank,
    "MAX_ADAPTER_BYTES": env.int("MAX_ADAPTER_BYTES", default=512 * 2**20),
    # Tool calling (api.tool_fields): tools one chat request may offer (OpenAI's limit), and the
    # bytes of their definitions' JSON.
    "MAX_TOOLS": env.int("MAX_TOOLS", default=128),
    # Choices one request may ask (n); a worker refuses more than its batch size as well.
    "MAX_N": env.int("MAX_N", default=8),
    "MAX_TOOLS_BYTES": env.int("MAX_TOOLS_BYTES", default=65_536),
    # The Responses API (api.response_store): responses one previous_response_id chain may hold,
    # and how long a stored response is kept (seconds; OpenAI's 30 days).
    "MAX_RESPONSE_CHAIN": env.int("MAX_RESPONSE_CHAIN", default=100),
    "RESPONSES_RETENTION_S": env.float("RESPONSES_RETENTION_S", default=30 * 86400.0),
    # The Files API (api.file_store): the largest file (bytes; OpenAI's batch input: 200 MB) and
    # the most requests (non-empty lines) in a batch file (OpenAI's 50,000), each tenant's
    # storage (bytes over all its files; 0: no quota), uploads one tenant may have in progress at
    # once (0: any number) and how long one may take (s), and how long a file is kept (s;
    # uploads, and the files the platform writes, "batch_output"; 0: until deleted).
    "FILES_MAX_BYTES": env.int("FILES_MAX_BYTES", default=200 * 2**20),
    "FILES_MAX_LINES": env.int("FILES_MAX_LINES", default=50_000),
    "FILES_TENANT_QUOTA_BYTES": env.int("FILES_TENANT_QUOTA_BYTES", default=10 * 2**30),
    "FILES_MAX_CONCURRENT_UPLOADS": env.int("FILES_MAX_CONCURRENT_UPLOADS", default=4),
    "FILES_UPLOAD_LEASE_S": env.float("FILES_UPLOAD_LEASE_S", default=600.0),
    "FILES_RETENTION_S": env.float("FILES_RETENTION_S", default=30 * 86400.0),
    "FILES_OUTPUT_RETENTION_S": env.float("FILES_OUTPUT_RETENTION_S", default=30 * 86400.0),
    # The Batch API (api.batch_runner): lines of one batch queued at once (in Redis and the
    # workers), how often the Celery step runs (s), how often at least a batch in progress is
    # stepped with a look at every running line (s; between, only once an eighth of its lines
    # in flight ended: api.batch_pace), how long one step may work (s), lines validation reads
    # per step, the requests one line may be sent as (a retryable error or a request Redis
    # lost sends it again) before it goes to the error file, and the nice value a step runs at
    # (0-19, on a thread of its own: gateway.background; 0: the Celery process's own).
    "BATCH_LINES_IN_FLIGHT": env.int("BATCH_LINES_IN_FLIGHT", default=64),
    "BATCH_STEP_INTERVAL_S": env.float("BATCH_STEP_INTERVAL_S", default=1.0),
    "BATCH_SCAN_INTERVAL_S": env.float("BATCH_SCAN_INTERVAL_S", default=10.0),
    "BATCH_STEP_BUDGET_S": env.float("BATCH_STEP_BUDGET_S", default=0.5),
    "BATCH_VALIDATE_LINES": env.int("BATCH_VALIDATE_LINES", default=5_000),
    "BATCH_MAX_ATTEMPTS": env.int("BATCH_MAX_ATTEMPTS", default=3),
    "BATCH_STEP_NICE": env.int("BATCH_STEP_NICE", default=10),
    # The share of a token one token of batch work is charged (0 < x <= 1; OpenAI's half): a
    # line's token budget reservation, settlement and usage record's billed_tokens
    # (gateway.pricing). Anything else stops the process here, naming the setting.
    "BATCH_TOKEN_PRICE": parse_token_price(env.str("BATCH_TOKEN_PRICE",
                                                   default=str(DEFAULT_BATCH_TOKEN_PRICE))),
    # Connections per web process: each request in flight holds one while it waits for events.
    "REDIS_MAX_CONNECTIONS": env.int("REDIS_MAX_CONNECTIONS", default=4096),
    # The deployment's default model (served without a registry entry; docs/platform.md,
    # "Models and model access"); requests naming an unknown model get 404 model_not_found.
    "SERVED_MODEL_NAME": SHARED.served_model_name,
    # max_tokens when a request gives none: what is left of the context, capped by this.
    "DEFAULT_MAX_TOKENS": env.int("DEFAULT_MAX_TOKENS", default=512),
    # How long the web tier waits for a worker's first answer before it commits to HTTP 200 on a
    # streaming request (seconds); a refusal within it gets its real status code.
    "STREAM_DECISION_TIMEOUT_S": env.float("STREAM_DECISION_TIMEOUT_S", default=30.0),
    # A streaming response sends an SSE comment after this long without an event (seconds), so
    # proxies with an idle timeout keep the connection open.
    "SSE_KEEPALIVE_S": env.float("SSE_KEEPALIVE_S", default=15.0),
    # How long a request in flight rides out a Redis outage before it ends with a 503 (seconds).
    "REDIS_OUTAGE_TOLERANCE_S": env.float("REDIS_OUTAGE_TOLERANCE_S", default=10.0),
    # A request with no event from its worker for this long ends with a 504 (seconds).
    "REQUEST_IDLE_TIMEOUT_S": env.float("REQUEST_IDLE_TIMEOUT_S", default=300.0),
    # Who the fair (VTC) scheduler balances: "tenant", "api_key" or "user" (the request's user
    # field, within its tenant).
    "FAIRNESS_KEY": env.str("FAIRNESS_KEY", default="tenant"),
    # Folder holding the model's tokenizer, used to count prompt tokens for limits and budgets;
    # empty: MODEL_PATH, else the prepared default model. Without one, counts are estimated.
    "TOKENIZER_PATH": env.str("TOKENIZER_PATH", default=""),
    # Processes per web process that count prompt tokens off the event loop; 0: gateway.tokens'.
    "TOKENIZER_PROCESSES": env.int("TOKENIZER_PROCESSES", default=0),
    # The largest request body (bytes): a larger one is refused (413) before it is read, from its
    # Content-Length or, chunked, as soon as it passes the limit (llm_platform.http_guard).
    "MAX_BODY_BYTES": env.int("MAX_BODY_BYTES", default=2_621_440),
    # Paths that take larger bodies (files): "PATH=BYTES,..." (a path covers the paths below it;
    # the longest match wins). A body over MAX_BODY_BYTES is read there only once the request's
    # API key, from its headers, was found valid (else 401, nothing read).
    # By default /v1/files takes a file of FILES_MAX_BYTES and its multipart framing, and
    # /v1/adapters an adapter of MAX_ADAPTER_BYTES and its framing.
    "MAX_BODY_BYTES_BY_PATH": {path: int(limit) for path, limit in
                               env.dict("MAX_BODY_BYTES_BY_PATH", default={}).items()},
}
# The multipart framing around an uploaded file (its part's headers, the other fields; bytes).
MULTIPART_OVERHEAD_BYTES = 65_536
LLM_PLATFORM["MAX_BODY_BYTES_BY_PATH"] = {
    "/v1/files": LLM_PLATFORM["FILES_MAX_BYTES"] + MULTIPART_OVERHEAD_BYTES,
    "/v1/adapters": LLM_PLATFORM["MAX_ADAPTER_BYTES"] + MULTIPART_OVERHEAD_BYTES,
    **LLM_PLATFORM["MAX_BODY_BYTES_BY_PATH"]}
# Django's own limit on a body it reads (request.body, forms), the same: a body that reaches
# Django without the web process (a test client, another server) is refused alike.
DATA_UPLOAD_MAX_MEMORY_SIZE = LLM_PLATFORM["MAX_BODY_BYTES"]

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    # A key a client put where none belongs (a URL) is cut to its visible prefix in every line.
    "filters": {"redact_keys": {"()": "llm_platform.log_redaction.RedactKeys"},
                "without_traceback": {"()": "llm_platform.log_redaction.WithoutTraceback"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "filters": ["redact_keys"]}},
    "root": {"handlers": ["console"], "level": SHARED.log_level},
    # A Host header not allowed (any client can send one) is one line, not a traceback each.
    "loggers": {"django.security.DisallowedHost": {"filters": ["without_traceback"]}},
}


def _given(**values):
    """The settings that the environment sets; the app's own defaults fill in the rest."""
    return {name: value for name, value in values.items() if value is not None}


# The web chat (chat.conf) and the scheduler dashboard (dashboard.conf); defaults live there.
CHAT = _given(
    MAX_TOKENS=env.int("CHAT_MAX_TOKENS", default=None),
    TEMPERATURE=env.float("CHAT_TEMPERATURE", default=None),
    SYSTEM_PROMPT=env.str("CHAT_SYSTEM_PROMPT", default=None),
    # How long an answer goes on after its page went away, for the page to come back (s).
    RESUME_GRACE_S=env.float("CHAT_RESUME_GRACE_S", default=None),
)
DASHBOARD = _given(
    SNAPSHOT_INTERVAL_S=env.float("STATS_SNAPSHOT_INTERVAL_S", default=None),
    SNAPSHOT_RETENTION_S=env.float("STATS_SNAPSHOT_RETENTION_S", default=None),
    CLEANUP_INTERVAL_S=env.float("CLEANUP_INTERVAL_S", default=None),
    # Bearer token a Prometheus scrape may use for GET /metrics (besides operator API keys).
    METRICS_TOKEN=env.str("METRICS_TOKEN", default=None),
)
# Celery beat (started by the run command): snapshots for the dashboard, housekeeping.
CELERY_BEAT_SCHEDULE = {
    **beat_schedule(DASHBOARD),
    # Ends what no live process would (a dead worker's requests when no worker lives, expired
    # requests), and records usage whose task was lost (gateway.housekeeping, gateway.usage).
    "sweep-queue": {"task": "gateway.tasks.sweep_queue",
                    "schedule": env.float("SWEEP_INTERVAL_S", default=2.0)},
    "reconcile-usage": {"task": "gateway.tasks.reconcile_usage",
                        "schedule": env.float("USAGE_RECONCILE_INTERVAL_S", default=10.0)},
    # Stored responses (the Responses API) past RESPONSES_RETENTION_S are purged (those whose
    # web process died mid-answer are ended by the queue sweep: api.tasks).
    "purge-responses": {"task": "api.tasks.purge_responses",
                        "schedule": env.float("RESPONSES_PURGE_INTERVAL_S", default=3600.0)},
    # The Batch API: each step validates, feeds, collects and finalizes every active batch a
    # bounded amount (api.batch_runner), so the other tasks are never held up behind it.
    "advance-batches": {"task": "api.tasks.advance_batches",
                        "schedule": env.float("BATCH_STEP_INTERVAL_S", default=1.0)},
    # Files (the Files API) past their expires_at are deleted, rows and stored bytes.
    "purge-files": {"task": "api.tasks.purge_files",
                    "schedule": env.float("FILES_PURGE_INTERVAL_S", default=3600.0)},
}
