"""Fixtures shared by the end-to-end test modules."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx
import openai

from benchmarks.harness.stack import Stack, database_url

MODEL = "SmolLM2-135M-Instruct"
# Heartbeats of the test platforms: short, so that a process killed or restarted by a test is
# judged within seconds (a test may set its own).
TEST_HEARTBEATS = {"WORKER_HEARTBEAT_TTL_S": 3, "WEB_HEARTBEAT_TTL_S": 3,
                   "HEARTBEAT_INTERVAL_S": 0.5}


def start_stack(request, django_db_blocker, tmp_path_factory, *, workers: int,
                **env: Any) -> Stack:
    from django.conf import settings
    from django.db import connection

    with django_db_blocker.unblock():
        db_url = database_url(connection.settings_dict)
    env = {**TEST_HEARTBEATS, **env}
    stack = Stack(db_url, settings.REDIS_URL, tmp_path_factory.mktemp("stack"),
                  workers=workers, **{k: str(v) for k, v in env.items()})
    request.addfinalizer(stack.stop)
    try:
        stack.start()
    except Exception:
        print(stack.logs())
        raise
    return stack


def client(stack: Stack, raw_key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key=raw_key, max_retries=0, timeout=120)


def stats(stack: Stack, operator_key: str) -> dict:
    return httpx.get(f"{stack.url}/scheduler/stats",
                     headers={"Authorization": f"Bearer {operator_key}"}, timeout=5).json()


def wait_for(predicate: Callable[[], Any], timeout_s: float = 10, every_s: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(every_s)
