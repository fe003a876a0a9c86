"""Chaos harness: the platform under load while its processes and Redis are killed at random.

The acceptance check of the platform's fault tolerance. It starts a private ``redis-server`` on a
free port (AOF with ``appendfsync always`` by default, or no persistence), the platform on it
(:class:`benchmarks.harness.servers.Platform`: its own SQLite database, three tenants without rate
limits, one of them with a concurrency limit, an operator key; the reference backend at a model-like
pace,
``--workers`` inference workers, Celery worker and beat), then:

1. drives ``--concurrency`` client loops against ``POST /v1/completions`` (greedy, one of
   :data:`PROMPTS`, ``max_tokens`` 10-120, mostly streamed): each request is one attempt with a
   hard client-side timeout, and ends as ``complete``, ``error`` (a JSON error or an SSE error
   event with a code), ``refused`` (429/503 at admission), ``connection_lost`` (daphne was killed
   while it was open), ``unreachable`` (daphne was down when it connected) or ``unclear``
   (anything else: a hang, a stream cut while daphne lived, a 500, unparsable data);
2. meanwhile kills (SIGKILL or SIGTERM) and restarts an inference worker, daphne (same port),
   the Celery worker, Celery beat or Redis (same port and data folder), at random moments from a
   seeded generator, and restarts any process that exits on its own (as supervisord would);
3. stops the load, lets the platform settle (bounded), and checks, each count's target being 0:
   ``unclear`` outcomes; token integrity against the reference backend's own output computed
   in-process (a complete answer equals the expected text cut to its length, any other is a
   prefix of it); every request's Redis events stream (token ``seq`` 0..n-1, exactly one final
   event); requests generated twice; leaks (gate 1, the shared queue's hashes, concurrency
   leases, the live workers' queues and KV, the Celery queue, the usage ledger); usage records
   (one per request that produced tokens, with the tokens it produced).

With ``--redis-persistence none`` a restarted Redis starts empty: streams (or parts of streams)
and usage entries it took with it are counted apart, as informational figures, not failures.

It prints every count and a PASS/FAIL line (exit status 1 on FAIL) and writes the JSON report with
``--out``: every request (``results``), the kills, and for each failure its evidence
(``examples``: request ids, what the client saw, the events stream, the usage records, the log
lines naming the request). The processes' logs stay in ``--log-dir`` (printed).

Usage::

    python -m benchmarks.serving.chaos                       # 7 minutes of chaos, about 7.5 in all
    python -m benchmarks.serving.chaos --duration-s 60 --seed 3 --out /tmp/chaos.json
    python -m benchmarks.serving.chaos --redis-persistence none --fresh-worker-ids
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis

from benchmarks.harness.cli import (
    HelpFormatter,
    non_negative_float,
    positive_float,
    positive_int,
)
from benchmarks.harness.servers import Platform, TenantSpec
from benchmarks.harness.stack import free_port
from inference.protocol.events import decode_event
from inference.protocol.keys import EVENTS_TTL_S, Keys

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
KINDS = ("worker", "daphne", "celery", "beat", "redis")
# One round of the kill schedule: every kind, workers twice (the most state lives there).
KILL_ROUND = ("worker", "worker", "daphne", "redis", "celery", "beat")
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
    "LOG_LEVEL": "INFO",
}


@dataclass
class Options:
    """One chaos run (times in seconds; ``kill_interval_s`` is (min, max) between kills)."""

    duration_s: float = 420.0
    concurrency: int = 10
    workers: int = 2
    seed: int = 1
    redis_persistence: str = "aof"
    step_delay_s: float = 0.02
    request_timeout_s: float = 60.0
    settle_s: float = 60.0
    kill_interval_s: tuple[float, float] = (6.0, 14.0)
    warmup_s: float = 5.0
    stream_fraction: float = 0.8
    max_tokens: tuple[int, int] = (10, 120)
    fresh_worker_ids: bool = False
    log_dir: str | None = None
    out: str | None = None


# -- the private Redis -------------------------------------------------------------------------


class PrivateRedis:
    """A ``redis-server`` of the run's own, on a free port and a data folder that survive its
    restarts (so killing it harms no one else). ``persistence``: ``aof`` (every write fsynced
    before it is answered) or ``none``."""

    def __init__(self, data_dir: Path, log_path: Path, persistence: str):
        self.port = free_port()
        self.dir = data_dir
        self.log_path = log_path
        self.persistence = persistence
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def args(self) -> list[str]:
        durable = (["--appendonly", "yes", "--appendfsync", "always"]
                   if self.persistence == "aof" else ["--appendonly", "no"])
        return ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir",
                str(self.dir), "--save", "", *durable, "--daemonize", "no",
                "--maxclients", "10000"]

    def start(self, timeout_s: float = 15) -> None:
        log = open(self.log_path, "ab")  # noqa: SIM115 - lives with the process
        self.proc = subprocess.Popen(self.args(), stdout=log, stderr=subprocess.STDOUT)
        client = redis.Redis(port=self.port, socket_timeout=1)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited; see {self.log_path}")
            try:
                if client.ping():
                    return
            except redis.RedisError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"redis-server did not answer within {timeout_s} s")

    def kill(self, sig: int, wait_s: float = 15) -> int | None:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(5)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


# -- what happened: kills, downtime, requests ---------------------------------------------------


@dataclass
class Timeline:
    """Kills, unexpected exits and daphne's down windows (seconds since the run's start)."""

    t0: float = field(default_factory=time.monotonic)
    kills: list[dict[str, Any]] = field(default_factory=list)
    exits: list[dict[str, Any]] = field(default_factory=list)
    daphne_down: list[list[float]] = field(default_factory=list)
    redis_kills: list[float] = field(default_factory=list)
    redis_kills_unix: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def daphne_down_during(self, start: float, end: float) -> bool:
        return any(down <= end and up >= start for down, up in self.daphne_down)

    def kills_during(self, start: float, end: float) -> list[str]:
        return [f"{k['t']:.1f}s {k['name']} {k['signal']}" for k in self.kills
                if start - 1 <= k["t"] <= end]


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
    ending: str = ""  # how the exchange ended: eof, timeout, connect_error, conn_lost, body
    detail: str = ""
    max_silence_s: float = 0.0
    max_no_data_s: float = 0.0
    data_events: int = 0
    keepalives: int = 0
    after_end: int = 0
    outcome: str = ""
    why: str = ""

    @property
    def code(self) -> str | None:
        return (self.error or {}).get("code")


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


def _parse_sse_event(result: Result, raw: str) -> None:
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
                    result: Result, silence: Silence) -> None:
    headers = {"Authorization": f"Bearer {key}"}
    async with client.stream("POST", url, json=body, headers=headers) as response:
        silence.tick()
        result.status = response.status_code
        result.retry_hint = ("retry-after" in response.headers
                             or "x-should-retry" in response.headers)
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
            return
        buffer = ""
        async for chunk in response.aiter_text():
            silence.tick()
            buffer += chunk
            while "\n\n" in buffer:
                raw, buffer = buffer.split("\n\n", 1)
                before = result.data_events
                try:
                    _parse_sse_event(result, raw)
                except (ValueError, AttributeError) as exc:
                    result.detail = f"unparsable event ({exc}): {raw[:200]!r}"
                if result.data_events > before:
                    silence.tick(data=True)
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
        await asyncio.wait_for(_exchange(client, url, key, body, result, silence), timeout_s)
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
                     clock: Callable[[], float]) -> list[Result]:
    """``options.concurrency`` client loops until ``stop_at`` (on ``clock``); every request."""
    results: list[Result] = []
    limits = httpx.Limits(max_connections=options.concurrency + 4, max_keepalive_connections=0)
    timeout = httpx.Timeout(connect=5, read=options.request_timeout_s + 5, write=5, pool=5)
    endpoint = f"{url}/v1/completions"

    async def loop(n: int, client: httpx.AsyncClient) -> None:
        rng = random.Random(f"{options.seed}-client-{n}")
        while clock() < stop_at:
            result = Result(index=len(results), tenant=rng.choice(TENANTS),
                            prompt=rng.randrange(len(PROMPTS)),
                            max_tokens=rng.randint(*options.max_tokens),
                            stream=rng.random() < options.stream_fraction)
            results.append(result)
            await send_one(client, endpoint, keys[result.tenant], result,
                           options.request_timeout_s, clock)
            if result.ending == "connect_error" or result.status in (429, 503):
                await asyncio.sleep(0.25)  # the client's own pacing, not a retry

    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        await asyncio.gather(*(loop(n, client) for n in range(options.concurrency)))
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


# -- chaos -------------------------------------------------------------------------------------


class Chaos(threading.Thread):
    """Kills and restarts processes at random moments until :meth:`stop`; restarts any process
    that exits on its own (after 1 s, as supervisord would)."""

    def __init__(self, platform: Platform, private_redis: PrivateRedis, options: Options,
                 timeline: Timeline, stop_at: float):
        super().__init__(name="chaos", daemon=True)
        self.stack = platform.stack
        self.redis = private_redis
        self.options = options
        self.timeline = timeline
        self.stop_at = stop_at
        self.rng = random.Random(f"{options.seed}-chaos")
        self._halt = threading.Event()
        self._last_check = 0.0  # when every process was last seen alive
        self._round: list[str] = []
        self._restarts = Counter()

    def stop(self) -> None:
        self._halt.set()

    # Processes that exit on their own.

    def _log_tail(self, name: str, lines: int = 4) -> list[str]:
        path = (self.redis.log_path if name == "redis"
                else Path(self.stack.log_dir) / f"{name}.log")
        try:
            return path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return []

    def supervise(self) -> None:
        """Restart every process found dead that no kill is handling."""
        dead = [n for n, p in self.stack.processes.items() if p.poll() is not None]
        if not self.redis.alive():
            dead.append("redis")
        if not dead:
            self._last_check = self.timeline.now()
            return
        for name in dead:
            rc = self.redis.proc.returncode if name == "redis" else (
                self.stack.processes[name].returncode)
            t = self.timeline.now()
            if name == "redis":
                self.timeline.redis_kills.append(t)
                self.timeline.redis_kills_unix.append(time.time())
            self.timeline.exits.append({"t": round(t, 2), "name": name, "returncode": rc,
                                        "log_tail": self._log_tail(name)})
            print(f"[chaos {t:7.1f}s] {name} exited on its own (status {rc}); restarting it",
                  flush=True)
            time.sleep(1.0)
            self._start(name, down_since=self._last_check)
        self._last_check = self.timeline.now()

    def _start(self, name: str, down_since: float) -> None:
        if name == "redis":
            self.redis.start()
            return
        self._restarts[name] += 1
        env = ({"WORKER_ID": f"{self.stack.prefix}-{name}-r{self._restarts[name]}"}
               if self.options.fresh_worker_ids and name.startswith("worker") else {})
        self.stack.restart(name, **env)
        if name == "daphne":
            self.timeline.daphne_down.append([down_since, self._wait_daphne()])

    def _wait_daphne(self, timeout_s: float = 30) -> float:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.stack.url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        return self.timeline.now()

    # Kills.

    def next_kind(self) -> str:
        if not self._round:
            self._round = list(KILL_ROUND)
            self.rng.shuffle(self._round)
        kind = self._round.pop()
        if kind == "beat" and "beat" not in self.stack.processes:
            return self.next_kind()
        return kind

    def kill_one(self, kind: str) -> None:
        rng = self.rng
        if kind == "worker":
            name = rng.choice([n for n in self.stack.processes if n.startswith("worker")])
            sig = rng.choice((signal.SIGKILL, signal.SIGTERM))
            delay = 0.0 if rng.random() < 0.25 else rng.uniform(0, 3)
        elif kind == "daphne":
            name, sig, delay = "daphne", rng.choice((signal.SIGKILL, signal.SIGTERM)), \
                rng.uniform(0, 1)
        elif kind == "celery":
            name, sig, delay = "celery", signal.SIGKILL, rng.uniform(0, 2)
        elif kind == "beat":
            name, sig, delay = "beat", rng.choice((signal.SIGKILL, signal.SIGTERM)), \
                rng.uniform(0, 2)
        else:
            name, sig, delay = "redis", rng.choice((signal.SIGKILL, signal.SIGTERM)), \
                rng.uniform(0.3, 1.0)
        t = self.timeline.now()
        record: dict[str, Any] = {"t": round(t, 2), "kind": kind, "name": name,
                                  "signal": signal.Signals(sig).name,
                                  "restart_after_s": round(delay, 2)}
        print(f"[chaos {t:7.1f}s] {signal.Signals(sig).name} {name}; restart after "
              f"{delay:.2f} s", flush=True)
        if kind == "redis":
            self.timeline.redis_kills.append(t)
            self.timeline.redis_kills_unix.append(time.time())
            record["returncode"] = self.redis.kill(sig)
        else:
            record["pid"] = self.stack.processes[name].pid
            record["returncode"] = self.stack.kill(name, sig)
        record["exited_after_s"] = round(self.timeline.now() - t, 2)
        time.sleep(delay)
        self._start(name, down_since=t)
        record["up_after_s"] = round(self.timeline.now() - t, 2)
        self.timeline.kills.append(record)

    def run(self) -> None:
        try:
            next_kill = self.timeline.now() + self.options.warmup_s
            while not self._halt.is_set() and self.timeline.now() < self.stop_at:
                self.supervise()
                if self.timeline.now() >= next_kill:
                    self.kill_one(self.next_kind())
                    next_kill = self.timeline.now() + self.rng.uniform(
                        *self.options.kill_interval_s)
                self._halt.wait(0.2)
            self.supervise()
        except Exception:  # noqa: BLE001 - reported, and the run goes on to its checks
            self.timeline.errors.append(traceback.format_exc())
            print(f"[chaos] harness error:\n{traceback.format_exc()}", file=sys.stderr)


# -- expected output ---------------------------------------------------------------------------


def expected_outputs(prompts: tuple[str, ...], max_tokens: int) -> list[tuple[str, int | None]]:
    """The reference backend's greedy answer to each prompt, computed in-process as the workers
    compute it (same backend, same context length): (text of up to ``max_tokens`` tokens, the
    number of tokens after which it stops on EOS, or None if it did not)."""
    from inference.engine.config import EngineConfig
    from inference.engine.llm_engine import LLMEngine
    from inference.engine.request import SamplingParams

    engine = LLMEngine(EngineConfig(backend="reference", max_batch_size=len(prompts)))
    handles = [engine.submit(prompt=p, sampling=SamplingParams(max_tokens=max_tokens,
                                                               temperature=0.0))
               for p in prompts]
    while engine.has_work():
        engine.step()
    answers = []
    for handle in handles:
        text, tokens, final = handle.result(timeout=5)
        assert len(text) == len(tokens), "the reference backend writes one character a token"
        answers.append((text, len(tokens) if final.finish_reason.value == "stop" else None))
    return answers


def expected_for(answer: tuple[str, int | None], max_tokens: int) -> tuple[str, str]:
    """The expected (text, finish reason) of a complete request of ``max_tokens``."""
    text, stops_after = answer
    if stops_after is not None and stops_after < max_tokens:
        return text[:stops_after], "stop"
    return text[:max_tokens], "length"


# -- settling and reading the platform's state ----------------------------------------------------


def _stats(platform: Platform) -> dict[str, Any]:
    return httpx.get(f"{platform.url}/scheduler/stats", timeout=5,
                     headers={"Authorization": f"Bearer {platform.keys['operator']}"}).json()


def _busy_workers(stats: dict[str, Any]) -> dict[str, dict[str, int]]:
    busy = {}
    for worker, snap in (stats.get("workers") or {}).items():
        fields = {f: snap.get(f, 0) for f in WORKER_BUSY_FIELDS if snap.get(f, 0)}
        if fields:
            busy[worker] = fields
    return busy


def settle(platform: Platform, client: redis.Redis, timeout_s: float) -> dict[str, Any]:
    """Wait (at most ``timeout_s``) until gate 1 is 0, no worker runs anything, the Celery queue
    and the usage ledger are empty, for three polls in a row; return how it went."""
    keys = Keys(platform.stack.prefix)
    queue = platform.stack.env["CELERY_TASK_DEFAULT_QUEUE"]
    start = time.monotonic()
    deadline = start + timeout_s
    quiet = 0
    state: dict[str, Any] = {}
    while time.monotonic() < deadline:
        try:
            stats = _stats(platform)
            state = {"gate1": stats["gate1"]["queued"], "busy_workers": _busy_workers(stats),
                     "live_workers": len(stats.get("workers") or {}),
                     "celery_queue": client.llen(queue),
                     "usage_pending": client.hlen(f"{keys.prefix}:usage:pending")}
        except (httpx.HTTPError, redis.RedisError, ValueError, KeyError) as exc:
            state = {"error": repr(exc)}
            quiet = 0
            time.sleep(0.5)
            continue
        calm = (state["gate1"] == 0 and not state["busy_workers"] and not state["celery_queue"]
                and not state["usage_pending"]
                and state["live_workers"] == platform.workers)
        quiet = quiet + 1 if calm else 0
        if quiet >= 3:
            break
        time.sleep(0.5)
    return {"settled": quiet >= 3, "waited_s": round(time.monotonic() - start, 1),
            "last_state": state}


def wait_all_up(platform: Platform, private_redis: PrivateRedis, timeout_s: float = 60) -> bool:
    """Every process running and the platform ready with all its workers."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not private_redis.alive():
            private_redis.start()
        for name, proc in platform.stack.processes.items():
            if proc.poll() is not None:
                platform.stack.restart(name)
        try:
            ready = httpx.get(f"{platform.url}/readyz", timeout=2)
            if (ready.status_code == 200
                    and ready.json()["checks"]["workers"] >= platform.workers):
                return True
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.3)
    return False


def _sum_hash(client: redis.Redis, name: str) -> int:
    return sum(int(float(v)) for v in client.hvals(name))


# The shared queue's order indexes and per-request bookkeeping: all empty when nothing waits or
# runs (inference/protocol/lua/fair_queue.lua); the counters, arrival number and wake list are kept.
QUEUE_INDEXES = ("deadlines", "tiers", "backlogged", "next", "q:*", "ready:*", "heads:*")


def _size(client: redis.Redis, name: bytes | str) -> int:
    kind = client.type(name).decode()
    return {"hash": client.hlen, "zset": client.zcard, "list": client.llen, "set": client.scard,
            "stream": client.xlen}.get(kind, lambda _: 1 if kind == "string" else 0)(name)


def read_leaks(platform: Platform, client: redis.Redis) -> tuple[dict[str, int], dict[str, Any]]:
    """What is left behind once the platform settled: (counts, their details)."""
    keys = Keys(platform.stack.prefix)
    now_ms = time.time() * 1000
    stats = _stats(platform)
    taken = {k.decode(): client.hlen(k) for k in client.scan_iter(keys.fq("taken", "*"))}
    running = {k.decode(): client.hlen(k) for k in client.scan_iter(keys.fq("running", "*"))}
    leases: dict[str, list[str]] = {}
    for name in client.scan_iter(f"{keys.prefix}:conc:*"):
        live = client.zrangebyscore(name, now_ms, "+inf")
        if live:
            leases[name.decode()] = [m.decode() for m in live]
    busy = _busy_workers(stats)
    indexes = {name.decode(): size for pattern in QUEUE_INDEXES
               for name in client.scan_iter(keys.fq(pattern)) if (size := _size(client, name))}
    counts = {
        "leak_gate1": int(stats["gate1"]["queued"]),
        "leak_fq_wait": client.hlen(keys.fq("wait")),
        "leak_fq_inflight": _sum_hash(client, keys.fq("inflight")),
        "leak_fq_taken": sum(taken.values()),
        "leak_fq_running": sum(running.values()),
        "leak_fq_held": _sum_hash(client, keys.fq("held")),
        "leak_fq_indexes": sum(indexes.values()),
        "leak_concurrency_leases": sum(len(v) for v in leases.values()),
        "leak_worker_state": sum(sum(f.values()) for f in busy.values()),
        "leak_celery_queue": client.llen(platform.stack.env["CELERY_TASK_DEFAULT_QUEUE"]),
        "leak_usage_pending": client.hlen(f"{keys.prefix}:usage:pending"),
    }
    details = {
        "fq_wait": [i.decode() for i in client.hkeys(keys.fq("wait"))][:MAX_EXAMPLES],
        "fq_inflight": {k.decode(): v.decode()
                        for k, v in client.hgetall(keys.fq("inflight")).items()},
        "fq_held": {k.decode(): v.decode() for k, v in client.hgetall(keys.fq("held")).items()},
        "fq_taken": {k: [i.decode() for i in client.hkeys(k)][:MAX_EXAMPLES]
                     for k in taken if taken[k]},
        "fq_running": {k: [i.decode() for i in client.hkeys(k)][:MAX_EXAMPLES]
                       for k in running if running[k]},
        "fq_indexes": indexes,
        "concurrency_leases": leases,
        "busy_workers": busy,
        "live_workers": sorted(stats.get("workers") or {}),
        # Celery messages a killed worker had reserved: kombu restores them only after its
        # visibility timeout (an hour by default).
        "celery_unacked": client.hlen("unacked"),
    }
    return counts, details


@dataclass
class StreamSummary:
    """One request's Redis events stream: its token events as (seq, text) in stream order, its
    final events, and the unix times (ms) of its first and last entries."""

    token_events: list[tuple[int, str]] = field(default_factory=list)
    finals: list[dict[str, Any]] = field(default_factory=list)
    after_final: int = 0
    bad: int = 0
    first_ms: int = 0
    last_ms: int = 0

    @property
    def seqs(self) -> list[int]:
        return [seq for seq, _ in self.token_events]

    @property
    def text(self) -> str:
        return "".join(text for _, text in self.token_events)

    @property
    def tokens(self) -> int:
        return len(self.token_events)

    def doubled(self) -> bool:
        """More than one final event, or a token seq written twice."""
        return len(self.finals) > 1 or len(set(self.seqs)) != len(self.seqs)

    def whole(self) -> bool:
        """Token seqs 0..n-1 in order, and a final event (if any) that says n tokens were sent:
        the stream holds the request's whole answer."""
        n = self.tokens
        return self.seqs == list(range(n)) and all(f["seq"] == n for f in self.finals)

    def brief(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "whole": self.whole(), "seqs": _ranges(self.seqs),
                "text": self.text[:60], "finals": self.finals,
                "events_after_final": self.after_final, "bad_entries": self.bad}


def _ranges(seqs: list[int]) -> str:
    """``0-41,43-50``: consecutive runs of a list of numbers, in order."""
    runs: list[list[int]] = []
    for seq in seqs:
        if runs and seq == runs[-1][1] + 1:
            runs[-1][1] = seq
        else:
            runs.append([seq, seq])
    return ",".join(f"{a}-{b}" if a != b else str(a) for a, b in runs)


def read_streams(client: redis.Redis, prefix: str) -> dict[str, StreamSummary]:
    """Every request's events stream still in Redis, by request id."""
    streams: dict[str, StreamSummary] = {}
    head = f"{prefix}:events:"
    for name in client.scan_iter(f"{head}*", count=1000):
        summary = StreamSummary()
        for entry_id, fields in client.xrange(name):
            ms = int(entry_id.split(b"-")[0])
            summary.first_ms, summary.last_ms = summary.first_ms or ms, ms
            try:
                event = decode_event(fields)
            except ValueError:
                summary.bad += 1
                continue
            if summary.finals:
                summary.after_final += 1
            if event.type == "token":
                summary.token_events.append((event.seq, event.text))
            else:
                summary.finals.append({
                    "seq": event.seq, "finish_reason": event.finish_reason.value,
                    "error": event.error.code.value if event.error else None,
                    "completion_tokens": event.usage.completion_tokens, "text": event.text})
        streams[name.decode()[len(head):]] = summary
    return streams


_READ_USAGE = """
import json
from tenants.models import UsageRecord
rows = list(UsageRecord.objects.values("request_id", "completion_tokens", "prompt_tokens",
                                       "finish_reason", "status", "error_code", "tenant__slug"))
print("USAGE " + json.dumps(rows))
"""


def read_usage(platform: Platform) -> list[dict[str, Any]]:
    """Every usage record in the platform's database."""
    out = platform.manage("shell", "-c", _READ_USAGE)
    line = next(x for x in out.splitlines() if x.startswith("USAGE "))
    return json.loads(line[len("USAGE "):])


# -- the checks ---------------------------------------------------------------------------------


class Findings:
    """Counts whose target is 0, each with a few examples."""

    NAMES = (
        "unclear", "token_mismatch_complete", "token_not_prefix", "stream_client_mismatch",
        "stream_seq_gaps", "stream_without_final", "stream_events_after_final",
        "stream_bad_entries", "streams_missing", "generated_twice",
        "leak_gate1", "leak_fq_wait", "leak_fq_inflight", "leak_fq_taken", "leak_fq_running",
        "leak_fq_held", "leak_fq_indexes", "leak_concurrency_leases", "leak_worker_state",
        "leak_celery_queue", "leak_usage_pending",
        "usage_missing", "usage_extra", "usage_duplicate", "usage_token_mismatch",
        "no_request_completed",
    )

    def __init__(self) -> None:
        self.counts = dict.fromkeys(self.NAMES, 0)
        self.examples: dict[str, list[Any]] = {}

    def add(self, name: str, example: Any, n: int = 1) -> None:
        self.counts[name] += n
        bucket = self.examples.setdefault(name, [])
        if len(bucket) < MAX_EXAMPLES:
            bucket.append(example)


def _evidence(result: Result | None, rid: str, streams: dict[str, StreamSummary],
              usage: dict[str, list[dict[str, Any]]], timeline: Timeline,
              answers: list[tuple[str, int | None]], **extra: Any) -> dict[str, Any]:
    item: dict[str, Any] = {"request_id": rid or None, **extra}
    if result is not None:
        item["client"] = {
            "tenant": result.tenant, "prompt": result.prompt, "max_tokens": result.max_tokens,
            "stream": result.stream, "start_s": round(result.start, 2),
            "end_s": round(result.end, 2), "outcome": result.outcome, "why": result.why,
            "status": result.status, "ending": result.ending, "detail": result.detail[:300],
            "error": result.error, "finish_reason": result.finish_reason, "done": result.done,
            "text": result.text[:60], "tokens": len(result.text),
            "usage_completion": result.usage_completion,
            "max_silence_s": round(result.max_silence_s, 2),
            "max_no_data_s": round(result.max_no_data_s, 2),
            "expected": answers[result.prompt][0][:60],
            "kills_during": timeline.kills_during(result.start, result.end)}
    if rid and rid in streams:
        item["stream"] = streams[rid].brief()
    if rid and rid in usage:
        item["usage_records"] = usage[rid]
    return item


def check(results: list[Result], streams: dict[str, StreamSummary],
          records: list[dict[str, Any]], leaks: dict[str, int], leak_details: dict[str, Any],
          answers: list[tuple[str, int | None]], timeline: Timeline, options: Options,
          collected_at: float) -> tuple[Findings, dict[str, int]]:
    """The checks: (findings whose target is 0, informational counts).

    With ``options.redis_persistence == "none"`` a Redis restart loses what it held: a stream
    missing, or holding only part of its request's events, when Redis restarted while the
    request was open is counted apart (informational), not as a failure.
    """
    findings = Findings()
    info: Counter[str] = Counter()
    usage: dict[str, list[dict[str, Any]]] = {}
    for row in records:
        usage.setdefault(row["request_id"], []).append(row)
    by_id = {r.request_id: r for r in results if r.request_id}

    def evidence(result: Result | None, rid: str, **extra: Any) -> dict[str, Any]:
        return _evidence(result, rid, streams, usage, timeline, answers, **extra)

    def redis_lost_data(rid: str, within_s: float | None = 1.0) -> bool:
        """Whether a Redis without persistence restarted from the request's start until
        ``within_s`` after its end (None: any time after its start)."""
        if options.redis_persistence != "none":
            return False
        result, s = by_id.get(rid), streams.get(rid)
        if result is not None:
            until = math.inf if within_s is None else result.end + within_s
            return any(result.start - 1 <= t <= until for t in timeline.redis_kills)
        if s is None:
            return False
        begin = s.first_ms / 1000 - options.request_timeout_s
        until = math.inf if within_s is None else s.last_ms / 1000 + within_s
        return any(begin <= t <= until for t in timeline.redis_kills_unix)

    # Outcomes and token integrity as the client saw them.
    for r in results:
        if r.outcome == "unclear":
            findings.add("unclear", evidence(r, r.request_id))
        expected_text = answers[r.prompt][0]
        if r.outcome == "complete":
            want_text, want_finish = expected_for(answers[r.prompt], r.max_tokens)
            if r.text != want_text or r.finish_reason != want_finish:
                findings.add("token_mismatch_complete", evidence(
                    r, r.request_id, want_finish=want_finish, want_tokens=len(want_text)))
            elif r.usage_completion is not None and r.usage_completion != len(r.text):
                findings.add("token_mismatch_complete", evidence(
                    r, r.request_id, why_mismatch="usage in the response differs from the "
                                                  "tokens received"))
        elif r.text and (not expected_text.startswith(r.text) or len(r.text) > r.max_tokens):
            findings.add("token_not_prefix", evidence(r, r.request_id))

    # Every events stream still in Redis. Only a whole one tells what its request produced.
    whole = {rid for rid, s in streams.items() if s.whole() and not s.doubled()}
    for rid, s in streams.items():
        result = by_id.get(rid)
        if s.doubled():
            findings.add("generated_twice", evidence(result, rid))
        elif not s.whole():
            if redis_lost_data(rid):
                info["streams_partial_with_redis"] += 1
            else:
                findings.add("stream_seq_gaps", evidence(result, rid))
        if not s.finals:
            findings.add("stream_without_final", evidence(result, rid))
        if s.after_final:
            findings.add("stream_events_after_final", evidence(result, rid))
        if s.bad:
            findings.add("stream_bad_entries", evidence(result, rid))
        if result is not None:
            # Each token where its seq puts it: holds for a partial stream too.
            expected_text = answers[result.prompt][0][:result.max_tokens]
            if any(seq >= len(expected_text) or expected_text[seq] != text
                   for seq, text in s.token_events):
                findings.add("token_not_prefix", evidence(result, rid, where="events stream"))
            elif result.outcome == "complete" and rid in whole and s.text != result.text:
                findings.add("stream_client_mismatch", evidence(result, rid))

    # Requests the client knows by id whose stream is gone.
    for r in results:
        if not r.request_id or r.request_id in streams:
            continue
        if redis_lost_data(r.request_id, within_s=None):
            info["streams_lost_with_redis"] += 1
        elif collected_at - r.end > EVENTS_TTL_S - 30:
            info["streams_expired"] += 1
        else:
            findings.add("streams_missing", evidence(r, r.request_id))

    # Usage: one record per request that produced tokens, with the tokens it produced (known
    # from its whole stream, else from a complete answer).
    produced: dict[str, int] = {}
    for rid, s in streams.items():
        sent = max([s.tokens, *(f["seq"] for f in s.finals)])
        if sent:
            produced[rid] = sent
    for r in results:
        if r.request_id and r.text:
            produced[r.request_id] = max(produced.get(r.request_id, 0), len(r.text))
    billed = {rid for rid, rows in usage.items() if any(x["completion_tokens"] > 0 for x in rows)}
    for rid, rows in usage.items():
        if len(rows) > 1:
            findings.add("usage_duplicate", evidence(by_id.get(rid), rid), n=len(rows) - 1)
    for rid, tokens in produced.items():
        result = by_id.get(rid)
        if rid not in usage:
            if rid not in streams and redis_lost_data(rid, within_s=USAGE_RECORDED_WITHIN_S):
                info["usage_unverifiable"] += 1  # its stream and ledger entry went with Redis
            else:
                findings.add("usage_missing", evidence(result, rid, produced_tokens=tokens))
            continue
        got = usage[rid][0]["completion_tokens"]
        finals = streams[rid].finals if rid in streams else []
        errored = bool(finals) and finals[-1]["finish_reason"] == "error"
        if errored and result is None and got in (0, streams[rid].tokens):
            # Ended by an error and unknown to the client (an error body carries no id): a
            # stream is billed its tokens, an answer not streamed nothing (gateway.usage.billed).
            info["usage_unverifiable"] += 1
            continue
        if errored and result is not None and (not result.stream or streams[rid].tokens == 0):
            want = 0  # an error leaves the client nothing: billed nothing (gateway.usage.billed)
        elif rid in whole:
            want = streams[rid].tokens
        elif result is not None and result.outcome == "complete":
            want = len(result.text)
        else:
            info["usage_unverifiable"] += 1  # only part of what it produced is known
            continue
        if got != want:
            findings.add("usage_token_mismatch", evidence(result, rid, produced_tokens=want,
                                                          billed_tokens=got))
            if got > want:
                findings.add("generated_twice", evidence(result, rid, why="billed more tokens "
                                                         "than its stream holds"))
    for rid in billed - set(produced):
        if rid in streams or rid in by_id:
            findings.add("usage_extra", evidence(by_id.get(rid), rid))
        else:
            info["usage_unverifiable"] += 1  # neither the stream nor the client saw it

    # Leaks once the platform settled.
    for name, count in leaks.items():
        if count:
            detail_key = {"leak_fq_wait": "fq_wait", "leak_fq_inflight": "fq_inflight",
                          "leak_fq_taken": "fq_taken", "leak_fq_running": "fq_running",
                          "leak_fq_held": "fq_held", "leak_fq_indexes": "fq_indexes",
                          "leak_concurrency_leases": "concurrency_leases",
                          "leak_worker_state": "busy_workers"}.get(name)
            detail = leak_details.get(detail_key) if detail_key else None
            findings.add(name, {"count": count, "detail": detail}, n=count)
    for kind in ("concurrency_leases", "fq_running", "fq_taken"):
        for members in (leak_details.get(kind) or {}).values():
            for rid in members[:MAX_EXAMPLES]:
                findings.examples.setdefault(f"leak_{kind}_requests", []).append(
                    evidence(by_id.get(rid), rid))

    if not any(r.outcome == "complete" for r in results):
        findings.add("no_request_completed", "no request completed: the harness saw no service")
    info["celery_unacked"] = leak_details.get("celery_unacked", 0)
    return findings, dict(info)


def attach_log_lines(findings: Findings, log_dir: Path, per_id: int = 4) -> None:
    """Add to each example the log lines that name its request id."""
    logs = {p.name: p.read_text(errors="replace").splitlines()
            for p in sorted(log_dir.glob("*.log"))}
    for examples in findings.examples.values():
        for item in examples:
            rid = item.get("request_id") if isinstance(item, dict) else None
            if not rid:
                continue
            lines = [f"{name}: {line[:300]}" for name, content in logs.items()
                     for line in content if rid in line]
            if lines:
                item["log_lines"] = lines[:per_id]


# -- the run -----------------------------------------------------------------------------------


def run(options: Options) -> dict[str, Any]:
    """One chaos run; returns the report (``report["verdict"]`` is PASS or FAIL)."""
    started = time.monotonic()
    log_dir = Path(options.log_dir or tempfile.mkdtemp(prefix=f"chaos-{options.seed}-logs-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    answers = expected_outputs(PROMPTS, options.max_tokens[1])
    data_dir = Path(tempfile.mkdtemp(prefix="chaos-redis-"))
    private_redis = PrivateRedis(data_dir, log_dir / "redis.log", options.redis_persistence)
    private_redis.start()
    tenants = [TenantSpec(t, max_concurrent=LIMITED_CONCURRENCY if t == LIMITED_TENANT else 0)
               for t in TENANTS]
    env = {**PLATFORM_ENV, "REFERENCE_STEP_DELAY_S": options.step_delay_s}
    timeline = Timeline()
    report: dict[str, Any] = {"options": dataclasses.asdict(options), "log_dir": str(log_dir)}
    try:
        with Platform(tenants, workers=options.workers, redis_url=private_redis.url, beat=True,
                      **env) as platform:
            print(f"platform up at {platform.url} on {private_redis.url} "
                  f"(logs: {log_dir}, start-up {time.monotonic() - started:.0f} s)", flush=True)
            try:
                report.update(_run_on(platform, private_redis, options, timeline, answers,
                                      log_dir))
            finally:
                for path in Path(platform.stack.log_dir).glob("*.log"):
                    shutil.copy(path, log_dir / path.name)
                wait_all_up(platform, private_redis, timeout_s=20)  # for a clean stop
    except Exception:  # noqa: BLE001 - a harness failure is reported, never a PASS
        timeline.errors.append(traceback.format_exc())
        print(f"harness error:\n{traceback.format_exc()}", file=sys.stderr)
    finally:
        if private_redis.alive():
            private_redis.kill(signal.SIGTERM)
        shutil.rmtree(data_dir, ignore_errors=True)
    report["harness_errors"] = timeline.errors
    if timeline.errors:
        report["verdict"] = "FAIL"
    report["wall_s"] = round(time.monotonic() - started, 1)
    if options.out:
        Path(options.out).write_text(json.dumps(report, indent=1, default=str))
    return report


def _run_on(platform: Platform, private_redis: PrivateRedis, options: Options,
            timeline: Timeline, answers: list[tuple[str, int | None]],
            log_dir: Path) -> dict[str, Any]:
    """The load and the chaos on a started platform, the settling and the checks."""
    timeline.t0 = time.monotonic()
    chaos = Chaos(platform, private_redis, options, timeline, options.duration_s)
    chaos.start()
    try:
        results = asyncio.run(drive_load(platform.url, platform.keys, options,
                                         options.duration_s, timeline.now))
    finally:
        chaos.stop()
        chaos.join(120)
    load_s = timeline.now()
    for result in results:
        classify(result, timeline)
    all_up = wait_all_up(platform, private_redis)
    # Let a killed worker's heartbeat lapse, so that the live ones reclaim what it held.
    time.sleep(2 * PLATFORM_ENV["WORKER_HEARTBEAT_TTL_S"])
    client = redis.Redis.from_url(private_redis.url)
    settled = settle(platform, client, options.settle_s)
    leaks, leak_details = read_leaks(platform, client)
    streams = read_streams(client, platform.stack.prefix)
    records = read_usage(platform)
    findings, info = check(results, streams, records, leaks, leak_details, answers, timeline,
                           options, timeline.now())
    for path in Path(platform.stack.log_dir).glob("*.log"):
        shutil.copy(path, log_dir / path.name)
    attach_log_lines(findings, log_dir)
    return summarize(results, timeline, findings, info, settled, all_up, load_s, leak_details)


def summarize(results: list[Result], timeline: Timeline, findings: Findings,
              info: dict[str, int], settled: dict[str, Any], all_up: bool, load_s: float,
              leak_details: dict[str, Any]) -> dict[str, Any]:
    """The report's figures (everything but the options and the wall time)."""
    codes = Counter()
    hints = Counter()
    for r in results:
        if r.code:
            where = "sse" if r.status == 200 else f"http {r.status}"
            codes[f"{where} {r.code}"] += 1
            hints[f"{where} {r.code}"] += r.retry_hint
    streams = [r for r in results if r.stream]
    plain = [r for r in results if not r.stream]
    quiet = max(streams, key=lambda r: r.max_silence_s, default=None)
    no_data = max(streams, key=lambda r: r.max_no_data_s, default=None)
    quiet_plain = max(plain, key=lambda r: r.max_silence_s, default=None)
    counts = findings.counts
    failing = {k: v for k, v in counts.items() if v}
    return {
        "requests": {"total": len(results),
                     "by_outcome": dict(Counter(r.outcome for r in results).most_common()),
                     "streamed": len(streams), "not_streamed": len(plain),
                     "by_tenant": dict(Counter(r.tenant for r in results))},
        "kills": timeline.kills,
        "kills_by_kind": dict(Counter(k["kind"] for k in timeline.kills)),
        "unexpected_exits": timeline.exits,
        "daphne_down": timeline.daphne_down,
        "error_codes": dict(codes.most_common()),
        "error_codes_with_retry_hint": dict(hints),
        "longest_silence_s": {
            "stream": round(quiet.max_silence_s, 2) if quiet else None,
            "stream_request": quiet.request_id if quiet else None,
            "stream_without_data": round(no_data.max_no_data_s, 2) if no_data else None,
            "stream_without_data_request": no_data.request_id if no_data else None,
            "not_streamed": round(quiet_plain.max_silence_s, 2) if quiet_plain else None,
            "not_streamed_request": quiet_plain.request_id if quiet_plain else None},
        "impact": impact(results, timeline),
        "load_s": round(load_s, 1),
        "all_up_after_load": all_up,
        "settle": settled,
        "counts": counts,
        "info": info,
        "live_workers_after": leak_details.get("live_workers"),
        "examples": findings.examples,
        "results": [_compact(r) for r in results],
        "failing": failing,
        "verdict": "FAIL" if failing or timeline.errors else "PASS",
    }


def impact(results: list[Result], timeline: Timeline) -> dict[str, dict[str, Any]]:
    """What each kind of kill did to the clients, by process kind and signal.

    For each: how many kills; the requests in flight at a kill (started before it, ended after
    it) by outcome and error code; for those of them that did not complete, the seconds from the
    kill to their end (median and largest); and the requests sent in the 3 s after a kill by
    outcome.
    """
    table: dict[str, dict[str, Any]] = {}
    for kill in timeline.kills:
        name = f"{kill['kind']} {kill['signal']}"
        row = table.setdefault(name, {"kills": 0, "in_flight": Counter(), "after": Counter(),
                                      "_ends": []})
        row["kills"] += 1
        t = kill["t"]
        for r in results:
            label = r.outcome + (f" {r.code}" if r.code else "")
            if r.start < t < r.end:
                row["in_flight"][label] += 1
                if r.outcome != "complete":
                    row["_ends"].append(r.end - t)
            elif t <= r.start < t + 3:
                row["after"][label] += 1
    for row in table.values():
        ends = sorted(row.pop("_ends"))
        row["in_flight"] = dict(row["in_flight"].most_common())
        row["after"] = dict(row["after"].most_common())
        row["cut_short_ended_after_s"] = (
            {"median": round(ends[len(ends) // 2], 2), "max": round(ends[-1], 2)}
            if ends else None)
    return dict(sorted(table.items()))


def _compact(result: Result) -> dict[str, Any]:
    """One request in the report's ``results`` list."""
    return {"id": result.request_id, "tenant": result.tenant, "prompt": result.prompt,
            "max_tokens": result.max_tokens, "stream": result.stream,
            "start_s": round(result.start, 2), "end_s": round(result.end, 2),
            "outcome": result.outcome, "why": result.why, "status": result.status,
            "code": result.code, "tokens": len(result.text), "finish": result.finish_reason,
            "silence_s": round(result.max_silence_s, 2),
            "no_data_s": round(result.max_no_data_s, 2)}


def format_report(report: dict[str, Any], examples: bool = True) -> str:
    """The report as text: figures, every count, examples of each failure, the verdict."""
    lines = []
    req = report.get("requests", {})
    lines.append(f"requests: {req.get('total')} ({req.get('streamed')} streamed, "
                 f"{req.get('not_streamed')} not) by outcome {req.get('by_outcome')}")
    lines.append(f"kills: {len(report.get('kills', []))} by kind {report.get('kills_by_kind')}")
    for kill in report.get("kills", []):
        lines.append(f"  {kill['t']:7.1f}s {kill['signal']:7} {kill['name']:8} exited after "
                     f"{kill.get('exited_after_s')} s (status {kill.get('returncode')}), up "
                     f"after {kill.get('up_after_s')} s")
    exits = report.get("unexpected_exits", [])
    lines.append(f"processes that exited on their own: {len(exits)}")
    for item in exits:
        tail = item["log_tail"][-1] if item.get("log_tail") else ""
        lines.append(f"  {item['t']:7.1f}s {item['name']} status {item['returncode']}: "
                     f"{tail[:160]}")
    lines.append(f"error codes seen: {report.get('error_codes')}")
    lines.append(f"  of which with a retry hint: {report.get('error_codes_with_retry_hint')}")
    lines.append(f"longest wait without a byte (and, streams, without data): "
                 f"{report.get('longest_silence_s')}")
    lines.append("what each kill did to the clients (requests in flight at the kill; those "
                 "cut short ended this long after it; requests sent in the 3 s after it):")
    for name, row in report.get("impact", {}).items():
        lines.append(f"  {name:16} x{row['kills']}: in flight {row['in_flight']}; cut short "
                     f"ended after {row['cut_short_ended_after_s']}; after {row['after']}")
    lines.append(f"settle: {report.get('settle')}")
    lines.append(f"informational: {report.get('info')}")
    if report.get("harness_errors"):
        lines.append(f"HARNESS ERRORS: {report['harness_errors']}")
    lines.append("counts (target 0):")
    for name, value in report.get("counts", {}).items():
        lines.append(f"  {name:32} {value}{'   <-- FAIL' if value else ''}")
    if examples:
        for name, items in report.get("examples", {}).items():
            lines.append(f"examples of {name}:")
            lines.extend(f"  {json.dumps(item, default=str)[:1500]}" for item in items)
    lines.append(f"logs: {report.get('log_dir')}")
    lines.append(f"wall time: {report.get('wall_s')} s (load {report.get('load_s')} s)")
    lines.append(f"{report.get('verdict', 'FAIL')}")
    return "\n".join(lines)


# -- command line ------------------------------------------------------------------------------


def float_pair(text: str) -> tuple[float, float]:
    """``MIN,MAX`` numbers with 0 <= MIN <= MAX (an argparse type)."""
    try:
        low, high = (float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"need MIN,MAX, got {text!r}") from None
    if not 0 <= low <= high:
        raise argparse.ArgumentTypeError(f"need 0 <= MIN <= MAX, got {text!r}")
    return low, high


def int_pair(text: str) -> tuple[int, int]:
    """``MIN,MAX`` integers with 1 <= MIN <= MAX (an argparse type)."""
    try:
        low, high = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"need MIN,MAX integers, got {text!r}") from None
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"need 1 <= MIN <= MAX, got {text!r}")
    return low, high


def fraction(text: str) -> float:
    """A number in [0, 1] (an argparse type)."""
    value = non_negative_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"{text} must be at most 1")
    return value


def parse_args(argv: list[str] | None = None) -> Options:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.serving.chaos", formatter_class=HelpFormatter,
        description="Run the platform under load while killing and restarting its processes "
                    "and Redis at random; check that every request ended exactly once with its "
                    "full output or a clear error, that no token was lost or doubled, that "
                    "nothing leaked and that usage was recorded once per request. Prints every "
                    "count (target 0) and PASS or FAIL (exit status 1).")
    d = Options()
    parser.add_argument("--duration-s", type=positive_float, default=d.duration_s,
                        help="seconds of load and chaos (the whole run takes up to about 3 "
                             "minutes more: start-up, requests draining, settling, checks; "
                             "about 30 s on a platform that loses nothing)")
    parser.add_argument("--concurrency", type=positive_int, default=d.concurrency,
                        help="client loops, each sending one request after the other")
    parser.add_argument("--workers", type=positive_int, default=d.workers,
                        help="inference worker processes")
    parser.add_argument("--seed", type=int, default=d.seed,
                        help="seed of the kills' schedule and the requests")
    parser.add_argument("--redis-persistence", choices=("aof", "none"),
                        default=d.redis_persistence,
                        help="aof: append-only file fsynced on every write; none: a restarted "
                             "Redis starts empty (events streams lost with it are counted "
                             "apart, not as failures)")
    parser.add_argument("--step-delay-s", type=non_negative_float, default=d.step_delay_s,
                        help="REFERENCE_STEP_DELAY_S: seconds each forward pass takes")
    parser.add_argument("--request-timeout-s", type=positive_float,
                        default=d.request_timeout_s,
                        help="hard client-side limit of one request: past it, it counts as a "
                             "hang (unclear)")
    parser.add_argument("--settle-s", type=positive_float, default=d.settle_s,
                        help="at most this long for the platform to go idle after the load")
    parser.add_argument("--kill-interval-s", type=float_pair,
                        default=",".join(f"{v:g}" for v in d.kill_interval_s),
                        metavar="MIN,MAX", help="seconds between one kill's restart and the "
                                                "next kill, drawn uniformly")
    parser.add_argument("--warmup-s", type=non_negative_float, default=d.warmup_s,
                        help="seconds of load before the first kill")
    parser.add_argument("--stream-fraction", type=fraction, default=d.stream_fraction,
                        help="share of the requests that stream (SSE)")
    parser.add_argument("--max-tokens", type=int_pair,
                        default=",".join(map(str, d.max_tokens)), metavar="MIN,MAX",
                        help="range of each request's max_tokens")
    parser.add_argument("--fresh-worker-ids", action="store_true",
                        help="a restarted inference worker gets a new WORKER_ID (as with the "
                             "default host-pid ids) instead of keeping its own")
    parser.add_argument("--log-dir", default=None, metavar="DIR",
                        help="folder for the processes' logs (default: a new temporary "
                             "folder, kept and printed)")
    parser.add_argument("--out", default=None, metavar="FILE",
                        help="write the JSON report there")
    args = parser.parse_args(argv)
    return Options(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Options)})


def main(argv: list[str] | None = None) -> int:
    options = parse_args(argv)
    report = run(options)
    print(format_report(report))
    return 0 if report["verdict"] == "PASS" else 1


if __name__ == "__main__":
    raise SystemExit(main())
