"""A load generator for serving benchmarks: workloads, targets, and vLLM's serving metrics.

Workloads are lists of :class:`RequestSpec` (a prompt, ``max_tokens``, a tenant, an arrival
time). They are sent by :func:`run_load` to a target, either the REST API (:class:`RestTarget`:
``POST /v1/completions`` with SSE streaming, one API key per tenant) or the engine in-process
(:class:`EngineTarget`), with open-loop arrivals (each request at its ``arrival_s``, e.g. Poisson)
and an optional bound on requests in flight (fixed concurrency: every ``arrival_s`` 0 and a
bound). Each request gives a :class:`RequestResult`; :func:`summarize` turns them into the metrics
of vLLM's ``benchmarks/benchmark_serving.py``:

* TTFT: from sending a request to its first streamed token;
* TPOT: per request, ``(e2e - ttft) / (output_tokens - 1)``, over requests of more than one token;
* ITL: every gap between two consecutive streamed chunks, over all requests;
* E2EL: from sending a request to its last chunk;
* request, output-token and total-token throughput over the run's duration (first send to last
  completion), and goodput: requests per second that meet every stated SLO.

Latencies are reported in milliseconds (mean, median, std, p90, p99); rejected requests (HTTP
429) and errors are counted apart, with their reasons (:func:`failure_counts`), and excluded from
the latency figures.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import numpy as np
from tqdm import tqdm

PERCENTILES = (50, 90, 99)
METRICS = ("ttft", "tpot", "itl", "e2el")


# --------------------------------------------------------------------------- workloads


@dataclass
class RequestSpec:
    """One request of a workload.

    Attributes:
        prompt: the prompt text (sent as ``/v1/completions``' ``prompt``).
        max_tokens: tokens to generate; with ``ignore_eos`` exactly this many.
        tenant: who sends it (its API key on the REST API, its fairness key in-process).
        arrival_s: when to send it, seconds after the run starts.
        prompt_len: prompt tokens as built (the server's count is in the result).
        tag: a label for grouping results (e.g. ``long`` or ``short``).
    """

    prompt: str
    max_tokens: int
    tenant: str = "default"
    arrival_s: float = 0.0
    prompt_len: int = 0
    tag: str = ""
    ignore_eos: bool = True


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...


# Plain words for prompt text (random token ids would make an atypical workload).
_WORD_LIST = (
    "the of and to in is was for on that with as by at from this be are or an it his which "
    "have not but were had they one all their has been more when there who will would so "
    "time city river system model light water energy people history market music school "
    "garden winter engine signal memory station island letter summer forest bridge harbour "
    "theory planet library kitchen question number morning village country mountain story "
    "measure process protein network journey language picture weather surface problem "
    "careful quiet bright ancient simple rapid distant gentle narrow modern silent golden "
    "walks builds carries finds opens writes reads follows changes reaches holds turns"
)
_WORDS = _WORD_LIST.split()


class PromptMaker:
    """Prompt texts of (about) a given number of tokens, cut from a seeded corpus of words.

    Args:
        tokenizer: the served model's tokenizer (``encode`` and ``decode``).
        seed: the corpus and the cuts depend only on it.
        corpus_words: words in the corpus (enough for the longest prompt).
    """

    def __init__(self, tokenizer: Tokenizer, seed: int = 0, corpus_words: int = 20_000):
        rng = random.Random(seed)
        words = []
        for i in range(corpus_words):
            word = rng.choice(_WORDS)
            words.append(word.capitalize() + "." if i % 13 == 12 else word)
        self.tokenizer = tokenizer
        self.ids = tokenizer.encode(" ".join(words))

    def make(self, num_tokens: int, rng: random.Random) -> str:
        """A text of ``num_tokens`` corpus tokens from a random offset (re-encoding it may
        differ by a token or two at the edges)."""
        if num_tokens > len(self.ids):
            raise ValueError(f"corpus has {len(self.ids)} tokens, {num_tokens} asked")
        start = rng.randrange(0, len(self.ids) - num_tokens + 1)
        return self.tokenizer.decode(self.ids[start:start + num_tokens])


def poisson_arrivals(rate: float, duration_s: float, rng: random.Random,
                     windows: Sequence[tuple[float, float]] | None = None,
                     start_s: float = 0.0) -> list[float]:
    """Arrival times (seconds) of a Poisson process of ``rate`` requests/s in
    ``[start_s, start_s + duration_s)``; with ``windows``, only those falling inside one of the
    ``(begin, end)`` windows are kept (a tenant switching on and off)."""
    times, t = [], start_s
    while rate > 0:
        t += rng.expovariate(rate)
        if t >= start_s + duration_s:
            break
        if windows is None or any(b <= t < e for b, e in windows):
            times.append(t)
    return times


def random_requests(maker: PromptMaker, arrivals: Iterable[float], input_len: tuple[int, int],
                    output_len: tuple[int, int], rng: random.Random, *, tenant: str = "default",
                    tag: str = "") -> list[RequestSpec]:
    """One request per arrival time, prompt and output lengths uniform in the inclusive ranges
    (tokens), like vLLM's random dataset."""
    specs = []
    for t in arrivals:
        n_in, n_out = rng.randint(*input_len), rng.randint(*output_len)
        specs.append(RequestSpec(maker.make(n_in, rng), n_out, tenant, t, n_in, tag))
    return specs


def shared_prefix_requests(maker: PromptMaker, arrivals: Iterable[float], num_prefixes: int,
                           prefix_len: int, suffix_len: int, output_len: int,
                           rng: random.Random, *, tenant: str = "default") -> list[RequestSpec]:
    """Requests whose prompts are one of ``num_prefixes`` shared prefixes (``prefix_len``
    tokens, e.g. a system prompt or a document) followed by a unique suffix (``suffix_len``
    tokens), like vLLM's prefix-repetition dataset. ``tag`` is the prefix's index."""
    prefixes = [maker.make(prefix_len, rng) for _ in range(num_prefixes)]
    specs = []
    for i, t in enumerate(arrivals):
        k = i % num_prefixes
        prompt = prefixes[k] + " " + maker.make(suffix_len, rng)
        specs.append(RequestSpec(prompt, output_len, tenant, t, prefix_len + suffix_len,
                                 f"prefix{k}"))
    return specs


def merge(*workloads: Iterable[RequestSpec]) -> list[RequestSpec]:
    """All requests of several workloads, in order of arrival."""
    return sorted((s for w in workloads for s in w), key=lambda s: s.arrival_s)


# --------------------------------------------------------------------------- results


@dataclass
class RequestResult:
    """What one request saw, times in seconds from the start of the run.

    ``status`` is ``ok``, ``rejected`` (HTTP 429 or the engine's queue-full refusal),
    ``error`` or ``cancelled``; ``chunk_times_s`` are the arrival times of the streamed chunks
    that carried text; ``arrival_s`` is when the workload scheduled the request (``sent_s`` is
    later when a bound on requests in flight held it back) and ``max_tokens`` what it asked for.
    """

    tenant: str
    tag: str
    status: str
    http_status: int
    sent_s: float
    chunk_times_s: list[float] = field(default_factory=list)
    ended_s: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_prompt_tokens: int = 0
    error: str = ""
    arrival_s: float = 0.0
    max_tokens: int = 0

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_times_s[0] - self.sent_s if self.chunk_times_s else None

    @property
    def e2el_s(self) -> float:
        return self.ended_s - self.sent_s

    @property
    def tpot_s(self) -> float | None:
        """``(e2e - ttft) / (output_tokens - 1)``; None for a request of one token or less."""
        if self.output_tokens <= 1 or self.ttft_s is None:
            return None
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def itls_s(self) -> list[float]:
        ts = self.chunk_times_s
        return [b - a for a, b in zip(ts, ts[1:], strict=False)]

    def to_dict(self) -> dict[str, Any]:
        """Every field, and the derived TTFT, TPOT, E2EL, the gaps between chunks (``itls_s``)
        and, for a request that did not complete, its :func:`failure_reason` (else ``""``)."""
        d = asdict(self)
        d.update(ttft_s=self.ttft_s, tpot_s=self.tpot_s, e2el_s=self.e2el_s,
                 itls_s=self.itls_s,
                 failure_reason="" if self.status == "ok" else failure_reason(self))
        return d


def records(results: Iterable[RequestResult], digits: int = 6) -> list[dict[str, Any]]:
    """Each request's result as a JSON-ready dict (:meth:`RequestResult.to_dict`), times rounded
    to ``digits`` decimals of a second (microseconds): what an experiment's JSON keeps so that
    every figure can be computed again from it."""

    def rounded(value: Any) -> Any:
        if isinstance(value, float):
            return round(value, digits)
        if isinstance(value, list):
            return [rounded(v) for v in value]
        return value

    return [{k: rounded(v) for k, v in r.to_dict().items()} for r in results]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile with linear interpolation (numpy's default); nan when empty."""
    return float(np.percentile(values, q)) if len(values) else math.nan


def describe_ms(values_s: Sequence[float]) -> dict[str, float]:
    """mean, median, std, p90 and p99 of durations given in seconds, in milliseconds."""
    ms = [v * 1000 for v in values_s]
    if not ms:
        return {"mean": math.nan, "median": math.nan, "std": math.nan, "p90": math.nan,
                "p99": math.nan}
    return {"mean": float(np.mean(ms)), "median": float(np.median(ms)), "std": float(np.std(ms)),
            "p90": percentile(ms, 90), "p99": percentile(ms, 99)}


def meets_slos(result: RequestResult, slos_ms: dict[str, float]) -> bool:
    """Whether a completed request meets every SLO given (keys ``ttft``, ``tpot``, ``e2el``,
    in ms); a request without a TPOT (one token) passes the TPOT SLO, as in vLLM."""
    values = {"ttft": result.ttft_s, "tpot": result.tpot_s, "e2el": result.e2el_s}
    for name, limit in slos_ms.items():
        value = values[name]
        if value is not None and value * 1000 > limit:
            return False
    return True


def failure_reason(result: RequestResult) -> str:
    """A short reason for a request that did not complete: ``HTTP <status> <code>: <message>``
    (from the OpenAI-style error body when there is one), or the exception's text (e.g.
    ``ConnectError: All connection attempts failed``)."""
    if result.status == "cancelled":
        return "cancelled (still in flight when the run stopped)"
    text = result.error.strip()
    message = text
    try:
        body = json.loads(text) if text else None
    except ValueError:
        body = None
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            code = err.get("code") or err.get("type") or ""
            message = f"{code}: {err.get('message', '')}".strip(": ") if code else str(
                err.get("message", text))
        elif isinstance(err, str):
            message = err
    message = " ".join(message.split())[:200] or "no detail"
    return f"HTTP {result.http_status} {message}" if result.http_status else message


def failure_group(result: RequestResult) -> str:
    """What identical failures share, without per-request numbers: ``HTTP <status> <code>``
    (e.g. ``HTTP 429 kv_budget_exceeded``), ``HTTP <status>`` when the body has no code, the
    exception's type for a client error (e.g. ``ConnectError``), or ``cancelled``."""
    if result.status == "cancelled":
        return "cancelled"
    text = result.error.strip()
    try:
        body = json.loads(text) if text else None
    except ValueError:
        body = None
    code = ""
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            code = str(err.get("code") or err.get("type") or "")
    if result.http_status:
        return f"HTTP {result.http_status} {code}".strip()
    head, sep, _ = text.partition(":")
    return head.strip() if sep and head.strip() and " " not in head.strip() else (
        text[:80] or "no detail")


def failure_counts(results: Iterable[RequestResult]) -> dict[str, int]:
    """How many requests failed (rejected, error or cancelled) in each :func:`failure_group`,
    most frequent first."""
    counts: dict[str, int] = {}
    for r in results:
        if r.status != "ok":
            group = failure_group(r)
            counts[group] = counts.get(group, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def failure_examples(results: Iterable[RequestResult]) -> dict[str, str]:
    """One :func:`failure_reason` (the first) per :func:`failure_group`."""
    examples: dict[str, str] = {}
    for r in results:
        if r.status != "ok":
            examples.setdefault(failure_group(r), failure_reason(r))
    return examples


def summarize(results: Sequence[RequestResult], duration_s: float | None = None,
              slos_ms: dict[str, float] | None = None) -> dict[str, Any]:
    """vLLM's serving metrics of a run (latencies in ms; throughputs per second).

    Args:
        results: every request sent.
        duration_s: the run's duration; by default from the first send to the last end.
        slos_ms: goodput's SLOs, e.g. ``{"ttft": 500, "tpot": 100}``; none: goodput is absent.
    """
    ok = [r for r in results if r.status == "ok"]
    if duration_s is None:
        duration_s = (max((r.ended_s for r in results), default=0.0)
                      - min((r.sent_s for r in results), default=0.0))
    duration_s = max(duration_s, 1e-9)
    rejected = [r for r in results if r.status == "rejected"]
    out: dict[str, Any] = {
        "requests": len(results),
        "completed": len(ok),
        "rejected_429": len(rejected),
        "errors": sum(r.status == "error" for r in results),
        "cancelled": sum(r.status == "cancelled" for r in results),
        "failures_by_reason": failure_counts(results),
        "failure_examples": failure_examples(results),
        "duration_s": duration_s,
        "total_input_tokens": sum(r.prompt_tokens for r in ok),
        "total_output_tokens": sum(r.output_tokens for r in ok),
        "cached_prompt_tokens": sum(r.cached_prompt_tokens for r in ok),
        "request_throughput": len(ok) / duration_s,
        "output_throughput": sum(r.output_tokens for r in ok) / duration_s,
        "total_token_throughput": sum(r.prompt_tokens + r.output_tokens for r in ok) / duration_s,
        "ttft_ms": describe_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_ms": describe_ms([r.tpot_s for r in ok if r.tpot_s is not None]),
        "itl_ms": describe_ms([g for r in ok for g in r.itls_s]),
        "e2el_ms": describe_ms([r.e2el_s for r in ok]),
        "rejection_latency_ms": describe_ms([r.e2el_s for r in rejected]),
    }
    if slos_ms:
        good = sum(meets_slos(r, slos_ms) for r in ok)
        out["slos_ms"] = dict(slos_ms)
        out["good_requests"] = good
        out["goodput"] = good / duration_s
    return out


def summarize_by(results: Sequence[RequestResult], key: Callable[[RequestResult], str],
                 duration_s: float | None = None,
                 slos_ms: dict[str, float] | None = None) -> dict[str, dict[str, Any]]:
    """:func:`summarize` per group (e.g. ``key=lambda r: r.tenant``), over the whole run's
    duration so that the groups' throughputs add up."""
    if duration_s is None and results:
        duration_s = max(r.ended_s for r in results) - min(r.sent_s for r in results)
    groups: dict[str, list[RequestResult]] = {}
    for r in results:
        groups.setdefault(key(r), []).append(r)
    return {k: summarize(v, duration_s, slos_ms) for k, v in sorted(groups.items())}


# --------------------------------------------------------------------------- targets


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
                 model: str = "SmolLM2-135M-Instruct", timeout_s: float = 600):
        import httpx

        self.url = base_url.rstrip("/") + "/v1/completions"
        self.keys = keys
        self.model = model
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))

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
                async for line in resp.aiter_lines():
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
                        result.chunk_times_s.append(clock())
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


@dataclass
class TenantSettings:
    """How the in-process target submits a tenant's requests (what the web tier would set)."""

    priority: int = 0
    fairness_weight: float = 1.0


class EngineTarget:
    """The engine in-process, on its own worker thread (as in the worker process, without Redis
    or the web tier). Token times are taken in the engine's event sink, when each tick ends.

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
        from inference.engine import EngineRefusal
        from inference.request import FinalEvent, SamplingParams

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
                sampling=SamplingParams(max_tokens=spec.max_tokens, ignore_eos=spec.ignore_eos))
        except EngineRefusal as exc:
            self._queues.pop(rid)
            result.status = "rejected" if exc.error.status == 429 else "error"
            result.http_status = exc.error.status
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
            result.http_status = event.error.status if event.error else 500
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


# --------------------------------------------------------------------------- command line


def positive_int(text: str) -> int:
    """argparse ``type``: an integer >= 1."""
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def non_negative_int(text: str) -> int:
    """argparse ``type``: an integer >= 0."""
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must not be negative")
    return value


def positive_float(text: str) -> float:
    """argparse ``type``: a finite number > 0."""
    import argparse

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text} must be a number greater than 0")
    return value


def non_negative_float(text: str) -> float:
    """argparse ``type``: a finite number >= 0."""
    import argparse

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text} must be a number of at least 0")
    return value


def tenant_key(text: str) -> tuple[str, str]:
    """argparse ``type``: ``TENANT=KEY`` (both non-empty)."""
    import argparse

    tenant, sep, key = text.partition("=")
    if not sep or not tenant.strip() or not key.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is not TENANT=KEY (e.g. alice=sk-...)")
    return tenant.strip(), key.strip()


def slo(text: str) -> tuple[str, float]:
    """argparse ``type``: ``NAME=MS`` with NAME one of ttft, tpot, e2el and MS > 0."""
    import argparse

    name, sep, ms = text.partition("=")
    name = name.strip().lower()
    if not sep or name not in ("ttft", "tpot", "e2el"):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not NAME=MS with NAME one of ttft, tpot, e2el (e.g. ttft=500)")
    try:
        value = float(ms)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: {ms!r} is not a number of ms") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: the limit must be greater than 0 ms")
    return name, value


def build_parser():
    """The command line of ``python -m benchmarks.loadgen``."""
    import argparse

    from benchmarks.common import HelpFormatter

    parser = argparse.ArgumentParser(
        description="Send one workload and print vLLM's serving metrics (JSON under "
                    "benchmarks/results/).",
        formatter_class=HelpFormatter)
    parser.add_argument("--target", choices=("rest", "engine"), default="rest",
                        help="the REST API of a running platform, or the engine in-process")
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the platform (rest)")
    parser.add_argument("--key", action="append", type=tenant_key, default=[],
                        metavar="TENANT=KEY",
                        help="an API key per tenant (rest); requests go round-robin")
    parser.add_argument("--backend", choices=("transformers", "reference"),
                        default="transformers",
                        help="prompts' tokenizer, and the engine's backend (engine); with "
                             "--target rest, give the platform's BACKEND")
    parser.add_argument("--dataset", choices=("random", "shared-prefix"), default="random",
                        help="random-length prompts, or shared prefixes plus unique suffixes")
    parser.add_argument("--requests", type=positive_int, default=64, help="requests to send")
    parser.add_argument("--rate", type=non_negative_float, default=0,
                        help="Poisson arrivals, requests/s over all tenants (0: all at once)")
    parser.add_argument("--concurrency", type=non_negative_int, default=0,
                        help="max in flight (0: no bound)")
    parser.add_argument("--input-len", type=positive_int, nargs=2, default=(64, 256),
                        metavar=("MIN", "MAX"),
                        help="prompt tokens (shared-prefix: MIN is the suffix length)")
    parser.add_argument("--output-len", type=positive_int, nargs=2, default=(32, 128),
                        metavar=("MIN", "MAX"),
                        help="output tokens (shared-prefix: MIN for every request)")
    parser.add_argument("--prefixes", type=positive_int, default=4, help="shared-prefix: prefixes")
    parser.add_argument("--prefix-len", type=positive_int, default=512,
                        help="shared-prefix: tokens")
    parser.add_argument("--slo", action="append", type=slo, default=[], metavar="NAME=MS",
                        help="goodput SLO, NAME one of ttft, tpot, e2el, e.g. ttft=500")
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    parser.add_argument("--name", default="loadgen", help="results file name")
    parser.add_argument("--out-dir", default=None, metavar="DIR",
                        help="folder for the JSON (default: benchmarks/results/)")
    return parser


def parse_args(argv: list[str] | None = None):
    """Parsed and checked arguments (``parser.error`` on a bad combination)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    for flag in ("input_len", "output_len"):
        lo, hi = getattr(args, flag)
        if lo > hi:
            parser.error(f"--{flag.replace('_', '-')}: MIN ({lo}) is greater than MAX ({hi})")
    tenants = [t for t, _ in args.key]
    if len(set(tenants)) != len(tenants):
        parser.error("--key: a tenant is given more than once")
    if args.key and args.target == "engine":
        parser.error("--key applies to --target rest only")
    return args


def report(summary: dict[str, Any], label: str = "") -> str | None:
    """Print a one-line warning when requests failed (``label``: which run); return the most
    frequent failure group when every request failed."""
    import sys

    failed = summary["requests"] - summary["completed"]
    if not failed:
        return None
    reasons = summary.get("failures_by_reason", {})
    first = next(iter(reasons), "unknown")
    example = summary.get("failure_examples", {}).get(first, "")
    detail = f", e.g. {example}" if example and example != first else ""
    print(f"WARNING: {label + ': ' if label else ''}{failed} of {summary['requests']} requests "
          f"did not complete ({summary['rejected_429']} rejected with 429, {summary['errors']} "
          f"errors, {summary.get('cancelled', 0)} cancelled); most frequent: {first} "
          f"(x{reasons.get(first, failed)}{detail})", file=sys.stderr)
    return first if summary["completed"] == 0 else None


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.loadgen``: one load against a running platform or the engine.

    Exit status 0, or 1 when no request completed (the first failure's reason on stderr).
    """
    import sys

    from benchmarks.common import (
        finite,
        machine,
        model_tokenizer,
        reference_tokenizer,
        write_json,
    )

    args = parse_args(argv)
    keys = dict(args.key) or {"default": ""}
    tenants = list(keys)
    tokenizer = model_tokenizer() if args.backend == "transformers" else reference_tokenizer()
    rng = random.Random(args.seed)
    maker = PromptMaker(tokenizer, seed=args.seed)
    arrivals = _n_arrivals(args, rng) if args.rate else [0.0] * args.requests
    if args.dataset == "random":
        specs = random_requests(maker, arrivals, tuple(args.input_len), tuple(args.output_len),
                                rng)
    else:
        specs = shared_prefix_requests(maker, arrivals, args.prefixes, args.prefix_len,
                                       args.input_len[0], args.output_len[0], rng)
    for i, spec in enumerate(specs):
        spec.tenant = tenants[i % len(tenants)]
    slos = dict(args.slo)
    before = machine()

    async def go() -> tuple[list[RequestResult], float]:
        if args.target == "rest":
            target: Any = RestTarget(args.url, keys)
        else:
            from benchmarks.common import make_engine

            target = EngineTarget(make_engine(real_model=args.backend == "transformers",
                                              max_queue_size=max(256, args.requests)))
        async with target:
            return await run_load(target, specs, max_concurrency=args.concurrency or None)

    results, duration = asyncio.run(go())
    summary = summarize(results, duration, slos or None)
    print(json.dumps(finite(summary), indent=1, default=float))
    path = write_json(args.name, {"args": vars(args), "machine_before": before,
                                  "summary": summary,
                                  "per_tenant": summarize_by(results, lambda r: r.tenant,
                                                             duration, slos or None),
                                  "results": records(results)}, args.out_dir)
    print(f"wrote {path}")
    all_failed = report(summary)
    if all_failed is not None:
        print(f"ERROR: no request completed; first error: {_first_error(results)}",
              file=sys.stderr)
        return 1
    return 0


def _first_error(results: Sequence[RequestResult]) -> str:
    """The reason of the first request (by send time) that did not complete."""
    failed = sorted((r for r in results if r.status != "ok"), key=lambda r: r.sent_s)
    return failure_reason(failed[0]) if failed else "none"


def _n_arrivals(args: Any, rng: random.Random) -> list[float]:
    """``args.requests`` Poisson arrival times at ``args.rate`` requests/s."""
    times, t = [], 0.0
    for _ in range(args.requests):
        t += rng.expovariate(args.rate)
        times.append(t)
    return times


if __name__ == "__main__":
    raise SystemExit(main())
