"""Where a workload's requests go, and the runner that sends them.

A :class:`Target` sends one request and fills in its
:class:`~benchmarks.harness.metrics.RequestResult`:
:class:`RestTarget` is the platform's REST API (``POST /v1/completions`` with SSE streaming, one
API key per tenant), :class:`EngineTarget` the engine in-process. :func:`run_load` sends a
workload to a target with open-loop arrivals (each request at its ``arrival_s``, e.g. Poisson)
and an optional bound on requests in flight (fixed concurrency: every ``arrival_s`` 0 and a
bound).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from tqdm import tqdm

from benchmarks.harness.metrics import RequestResult
from benchmarks.harness.workload import RequestSpec
from gateway.errors import STATUS_BY_CODE


class Target(Protocol):
    """Where requests go: ``send`` one request, filling in ``result`` (its ``sent_s`` is set)
    as it goes, so that a cancelled request keeps what it saw so far."""

    async def send(self, spec: RequestSpec, clock: Callable[[], float],
                   result: RequestResult) -> None: ...


class RestTarget:
    """The platform's OpenAI-compatible REST API: ``POST /v1/completions``, streamed (SSE), one
    API key per tenant, greedy, ``ignore_eos`` as the spec says.

    Use as ``async with RestTarget(url, keys) as target``.
    """

    def __init__(self, base_url: str, keys: dict[str, str],
                 model: str = "SmolLM2-135M-Instruct", timeout_s: float = 600,
                 keepalive: bool = True):
        import httpx

        self.url = base_url.rstrip("/") + "/v1/completions"
        self.keys = keys
        self.model = model
        # keepalive False: a connection per request (llama-server closes kept-alive ones after a
        # few requests, and a request sent as it closes fails).
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s),
            limits=httpx.Limits(max_connections=None,
                                max_keepalive_connections=256 if keepalive else 0))

    async def __aenter__(self) -> RestTarget:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._client.aclose()

    async def send(self, spec: RequestSpec, clock: Callable[[], float],
                   result: RequestResult) -> None:
        body = {"model": self.model, "prompt": spec.prompt, "max_tokens": spec.max_tokens,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
                "ignore_eos": spec.ignore_eos}
        headers = {"Authorization": f"Bearer {self.keys[spec.tenant]}"}
        try:
            async with self._client.stream("POST", self.url, json=body,
                                           headers=headers) as resp:
                result.http_status = resp.status_code
                if resp.status_code != 200:
                    text = (await resp.aread()).decode(errors="replace")
                    result.status = "rejected" if resp.status_code == 429 else "error"
                    result.error = text[:300]
                    return
                async for read_at, line in _lines_by_read(resp, clock):
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: "):]
                    if data == "[DONE]":
                        result.status = "ok"
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        result.error = json.dumps(chunk["error"])[:300]
                        break
                    if chunk.get("choices") and chunk["choices"][0].get("text"):
                        # A chunk time per delivery: the tokens one read brought share one.
                        if not result.chunk_times_s or result.chunk_times_s[-1] != read_at:
                            result.chunk_times_s.append(read_at)
                        result.output_tokens += 1  # until the usage chunk says exactly
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                        result.prompt_tokens = usage.get("prompt_tokens", 0)
                        result.output_tokens = usage.get("completion_tokens", 0)
                        details = usage.get("prompt_tokens_details") or {}
                        result.cached_prompt_tokens = details.get("cached_tokens", 0) or 0
        except Exception as exc:  # noqa: BLE001 - a failed request is counted, not fatal
            result.status = "error"
            result.error = f"{type(exc).__name__}: {exc}"[:300]
        finally:
            result.ended_s = clock()


async def _lines_by_read(resp: Any,
                         clock: Callable[[], float]) -> AsyncIterator[tuple[float, str]]:
    """The lines of a streamed response, each with the ``clock()`` of the network read that
    completed it: the tokens a server sends in one write (several SSE events) are one delivery,
    and the ITL is measured between deliveries."""
    rest = ""
    async for text in resp.aiter_text():
        at = clock()
        *lines, rest = (rest + text).split("\n")
        for line in lines:
            yield at, line.rstrip("\r")
    if rest:
        yield clock(), rest


@dataclass
class TenantSettings:
    """How the in-process target submits a tenant's requests (what the web tier would set)."""

    priority: int = 0
    fairness_weight: float = 1.0


class EngineTarget:
    """The engine in-process, on its own worker thread (as in the worker process, without Redis
    or the web tier), each request under its spec's LoRA adapter (if any). Token times are taken
    in the engine's event sink, when each tick ends.

    Use as ``async with EngineTarget(engine) as target``; the engine is started on entry and
    shut down on exit.
    """

    def __init__(self, engine: Any, tenants: dict[str, TenantSettings] | None = None):
        self.engine = engine
        self.tenants = tenants or {}
        self._queues: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._count = 0

    async def __aenter__(self) -> EngineTarget:
        self._loop = asyncio.get_running_loop()
        self.engine.event_sink = self._sink
        self.engine.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.engine.shutdown)

    def _sink(self, events: list[Any]) -> None:
        # On the engine thread, once per tick: one hop to the event loop for all its events.
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._dispatch, time.perf_counter(), events)

    def _dispatch(self, at: float, events: list[Any]) -> None:
        for event in events:
            q = self._queues.get(event.request_id)
            if q is not None:
                q.put_nowait((at, event))

    async def send(self, spec: RequestSpec, clock: Callable[[], float],
                   result: RequestResult) -> None:
        from inference.engine.llm_engine import EngineRefusal
        from inference.engine.request import FinalEvent, SamplingParams

        self._count += 1
        rid = f"bench-{self._count}"
        settings = self.tenants.get(spec.tenant, TenantSettings())
        q: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = q
        offset = time.perf_counter() - result.sent_s  # perf_counter -> run clock
        try:
            handle = self.engine.submit(
                prompt=spec.prompt, request_id=rid, tenant=spec.tenant,
                priority=settings.priority, fairness_weight=settings.fairness_weight,
                sampling=SamplingParams(max_tokens=spec.max_tokens, ignore_eos=spec.ignore_eos),
                adapter=spec.adapter)
        except EngineRefusal as exc:
            self._queues.pop(rid)
            result.http_status = STATUS_BY_CODE[exc.error.code]
            result.status = "rejected" if result.http_status == 429 else "error"
            result.error = _error_body(exc.error)
            result.ended_s = clock()
            return
        result.prompt_tokens = handle.prompt_len
        try:
            while True:
                at, event = await q.get()
                if isinstance(event, FinalEvent):
                    break
                if event.text:
                    result.chunk_times_s.append(at - offset)
                    result.output_tokens += 1
        except asyncio.CancelledError:
            self.engine.abort(rid)
            raise
        finally:
            self._queues.pop(rid)
        result.ended_s = at - offset
        if event.finish_reason == "error":
            result.http_status = STATUS_BY_CODE[event.error.code] if event.error else 500
            result.status = "rejected" if result.http_status == 429 else "error"
            result.error = _error_body(event.error) if event.error else "error"
        else:
            result.status, result.http_status = "ok", 200
            result.output_tokens = event.usage.completion_tokens
            result.cached_prompt_tokens = event.usage.cached_prompt_tokens
        if event.text and result.chunk_times_s:
            result.chunk_times_s.append(at - offset)


def _error_body(error: Any) -> str:
    """An engine error as the REST API's body (``{"error": {"code", "message"}}``)."""
    return json.dumps({"error": {"code": getattr(error, "code", "") or "",
                                 "message": str(error.message)[:300]}})


# --------------------------------------------------------------------------- the runner


async def run_load(target: Target, specs: Sequence[RequestSpec], *,
                   max_concurrency: int | None = None, desc: str = "requests",
                   sample: Callable[[float], Awaitable[None] | None] | None = None,
                   sample_every_s: float = 0.25, stop_at_s: float | None = None,
                   background_tags: Iterable[str] = ()) -> tuple[list[RequestResult], float]:
    """Send every request at its ``arrival_s`` (at most ``max_concurrency`` in flight; the rest
    wait their turn), with a tqdm bar of completed requests.

    Args:
        sample: called with the run clock every ``sample_every_s`` while the run lasts (to record
            the server's stats over time); may be a coroutine function.
        stop_at_s: cancel what is still in flight at this time (seconds).
        background_tags: requests with these tags only load the server: the run ends when every
            other request has ended, and background requests still in flight are cancelled.

    Cancelled requests keep what they saw (status ``cancelled``, not counted as completed);
    requests never sent are left out.

    Returns:
        The results in the order of ``specs`` and the run's duration (seconds, first send to
        last end); ``([], 0.0)`` for an empty workload.
    """
    if not specs:
        return [], 0.0
    t0 = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - t0

    background = set(background_tags)
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    # A time-limited run shows its seconds (most of its requests may never be sent).
    if stop_at_s is None:
        bar = tqdm(total=len(specs), desc=desc, unit="req", dynamic_ncols=True)
    else:
        bar = tqdm(total=round(stop_at_s, 1), desc=desc, unit="s", dynamic_ncols=True,
                   bar_format="{l_bar}{bar}| {n:.1f}/{total:.1f} s{postfix}")
    ended = 0
    results: list[RequestResult | None] = [None] * len(specs)

    async def one(i: int, spec: RequestSpec) -> None:
        delay = spec.arrival_s - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        if gate is not None:
            await gate.acquire()
        result = results[i] = RequestResult(spec.tenant, spec.tag, "error", 0, clock(),
                                            arrival_s=spec.arrival_s,
                                            max_tokens=spec.max_tokens)
        try:
            await target.send(spec, clock, result)
        except asyncio.CancelledError:
            result.status, result.ended_s = "cancelled", clock()
            raise
        finally:
            if gate is not None:
                gate.release()
        nonlocal ended
        ended += 1
        if stop_at_s is None:
            bar.update(1)

    async def ticker() -> None:
        while True:
            bar.n = round(min(clock(), bar.total), 1)
            bar.set_postfix_str(f"{ended} requests done", refresh=True)
            await asyncio.sleep(0.5)

    async def sampler() -> None:
        while True:
            value = sample(clock())
            if asyncio.iscoroutine(value):
                await value
            await asyncio.sleep(sample_every_s)

    sampling = asyncio.create_task(sampler()) if sample else None
    ticking = asyncio.create_task(ticker()) if stop_at_s is not None else None
    tasks = [asyncio.create_task(one(i, s)) for i, s in enumerate(specs)]
    foreground = [t for t, s in zip(tasks, specs, strict=True) if s.tag not in background]
    timeout = None if stop_at_s is None else max(0.0, stop_at_s - clock())
    try:
        await asyncio.wait(foreground or tasks, timeout=timeout)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        if sampling is not None:
            sampling.cancel()
        if ticking is not None:
            ticking.cancel()
            bar.n = bar.total  # the run is over: its time is up or every request ended
            bar.set_postfix_str(f"{ended} requests done", refresh=False)
        bar.close()
    done = [r for r in results if r is not None]
    duration = (max((r.ended_s for r in done), default=0.0)
                - min((r.sent_s for r in done), default=0.0))
    return done, duration
