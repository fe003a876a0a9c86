"""llama.cpp's ``llama-server`` as a system of the engine benchmark (``llama_server:bfloat16``
and ``llama_server:q4_1``): the server started once in the system's process with one slot per
request in flight, fed the workload's token ids by the same closed-loop client through its
completion endpoint (``POST /completion``, streamed, greedy, EOS ignored).

A token's time is when the SSE chunk that carries it is read. The server holds back a token
whose text ends inside a UTF-8 character and sends it with the next one (two tokens of one
``－``, say); each chunk's ``tokens_predicted`` counts every token so far, so the chunk carries
the new ones, and each gets the chunk's time: when a client could first see it. The OpenAI
endpoint (``/v1/completions``) sends the same chunks without saying how many tokens each
carries; the REST comparison
(:mod:`benchmarks.serving.llama_cpp`) uses it, with ITL per chunk on both sides. A run whose
tokens and the server's ``tokens_predicted`` disagree, or whose ``tokens_evaluated`` is not the
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
    # A connection per request: llama-server (cpp-httplib) closes a kept-alive connection after
    # a few requests, and a request sent on it as it closes fails ("Server disconnected").
    async with httpx.AsyncClient(timeout=httpx.Timeout(600),
                                 limits=httpx.Limits(max_connections=None,
                                                     max_keepalive_connections=0)) as client:

        async def loop() -> None:
            for i, spec in todo:  # one shared iterator: each lane takes the next request
                traces[i].submitted = time.perf_counter()
                await _one(client, url, model, spec, traces[i])

        await asyncio.gather(*(loop() for _ in range(wl.concurrency)))
    return traces


async def _one(client: httpx.AsyncClient, url: str, model: str, spec: Spec,
               trace: Trace) -> None:
    body = {"model": model, "prompt": spec.prompt, "n_predict": spec.max_tokens,
            "temperature": 0, "stream": True, "ignore_eos": True}
    last: dict = {}
    async with client.stream("POST", f"{url}/completion", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"llama-server answered {resp.status_code}: "
                               f"{(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            now = time.perf_counter()
            # tokens_predicted counts every token so far: the chunk carries the new ones.
            new = int(chunk.get("tokens_predicted") or 0) - len(trace.token_times)
            trace.token_times.extend(now for _ in range(new))
            last = chunk
    made, read = last.get("tokens_predicted"), last.get("tokens_evaluated")
    if made != spec.max_tokens or len(trace.token_times) != made:
        raise RuntimeError(f"llama-server made {made} tokens, {len(trace.token_times)} streamed, "
                           f"for max_tokens {spec.max_tokens}")
    if read != len(spec.prompt):
        raise RuntimeError(f"llama-server read {read} prompt tokens, sent {len(spec.prompt)}")
