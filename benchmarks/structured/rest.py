"""The platform side: daphne, one inference worker on the real model (``BACKEND=transformers``,
its default dtype) and Celery, started by the harness (:class:`benchmarks.harness.servers
.Platform`), and the structured workload sent with the ``openai`` client to ``POST
/v1/chat/completions`` with ``response_format={"type": "json_schema", ...}`` (not streamed; the
usage of each answer counts its tokens), a closed loop at ``concurrency`` in flight."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from benchmarks.harness.servers import Platform, TenantSpec
from benchmarks.structured.schemas import Answer, Task, one_per_schema


def response_format(task: Task) -> dict[str, Any]:
    """OpenAI's ``response_format`` asking for the task's schema (``strict``)."""
    return {"type": "json_schema",
            "json_schema": {"name": task.schema, "schema": task.schema_json, "strict": True}}


async def _send(client: Any, model: str, task: Task, *, max_tokens: int, temperature: float,
                seed: int) -> Answer:
    extra: dict[str, Any] = {"seed": seed} if temperature else {}
    resp = await client.chat.completions.create(
        model=model, messages=task.messages, max_tokens=max_tokens, temperature=temperature,
        response_format=response_format(task), **extra)
    choice = resp.choices[0]
    return Answer(task.schema, choice.message.content or "", choice.finish_reason or "",
                  resp.usage.completion_tokens if resp.usage else 0)


async def _closed_loop(client: Any, model: str, tasks: list[Task], *, concurrency: int,
                       max_tokens: int, temperature: float, seed: int
                       ) -> tuple[list[Answer], float]:
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int, task: Task) -> Answer:
        async with gate:
            try:
                return await _send(client, model, task, max_tokens=max_tokens,
                                   temperature=temperature, seed=seed + i)
            except Exception as exc:  # noqa: BLE001 - a failed request is counted, not fatal
                return Answer(task.schema, f"{type(exc).__name__}: {exc}"[:300], "error", 0)

    started = time.perf_counter()
    answers = await asyncio.gather(*(one(i, t) for i, t in enumerate(tasks)))
    return list(answers), time.perf_counter() - started


def run_rest(tasks: list[Task], *, concurrency: int, max_tokens: int, temperature: float = 0.0,
             seed: int = 0, cpu_meter: Any = None,
             **worker_env: Any) -> tuple[list[Answer], float, dict[str, Any]]:
    """The workload through the platform's REST API, after a warm-up of one 4-token request
    per schema (every grammar compiled on the worker once).

    Args:
        cpu_meter: called as ``cpu_meter(pids)`` before the measured run and again after it,
            with the platform's process ids (to tell its CPU time from other processes').
        worker_env: settings for the platform's processes (``STRUCTURED_JUMP_FORWARD``, ...).

    Returns:
        The answers in task order, the measured run's wall seconds and the worker's stats
        snapshot (``/scheduler/stats``, its ``structured`` counters where it publishes them).
    """
    from openai import AsyncOpenAI

    env = {"BACKEND": "transformers", **worker_env}
    with Platform([TenantSpec("bench")], **env) as platform:
        stack = platform.stack
        assert stack is not None
        pids = [p.pid for p in stack.workers + stack.others] + [os.getpid()]

        async def main() -> tuple[list[Answer], float]:
            client = AsyncOpenAI(base_url=f"{platform.url}/v1", api_key=platform.keys["bench"],
                                 max_retries=0, timeout=900)
            try:
                model = (await client.models.list()).data[0].id
                # One at a time: the worker caps a tenant's grammar compiles in flight.
                warm, _ = await _closed_loop(client, model, one_per_schema(tasks),
                                             concurrency=1, max_tokens=4, temperature=0.0,
                                             seed=0)
                failed = [a.text for a in warm if a.finish_reason == "error"]
                if failed:
                    raise RuntimeError(f"the REST warm-up failed: {failed[0]}")
                if cpu_meter is not None:
                    cpu_meter(pids)
                out = await _closed_loop(client, model, tasks, concurrency=concurrency,
                                         max_tokens=max_tokens, temperature=temperature,
                                         seed=seed)
                if cpu_meter is not None:
                    cpu_meter(pids)
                return out
            finally:
                await client.close()

        answers, wall = asyncio.run(main())
        time.sleep(1.5)  # a stats period: the worker's snapshot after the run
        try:
            stats = platform.stats()
        except Exception:  # noqa: BLE001 - the figures stand without it
            stats = {}
    return answers, wall, stats
