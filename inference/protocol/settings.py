"""The settings the web tier and the workers both read, from the environment."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import Field, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from inference.protocol.keys import Keys
from inference.protocol.models import adapter_root, model_cache_dir, model_folder
from inference.protocol.structured import DEFAULT_MAX_SPEC_BYTES

# A base model's name (the API's `model`; the registry's): '/'-separated segments, each starting
# with a letter or digit (no empty, '.' or '..' segment); no ':' (the `base:adapter` form), '@'
# (the queue's key names, inference.protocol.keys.Keys), '*' (access patterns) nor whitespace;
# at most MODEL_NAME_MAX characters.
MODEL_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)*$"
MODEL_NAME_MAX = 128


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
    redis_prefix: str = Field("llm", min_length=1, pattern=r"^[^@\s]+$")
    # The deployment's default model: its name in the OpenAI API, served by the workers started
    # without MODEL_NAME (docs/platform.md, "Models and model access").
    served_model_name: str = "SmolLM2-135M-Instruct"
    # The base model a worker serves, by its registered name; empty: SERVED_MODEL_NAME. Its
    # requests wait in that model's own queue (Keys.of_model); MODEL_PATH is its folder.
    model_name: str = ""
    # Gate 1: requests accepted and not yet admitted by any worker, over the whole deployment.
    max_queue_size: int = Field(256, ge=1)
    # A request not admitted this long after the web tier accepted it ends with queue_timeout,
    # whether it still waits in Redis or in a worker's pending queue. 0 disables the deadline.
    max_queue_wait_s: float = Field(120.0, ge=0)
    # A worker whose heartbeat is older than this is dead.
    worker_heartbeat_ttl_s: float = Field(10.0, gt=0)
    # A web process whose heartbeat is older than this is dead: workers stop generating the
    # answers it was streaming (their clients are gone with it).
    web_heartbeat_ttl_s: float = Field(10.0, gt=0)
    # Celery's broker (usage reports go through it); empty: REDIS_URL.
    celery_broker_url: str = ""
    # Celery's queue; empty: "{REDIS_PREFIX}-celery", so deployments sharing a Redis keep apart.
    celery_task_default_queue: str = ""
    # The largest structured-output spec a request may give (UTF-8 bytes: a JSON schema as
    # compact JSON, a regex, a grammar, a choice list); a larger one gets a 400 naming its field.
    structured_max_spec_bytes: int = Field(DEFAULT_MAX_SPEC_BYTES, ge=1)
    # A local Hugging Face causal-LM folder; empty: the prepared default model. The worker loads
    # it; the web tier reads its tokenizer unless TOKENIZER_PATH names another folder.
    model_path: str = ""
    # Where the default model is prepared; empty: .cache/models at the repository root.
    llm_cache_dir: str = ""
    log_level: str = "INFO"
    # LoRA adapters (docs/platform.md, "LoRA adapters"): the one folder their files live under
    # (uploads are written there; a worker loads no adapter outside it); empty:
    # <repo>/.cache/adapters.
    adapter_root: str = ""
    # The largest LoRA rank an adapter may have (the registry refuses a larger one; the worker
    # refuses to load one).
    max_lora_rank: int = Field(64, ge=1, le=1024)

    @field_validator("served_model_name", "model_name")
    @classmethod
    def _model_name(cls, value: str, info: ValidationInfo) -> str:
        if value == "" and info.field_name == "model_name":
            return value
        if len(value) > MODEL_NAME_MAX or re.fullmatch(MODEL_NAME_PATTERN, value) is None:
            raise ValueError(f"{info.field_name.upper()}={value!r} is not a model name: "
                             f"'/'-separated parts of letters, digits, '.', '_' and '-', each "
                             f"starting with a letter or digit (no ':', '@', '*' or "
                             f"whitespace), at most {MODEL_NAME_MAX} characters")
        return value

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
        """The deployment's keys, with the queue of the model this process serves
        (:attr:`served_model`)."""
        return Keys(self.redis_prefix).of_model(self.served_model, self.served_model_name)

    @property
    def served_model(self) -> str:
        """The base model a worker serves: ``MODEL_NAME``, else ``SERVED_MODEL_NAME``."""
        return self.model_name or self.served_model_name

    @property
    def model_folder(self) -> Path:
        """The model's folder: ``MODEL_PATH``, else the default model's (prepared or not)."""
        return model_folder(self.model_path, self.llm_cache_dir)

    @property
    def adapter_folder(self) -> Path:
        """The folder LoRA adapters live under (``ADAPTER_ROOT``), resolved (symlinks
        followed)."""
        return adapter_root(self.adapter_root)

    @property
    def model_cache_dir(self) -> Path:
        """The folder holding prepared models (``LLM_CACHE_DIR``)."""
        return model_cache_dir(self.llm_cache_dir)
