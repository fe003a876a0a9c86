"""The load: client loops sending completions, each request one attempt with a hard timeout,
recorded as the client saw it (:class:`Result`: what it received and when) and classified into
an outcome (:func:`classify`); :class:`Steer` is what the faults ask of it."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from benchmarks.serving.chaos.settings import ADMISSION_CODES, MODEL, PROMPTS, TENANTS, Options
from benchmarks.serving.chaos.timeline import Timeline


@dataclass
class Result:
    """One request as the client saw it (times in seconds since the run's start)."""

    index: int
    tenant: str
    prompt: int
    max_tokens: int
    stream: bool
    start: float = 0.0
    end: float = 0.0
    request_id: str = ""
    status: int | None = None
    text: str = ""
    finish_reason: str | None = None
    done: bool = False  # saw "data: [DONE]"
    error: dict[str, Any] | None = None  # the JSON error (body or SSE event)
    retry_hint: bool = False
    usage_completion: int | None = None
    retryable: bool = False  # told it may retry: `retryable` in an error event, Retry-After
    ending: str = ""  # how the exchange ended: eof, timeout, connect_error, conn_lost, body
    detail: str = ""
    max_silence_s: float = 0.0
    max_no_data_s: float = 0.0
    data_events: int = 0
    keepalives: int = 0
    after_end: int = 0
    outcome: str = ""
    why: str = ""
    # When its tokens arrived: (seconds since the run's start, tokens), one entry per SSE event
    # that carried text (a stream), or one for the whole body (an answer not streamed).
    arrivals: list[tuple[float, int]] = field(default_factory=list)

    @property
    def code(self) -> str | None:
        return (self.error or {}).get("code")

    @property
    def received(self) -> int:
        """The completion tokens its client received: a stream's characters (one token each with
        the reference backend's byte tokenizer), an answer's ``usage.completion_tokens``."""
        if self.stream or self.usage_completion is None:
            return len(self.text)
        return self.usage_completion

    def received_since(self, t: float) -> int:
        """The tokens that arrived at or after ``t`` (seconds since the run's start)."""
        return sum(n for at, n in self.arrivals if at >= t)


# The most requests one burst sends (beside the client loops).
MAX_BURST = 40


@dataclass
class Steer:
    """What the faults ask of the load: the next ``long_plain`` requests sent go out not
    streamed, with the largest ``max_tokens`` (so that a web drain has answers not streamed in
    flight, some longer than the drain); a ``burst`` of that many requests at once (at most
    :data:`MAX_BURST`), each one attempt, beside the client loops (so that a worker paused
    holds requests it has taken and not started)."""

    long_plain: int = 0
    burst: int = 0


class Silence:
    """One request's longest wait without a byte (a keep-alive comment counts) and without data
    (an SSE data event, or the body)."""

    def __init__(self) -> None:
        self.last_byte = self.last_data = time.monotonic()
        self.longest = self.longest_data = 0.0

    def tick(self, data: bool = False) -> None:
        now = time.monotonic()
        self.longest = max(self.longest, now - self.last_byte)
        self.last_byte = now
        if data:
            self.longest_data = max(self.longest_data, now - self.last_data)
            self.last_data = now


# -- the load ----------------------------------------------------------------------------------


def parse_sse_event(result: Result, raw: str) -> None:
    """Record one SSE event (the text between two blank lines) on ``result``: its text,
    finish reason, usage, error, ``[DONE]``, keep-alive comments and data after the end.

    Raises:
        ValueError: for a line that is neither a comment nor ``data:``, or data that is not
            JSON.
    """
    for line in raw.split("\n"):
        if not line or line.startswith(":"):
            result.keepalives += line.startswith(":")
            continue
        if not line.startswith("data:"):
            raise ValueError(f"not an SSE data line: {line[:80]!r}")
        payload = line[5:].strip()
        result.data_events += 1
        if payload == "[DONE]":
            result.done = True
            continue
        if result.done or result.error is not None:
            result.after_end += 1
        obj = json.loads(payload)
        if "error" in obj:
            result.error = obj["error"]
            hints = ("retryable", "retry_after", "retry_after_s", "retry_after_ms")
            where = {**(obj["error"].get("details") or {}), **obj["error"]}
            result.retry_hint = result.retry_hint or any(k in where for k in hints)
            result.retryable = result.retryable or where.get("retryable") is True or (
                "retry_after_ms" in where)
            continue
        if obj.get("id"):
            result.request_id = result.request_id or obj["id"].removeprefix("cmpl-")
        for choice in obj.get("choices") or []:
            result.text += choice.get("text") or ""
            if choice.get("finish_reason"):
                result.finish_reason = choice["finish_reason"]
        if obj.get("usage"):
            result.usage_completion = obj["usage"].get("completion_tokens")


def _parse_body(result: Result, body: bytes) -> None:
    obj = json.loads(body)
    if "error" in obj:
        result.error = obj["error"]
        return
    result.request_id = obj.get("id", "").removeprefix("cmpl-")
    choice = (obj.get("choices") or [{}])[0]
    result.text = choice.get("text") or ""
    result.finish_reason = choice.get("finish_reason")
    result.usage_completion = (obj.get("usage") or {}).get("completion_tokens")


async def _exchange(client: httpx.AsyncClient, url: str, key: str, body: dict[str, Any],
                    result: Result, silence: Silence, clock: Callable[[], float]) -> None:
    headers = {"Authorization": f"Bearer {key}"}
    async with client.stream("POST", url, json=body, headers=headers) as response:
        silence.tick()
        result.status = response.status_code
        result.retry_hint = ("retry-after" in response.headers
                             or "x-should-retry" in response.headers)
        result.retryable = "retry-after" in response.headers
        if response.status_code != 200 or not body["stream"]:
            raw = b""
            async for chunk in response.aiter_bytes():
                silence.tick()
                raw += chunk
            silence.tick(data=True)
            result.ending = "body"
            try:
                _parse_body(result, raw)
            except (ValueError, AttributeError) as exc:
                result.detail = f"unparsable body ({exc}): {raw[:200]!r}"
            if result.received:
                result.arrivals.append((clock(), result.received))
            return
        buffer = ""
        async for chunk in response.aiter_text():
            silence.tick()
            buffer += chunk
            while "\n\n" in buffer:
                raw, buffer = buffer.split("\n\n", 1)
                before, chars = result.data_events, len(result.text)
                try:
                    parse_sse_event(result, raw)
                except (ValueError, AttributeError) as exc:
                    result.detail = f"unparsable event ({exc}): {raw[:200]!r}"
                if result.data_events > before:
                    silence.tick(data=True)
                if len(result.text) > chars:
                    result.arrivals.append((clock(), len(result.text) - chars))
        if buffer.strip():
            result.detail = result.detail or f"stream ended mid-event: {buffer[:200]!r}"
        result.ending = "eof"


async def send_one(client: httpx.AsyncClient, url: str, key: str, result: Result,
                   timeout_s: float, clock: Callable[[], float]) -> None:
    """Send one request (one attempt) and record what the client saw; never raises."""
    body: dict[str, Any] = {"model": MODEL, "prompt": PROMPTS[result.prompt],
                            "max_tokens": result.max_tokens, "temperature": 0,
                            "stream": result.stream}
    if result.stream:
        body["stream_options"] = {"include_usage": True}
    silence = Silence()
    result.start = clock()
    try:
        await asyncio.wait_for(_exchange(client, url, key, body, result, silence, clock),
                               timeout_s)
    except TimeoutError:
        result.ending = "timeout"
    except httpx.ConnectError as exc:
        result.ending, result.detail = "connect_error", repr(exc)
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
        result.ending, result.detail = "conn_lost", repr(exc)
    except httpx.HTTPError as exc:
        result.ending, result.detail = "http_error", repr(exc)
    silence.tick(data=True)
    result.max_silence_s = silence.longest
    result.max_no_data_s = silence.longest_data
    result.end = clock()


async def drive_load(url: str, keys: dict[str, str], options: Options, stop_at: float,
                     clock: Callable[[], float], results: list[Result] | None = None,
                     steer: Steer | None = None) -> list[Result]:
    """``options.concurrency`` client loops until ``stop_at`` (on ``clock``), and the bursts
    ``steer`` asks for; every request, appended to ``results`` as it is sent (the faults watch
    what is in flight)."""
    results = [] if results is None else results
    steer = steer or Steer()
    limits = httpx.Limits(max_connections=options.concurrency + MAX_BURST + 4,
                          max_keepalive_connections=0)
    timeout = httpx.Timeout(connect=5, read=options.request_timeout_s + 5, write=5, pool=5)
    endpoint = f"{url}/v1/completions"

    async def one(rng: random.Random, client: httpx.AsyncClient) -> Result:
        result = Result(index=len(results), tenant=rng.choice(TENANTS),
                        prompt=rng.randrange(len(PROMPTS)),
                        max_tokens=rng.randint(*options.max_tokens),
                        stream=rng.random() < options.stream_fraction)
        if steer.long_plain > 0:
            steer.long_plain -= 1
            result.stream, result.max_tokens = False, options.max_tokens[1]
        results.append(result)
        await send_one(client, endpoint, keys[result.tenant], result,
                       options.request_timeout_s, clock)
        return result

    async def loop(n: int, client: httpx.AsyncClient) -> None:
        rng = random.Random(f"{options.seed}-client-{n}")
        while clock() < stop_at:
            result = await one(rng, client)
            if result.ending == "connect_error" or result.status in (429, 503):
                await asyncio.sleep(0.25)  # the client's own pacing, not a retry

    async def bursts(client: httpx.AsyncClient) -> None:
        rng = random.Random(f"{options.seed}-bursts")
        sent: list[asyncio.Task[Result]] = []
        while clock() < stop_at:
            n, steer.burst = min(steer.burst, MAX_BURST), 0
            sent.extend(asyncio.create_task(one(rng, client)) for _ in range(n))
            await asyncio.sleep(0.05)
        await asyncio.gather(*sent)

    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        await asyncio.gather(bursts(client),
                             *(loop(n, client) for n in range(options.concurrency)))
    return results


def classify(result: Result, timeline: Timeline) -> None:
    """Set ``result.outcome`` (and ``why`` when unclear) from what the client saw."""
    daphne_down = timeline.daphne_down_during(result.start, result.end)

    def outcome(name: str, why: str = "") -> None:
        result.outcome, result.why = name, why

    if result.detail.startswith("unparsable"):
        return outcome("unclear", result.detail)
    if result.detail.startswith("stream ended mid-event"):
        return outcome("connection_lost") if daphne_down else outcome("unclear", result.detail)
    if result.ending == "timeout":
        return outcome("unclear", f"hang: no end within the client's timeout "
                                  f"({result.end - result.start:.0f} s)")
    if result.ending == "connect_error":
        return outcome("unreachable") if daphne_down else outcome(
            "unclear", f"connection refused while daphne was up: {result.detail}")
    if result.ending in ("conn_lost", "http_error"):
        return outcome("connection_lost") if daphne_down else outcome(
            "unclear", f"connection lost while daphne was up: {result.detail}")
    if result.status != 200:
        if not result.code:
            return outcome("unclear", f"HTTP {result.status} without an error code")
        if result.status == 500:
            return outcome("unclear", f"HTTP 500 {result.code}")
        if result.status in (429, 503) and result.code in ADMISSION_CODES:
            return outcome("refused")
        return outcome("error")
    if result.after_end:
        return outcome("unclear", f"{result.after_end} data event(s) after [DONE] or an "
                                  "error event")
    if result.error is not None:
        if not result.stream:
            return outcome("unclear", "HTTP 200 with an error body")
        return outcome("error") if result.code else outcome(
            "unclear", f"error event without a code: {result.error}")
    if result.finish_reason in ("stop", "length") and (result.done or not result.stream):
        return outcome("complete")
    if result.stream and daphne_down:
        return outcome("connection_lost")
    if result.stream and not result.done:
        return outcome("unclear", "the stream ended without [DONE] or an error event "
                                  "while daphne was up")
    return outcome("unclear", f"finish_reason {result.finish_reason!r}")
