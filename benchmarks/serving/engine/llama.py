"""llama.cpp's ``llama-server`` as a system of the engine benchmark (``llama_server:bfloat16``
and ``llama_server:q4_1``): the server started once in the system's process with one slot per
request in flight, fed the workload's token ids by the same closed-loop client through its OpenAI
endpoint (``POST /v1/completions``, streamed, greedy, EOS ignored).

A token's time is when its SSE chunk is read. The server sends one chunk per token; a run whose
chunks and ``usage.completion_tokens`` disagree, or whose ``usage.prompt_tokens`` is not the
prompt's length (the server added a token, say), fails rather than report figures of other
tokens.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from benchmarks.harness.llama_server import LlamaServer
from benchmarks.serving.engine.workloads import Spec, Trace, Workload

WEIGHTS = {"bfloat16": "bf16", "q4_1": "q4_1"}
_SERVER: LlamaServer | None = None


def _server(dtype: str, plan: Workload) -> LlamaServer:
    """The process's one server, sized for ``plan`` (slots and context per slot)."""
    global _SERVER
    if _SERVER is None:
        longest = max(len(s.prompt) + s.max_tokens for s in plan.requests)
        _SERVER = LlamaServer(WEIGHTS[dtype], parallel=plan.concurrency,
                              ctx_per_slot=longest + 16).__enter__()
    return _SERVER


def close() -> None:
    """Stop the process's server, if one was started."""
    global _SERVER
    if _SERVER is not None:
        _SERVER.__exit__(None, None, None)
        _SERVER = None


def run_llama_server(dtype: str, wl: Workload, plan: Workload) -> list[Trace]:
    """``wl`` through the server's OpenAI endpoint, ``wl.concurrency`` requests in flight.

    Raises:
        RuntimeError: a request failed, or its token counts disagree with the request.
    """
    server = _server(dtype, plan)
    return asyncio.run(_closed_loop(server.url, server.model_name, wl))


async def _closed_loop(url: str, model: str, wl: Workload) -> list[Trace]:
    traces = [Trace(0.0, []) for _ in wl.requests]
    todo = iter(enumerate(wl.requests))
    async with httpx.AsyncClient(timeout=httpx.Timeout(600),
                                 limits=httpx.Limits(max_connections=None)) as client:

        async def loop() -> None:
            for i, spec in todo:  # one shared iterator: each lane takes the next request
                traces[i].submitted = time.perf_counter()
                await _one(client, url, model, spec, traces[i])

        await asyncio.gather(*(loop() for _ in range(wl.concurrency)))
    return traces


async def _one(client: httpx.AsyncClient, url: str, model: str, spec: Spec,
               trace: Trace) -> None:
    body = {"model": model, "prompt": spec.prompt, "max_tokens": spec.max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True}
    usage: dict = {}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"llama-server answered {resp.status_code}: "
                               f"{(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                trace.token_times.append(time.perf_counter())
            usage = chunk.get("usage") or usage
    made, read = usage.get("completion_tokens"), usage.get("prompt_tokens")
    if made != spec.max_tokens or len(trace.token_times) != made:
        raise RuntimeError(f"llama-server made {made} tokens in {len(trace.token_times)} chunks "
                           f"for max_tokens {spec.max_tokens}")
    if read != len(spec.prompt):
        raise RuntimeError(f"llama-server read {read} prompt tokens, sent {len(spec.prompt)}")
