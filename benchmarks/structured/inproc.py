"""The engine in-process (:class:`~inference.engine.llm_engine.LLMEngine` on its own compute
thread, as in the worker, without Redis or the web tier): the structured workload under each
engine setting, and unconstrained streams beside constrained or unconstrained neighbours.

Token times are taken in the engine's event sink (``time.perf_counter`` as each tick's events
are emitted), so an inter-token latency here is the engine's, without HTTP or Redis."""

from __future__ import annotations

import queue
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from benchmarks.structured.schemas import Answer, Task, one_per_schema

# Unconstrained streams of the ITL comparison: a free-text prompt, EOS ignored.
STREAM_PROMPT = [{"role": "user", "content": "Write a long story about a lighthouse keeper "
                                             "who finds a message in a bottle."}]


def load_backend() -> Any:
    """The default model on the transformers backend in the worker's dtype (``auto``), loaded
    once and shared by every engine of the run."""
    from inference.engine.backends.hf import TransformersBackend
    from inference.protocol.settings import PlatformSettings

    return TransformersBackend.from_pretrained(PlatformSettings().model_folder, dtype="auto")


def make_engine(backend: Any, **settings: Any) -> Any:
    """A fresh engine (fresh counters) on ``backend``; ``settings`` are EngineConfig fields
    beside its defaults."""
    from inference.engine.config import EngineConfig
    from inference.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(backend="transformers", max_pending=10_000, **settings),
                     backend)


def sampling(task: Task | None, *, max_tokens: int, temperature: float = 0.0, seed: int = 0,
             ignore_eos: bool = False) -> Any:
    """SamplingParams for one request: the task's schema as its structured output (None:
    unconstrained); greedy at ``temperature`` 0, else seeded."""
    from inference.engine.request import SamplingParams
    from inference.protocol.structured import StructuredOutput, canonical_json

    structured = (None if task is None else
                  StructuredOutput(kind="json_schema", spec=canonical_json(task.schema_json)))
    extra: dict[str, Any] = {"temperature": temperature, "seed": seed} if temperature else {}
    return SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, structured=structured,
                          **extra)


@dataclass
class Trace:
    """One request as the event sink saw it: token times (perf_counter seconds) and its end."""

    kind: str
    token_times: list[float] = field(default_factory=list)
    final: Any = None


class Pump:
    """Submits requests to a started engine and hands the main thread each event with the time
    the engine emitted it; :meth:`close` shuts the engine down."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.events: queue.SimpleQueue[tuple[float, Any]] = queue.SimpleQueue()
        self.traces: dict[str, Trace] = {}
        self.texts: dict[str, list[str]] = {}
        self._n = 0
        engine.event_sink = self._sink
        engine.start()

    def _sink(self, events: list[Any]) -> None:
        now = time.perf_counter()
        for event in events:
            self.events.put((now, event))

    def submit(self, kind: str, messages: list[dict[str, str]], params: Any) -> str:
        """Submit one request (``kind`` labels it); return its id."""
        self._n += 1
        rid = f"{kind}-{self._n}"
        self.traces[rid], self.texts[rid] = Trace(kind), []
        self.engine.submit(messages=messages, sampling=params, request_id=rid, tenant="bench")
        return rid

    def next_final(self) -> tuple[str, Any]:
        """Wait for the next request to end; record token times on the way."""
        from inference.engine.request import FinalEvent

        while True:
            at, event = self.events.get(timeout=600)
            trace = self.traces[event.request_id]
            if isinstance(event, FinalEvent):
                trace.final = event
                self.texts[event.request_id].append(event.text)
                return event.request_id, event
            trace.token_times.append(at)
            self.texts[event.request_id].append(event.text)

    def answer(self, rid: str, task: Task) -> Answer:
        """The ended request ``rid`` as an :class:`Answer` to ``task``."""
        final = self.traces[rid].final
        reason = getattr(final.finish_reason, "value", final.finish_reason)
        return Answer(task.schema, "".join(self.texts[rid]), str(reason),
                      final.usage.completion_tokens)

    def close(self) -> None:
        self.engine.shutdown()


def warm_up(pump: Pump, tasks: list[Task]) -> None:
    """One 4-token request per schema, one at a time (each grammar compiled once; the engine
    caps a tenant's compiles in flight)."""
    for task in one_per_schema(tasks):
        pump.submit("warm", task.messages, sampling(task, max_tokens=4))
        pump.next_final()


def run_workload(backend: Any, tasks: list[Task], *, concurrency: int, max_tokens: int,
                 temperature: float = 0.0, seed: int = 0,
                 **settings: Any) -> tuple[list[Answer], float, dict[str, Any]]:
    """The structured workload on a fresh engine (``settings``: EngineConfig fields), closed
    loop at ``concurrency`` in flight: a request is submitted when one ends.

    Returns:
        The answers in task order, the run's wall seconds (first submit to last end) and the
        engine's ``stats()["structured"]`` counters after it.
    """
    engine = make_engine(backend, **settings)
    pump = Pump(engine)
    try:
        warm_up(pump, tasks)
        time.sleep(0.3)  # the stats snapshot is published after a tick: let an idle one pass
        before = dict(engine.stats()["structured"])
        ids: dict[str, int] = {}
        todo = list(enumerate(tasks))
        started = time.perf_counter()

        def submit_next() -> None:
            i, task = todo.pop(0)
            ids[pump.submit("json", task.messages, sampling(
                task, max_tokens=max_tokens, temperature=temperature, seed=seed + i))] = i

        while todo and len(ids) < concurrency:
            submit_next()
        for _ in range(len(tasks)):
            pump.next_final()
            if todo:
                submit_next()
        wall = time.perf_counter() - started
        time.sleep(0.3)  # the stats snapshot is published after a tick: let an idle one pass
        after = engine.stats()["structured"]
    finally:
        pump.close()
    answers = [pump.answer(rid, tasks[i]) for rid, i in sorted(ids.items(), key=lambda x: x[1])]
    counters = {k: after[k] - before.get(k, 0) for k in ("masks", "mask_seconds",
                                                          "mask_wait_seconds", "forced_tokens")}
    return answers, wall, counters


def run_streams(backend: Any, tasks: list[Task], *, streams: int, neighbours: int,
                constrained: bool, stream_tokens: int, max_tokens: int,
                lengths: list[int] | None = None, **settings: Any) -> dict[str, Any]:
    """``streams`` unconstrained streams (``stream_tokens`` each, EOS ignored) beside
    ``neighbours`` requests kept in flight (closed loop, the tasks' prompts in turn) until every
    stream ends: with their schema when ``constrained``; else unconstrained, each ``lengths[i]``
    tokens long with EOS ignored (the completion tokens of task ``i``'s constrained answer, so
    that neighbours end and are replaced as often as constrained ones; None: ``max_tokens``,
    ending at EOS). ``settings``: EngineConfig fields beside the defaults.

    Returns:
        The streams' ITL p50 and p90 in ms (gaps between a stream's consecutive tokens), their
        output tokens/s (every stream's tokens over the span from the first to the last) and
        the neighbours' tokens/s over that span.
    """
    engine = make_engine(backend, **settings)
    pump = Pump(engine)
    try:
        warm_up(pump, tasks)
        params = sampling(None, max_tokens=stream_tokens, ignore_eos=True)
        live_streams = {pump.submit("stream", STREAM_PROMPT, params) for _ in range(streams)}
        stream_ids = set(live_streams)
        n = 0
        live_neighbours: set[str] = set()

        def add_neighbour() -> None:
            nonlocal n
            i, n = n % len(tasks), n + 1
            if constrained:
                params = sampling(tasks[i], max_tokens=max_tokens)
            elif lengths:
                params = sampling(None, max_tokens=lengths[i % len(lengths)], ignore_eos=True)
            else:
                params = sampling(None, max_tokens=max_tokens)
            live_neighbours.add(pump.submit("neighbour", tasks[i].messages, params))

        for _ in range(neighbours):
            add_neighbour()
        while live_streams:
            rid, _final = pump.next_final()
            live_streams.discard(rid)
            if rid in live_neighbours:
                live_neighbours.discard(rid)
                add_neighbour()
        for rid in live_neighbours:
            engine.abort(rid)
        while live_neighbours:
            live_neighbours.discard(pump.next_final()[0])
    finally:
        pump.close()
    gaps = [(b - a) * 1000 for rid in stream_ids
            for a, b in zip(pump.traces[rid].token_times, pump.traces[rid].token_times[1:],
                            strict=False)]
    times = [t for rid in stream_ids for t in pump.traces[rid].token_times]
    span = (min(times), max(times)) if len(times) > 1 else (0.0, 0.0)
    beside = sum(span[0] <= t <= span[1] for trace in pump.traces.values()
                 if trace.kind == "neighbour" for t in trace.token_times)
    wide = span[1] - span[0]
    deciles = statistics.quantiles(gaps, n=10) if len(gaps) > 1 else [float("nan")] * 9
    return {"streams": streams, "neighbours": neighbours, "constrained": constrained,
            "settings": settings,
            "neighbour_lengths": "constrained answers'" if lengths and not constrained else None,
            "itl_p50_ms": statistics.median(gaps) if gaps else None, "itl_p90_ms": deciles[8],
            "stream_tok_s": len(times) / wide if wide > 0 else None,
            "neighbour_tok_s": beside / wide if wide > 0 else None,
            "neighbours_done": n - neighbours}
