"""The Batch API jobs of a run: made up from the prompts (:func:`make_jobs`), each uploaded and
created once at its moment during the load by a thread with the unmodified ``openai`` client
(:class:`BatchClient`), waited for after the load until it ends and its output and error files
read back (:func:`wait_batches`), and what the platform keeps of them once they ended: their
rows and lines in the database and what Redis still holds that names them
(:func:`read_batch_state`).

A client call is retried while the platform cannot have acted on it: a connection refused or
never made (daphne down), a 503 or 429 answer (draining, Redis away, a limit). A call whose
reply was lost (its connection broke after it was sent) is resolved instead of repeated: a
batch's create looks for a batch of its input file (``batches.list``) and sends the create again
only when there is none, so each job creates one batch; a file's upload is sent again (a second
file of the same lines is harmless, and recorded in the job's ``calls``)."""

from __future__ import annotations

import io
import json
import random
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx
import redis

from benchmarks.harness.servers import Platform
from benchmarks.serving.chaos.settings import BATCH_INVALID_LINES, MODEL, PROMPTS, Options
from benchmarks.serving.chaos.timeline import Timeline
from inference.protocol.keys import EVENTS_TTL_S

T = TypeVar("T")

FINAL_STATUSES = frozenset({"completed", "failed", "expired", "cancelled"})
# How long one client call is tried for (seconds): daphne's restarts take about 2 s each.
CALL_DEADLINE_S = 60.0
# The connection errors raised before a request was sent (nothing reached the platform).
NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout)


@dataclass
class BatchJob:
    """One Batch API job: its input lines (``lines``: ``custom_id``, ``prompt`` (an index of
    :data:`~.settings.PROMPTS`), ``max_tokens``, ``invalid`` (why it is planted invalid, or
    empty), ``body``), when it is created (``at_s``, on the run's clock), and what became of it
    as its client saw it (the batch id, its status and ``request_counts``, the lines of its
    output and error files, each client call that failed in ``calls``)."""

    index: int
    at_s: float
    lines: list[dict[str, Any]]
    file_id: str = ""
    batch_id: str = ""
    created_s: float | None = None
    started_s: float | None = None  # its in_progress_at, on the run's clock
    ended_s: float | None = None  # when it ended (the platform's time), on the run's clock
    status: str = ""
    request_counts: dict[str, int] | None = None
    errors: Any = None
    output: list[dict[str, Any]] = field(default_factory=list)
    error: list[dict[str, Any]] = field(default_factory=list)
    unreadable: list[str] = field(default_factory=list)  # file lines that are not JSON
    calls: list[str] = field(default_factory=list)
    failure: str = ""  # why it could not be created, or its files not read

    def brief(self) -> dict[str, Any]:
        return {"job": self.index, "batch_id": self.batch_id, "file_id": self.file_id,
                "status": self.status, "request_counts": self.request_counts,
                "errors": self.errors, "lines": len(self.lines),
                "invalid_lines": sum(1 for line in self.lines if line["invalid"]),
                "output_lines": len(self.output), "error_lines": len(self.error),
                "created_s": self.created_s, "started_s": self.started_s,
                "ended_s": self.ended_s,
                "failure": self.failure, "failed_calls": len(self.calls),
                "calls": self.calls[-6:]}


@dataclass
class BatchState:
    """What the platform keeps of the run's batches, read once they ended: every Batch row of
    the batch tenant (``batches``), the BatchLine rows of the jobs' batches (``lines``:
    ``batch_id``, ``index``, ``custom_id``, ``state``, ``attempt``, ``request_id``), and what
    Redis still holds that names one of them (``redis_left``: each ``key``, ``why`` and, for an
    entry of a hash, set or list, its ``member``)."""

    batches: list[dict[str, Any]] = field(default_factory=list)
    lines: list[dict[str, Any]] = field(default_factory=list)
    redis_left: list[dict[str, Any]] = field(default_factory=list)


def make_jobs(options: Options) -> list[BatchJob]:
    """``options.batch_jobs`` jobs of ``options.batch_lines`` lines each (greedy completions of
    one of the prompts, ``max_tokens`` drawn as the load draws it; :data:`BATCH_INVALID_LINES`
    of them without a prompt), created evenly over the first two thirds of the load."""
    jobs = []
    span = max(options.duration_s * 2 / 3 - options.warmup_s, 0.0)
    for i in range(options.batch_jobs):
        rng = random.Random(f"{options.seed}-batch-{i}")
        invalid = set(rng.sample(range(options.batch_lines),
                                 min(BATCH_INVALID_LINES, options.batch_lines // 2)))
        lines = []
        for n in range(options.batch_lines):
            prompt, max_tokens = rng.randrange(len(PROMPTS)), rng.randint(*options.max_tokens)
            body: dict[str, Any] = {"model": MODEL, "prompt": PROMPTS[prompt],
                                    "max_tokens": max_tokens, "temperature": 0}
            if n in invalid:
                del body["prompt"]
            lines.append({"custom_id": f"job{i}-line{n}", "prompt": prompt,
                          "max_tokens": max_tokens,
                          "invalid": "no body.prompt" if n in invalid else "", "body": body})
        at = options.warmup_s + span * (i + 0.5) / options.batch_jobs
        jobs.append(BatchJob(index=i, at_s=round(at, 2), lines=lines))
    return jobs


def jsonl(job: BatchJob) -> bytes:
    """The job's input file."""
    return b"".join(json.dumps({"custom_id": line["custom_id"], "method": "POST",
                                "url": "/v1/completions", "body": line["body"]}).encode()
                    + b"\n" for line in job.lines)


class CallFailed(Exception):
    """A client call that could not be made within :data:`CALL_DEADLINE_S`, or was refused."""


def client_for(url: str, key: str) -> Any:
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=30.0)


def call(job: BatchJob, what: str, fn: Callable[[], T], clock: Callable[[], float],
         resolve: Callable[[], T | None] | None = None) -> T:
    """``fn()``, tried again while the platform cannot have acted on it (the module
    docstring); a lost reply is given to ``resolve`` (None: not made, try again), else tried
    again. Every failure is noted in ``job.calls``.

    Raises:
        CallFailed: refused (another status), or not made within :data:`CALL_DEADLINE_S`.
    """
    import openai

    deadline = time.monotonic() + CALL_DEADLINE_S
    while True:
        try:
            return fn()
        except openai.APIStatusError as exc:
            note, again = f"HTTP {exc.status_code} {exc.body}"[:300], exc.status_code in (429,
                                                                                        503)
        except openai.APIConnectionError as exc:
            cause = exc.__cause__
            note, again = f"{type(cause).__name__}: {cause}"[:300], True
            if not isinstance(cause, NOT_SENT) and resolve is not None:
                job.calls.append(f"{clock():.1f}s {what}: reply lost ({note}): resolving")
                found = resolve()
                if found is not None:
                    return found
        job.calls.append(f"{clock():.1f}s {what}: {note}")
        if not again or time.monotonic() > deadline:
            raise CallFailed(f"{what}: {note}")
        time.sleep(0.5)


def submit(client: Any, job: BatchJob, clock: Callable[[], float]) -> None:
    """Upload the job's file and create its batch (each once: :func:`call`)."""
    made = call(job, "files.create", lambda: client.files.create(
        file=(f"chaos-job{job.index}.jsonl", io.BytesIO(jsonl(job))), purpose="batch"), clock)
    job.file_id = made.id

    def create() -> Any:
        return client.batches.create(input_file_id=job.file_id, endpoint="/v1/completions",
                                     completion_window="24h")

    def find() -> Any:
        listed = call(job, "batches.list", lambda: client.batches.list(limit=100), clock)
        return next((b for b in listed.data if b.input_file_id == job.file_id), None)

    batch = call(job, "batches.create", create, clock, resolve=find)
    job.batch_id, job.status, job.created_s = batch.id, batch.status, round(clock(), 2)


class BatchClient(threading.Thread):
    """Creates each job's batch at its ``at_s`` until :meth:`stop` (a job not yet due then is
    never created: its ``failure`` says so)."""

    def __init__(self, url: str, key: str, jobs: list[BatchJob], timeline: Timeline):
        super().__init__(name="chaos-batches", daemon=True)
        self.url, self.key, self.jobs, self.timeline = url, key, jobs, timeline
        self._halt = threading.Event()

    def stop(self) -> None:
        self._halt.set()

    def run(self) -> None:
        client = client_for(self.url, self.key)
        try:
            for job in self.jobs:
                while not self._halt.is_set() and self.timeline.now() < job.at_s:
                    self._halt.wait(0.2)
                if self._halt.is_set():
                    job.failure = "the load ended before its moment"
                    continue
                try:
                    submit(client, job, self.timeline.now)
                    print(f"[batch {self.timeline.now():7.1f}s] job {job.index}: "
                          f"{job.batch_id} ({len(job.lines)} lines)", flush=True)
                except CallFailed as exc:
                    job.failure = f"not created: {exc}"
        except Exception:  # noqa: BLE001 - a harness failure is reported, never a PASS
            self.timeline.errors.append(traceback.format_exc())
        finally:
            client.close()


def _read_file(client: Any, job: BatchJob, file_id: str | None, clock: Callable[[], float],
               into: list[dict[str, Any]]) -> None:
    if not file_id:
        return
    content = call(job, "files.content", lambda: client.files.content(file_id), clock)
    for raw in content.content.splitlines():
        if not raw.strip():
            continue
        try:
            into.append(json.loads(raw))
        except ValueError:
            job.unreadable.append(raw[:300].decode(errors="replace"))


def wait_batches(url: str, key: str, jobs: list[BatchJob], timeout_s: float,
                 timeline: Timeline) -> dict[str, Any]:
    """Wait (at most ``timeout_s``) until every created job's batch has a final status, then
    read its output and error files; return how long it took and what was left unended."""
    clock = timeline.now
    started = time.monotonic()
    client = client_for(url, key)
    pending = [job for job in jobs if job.batch_id]
    try:
        while pending:
            for job in list(pending):
                try:
                    shown = call(job, "batches.retrieve",
                                 lambda job=job: client.batches.retrieve(job.batch_id), clock)
                except CallFailed as exc:
                    job.failure = f"not read: {exc}"
                    continue
                job.status, job.errors = shown.status, (
                    shown.errors.model_dump() if shown.errors else None)
                job.request_counts = (shown.request_counts.model_dump()
                                      if shown.request_counts else None)
                if shown.in_progress_at:
                    job.started_s = round(timeline.of_unix(shown.in_progress_at), 2)
                if job.status in FINAL_STATUSES:
                    at = getattr(shown, f"{job.status}_at", None)
                    job.ended_s = round(timeline.of_unix(at) if at else clock(), 2)
                    pending.remove(job)
                    try:
                        _read_file(client, job, shown.output_file_id, clock, job.output)
                        _read_file(client, job, shown.error_file_id, clock, job.error)
                    except CallFailed as exc:
                        job.failure = f"files not read: {exc}"
            if not pending or time.monotonic() - started > timeout_s:
                break
            time.sleep(1.0)
    finally:
        client.close()
    return {"waited_s": round(time.monotonic() - started, 1),
            "not_ended": [job.batch_id for job in pending]}


_READ_BATCHES = """
import json, os
from api.models import Batch, BatchLine
batches = list(Batch.objects.filter(tenant__slug=os.environ["CHAOS_BATCH_TENANT"]).values(
    "id", "status", "input_file_id", "total", "completed", "failed", "errors"))
ids = json.loads(os.environ["CHAOS_BATCH_IDS"])
lines = list(BatchLine.objects.filter(batch_id__in=ids).values(
    "batch_id", "index", "custom_id", "state", "attempt", "request_id"))
print("BATCHES " + json.dumps({"batches": batches, "lines": lines}, default=str))
"""


def read_batch_state(platform: Platform, client: redis.Redis, tenant: str,
                     jobs: list[BatchJob]) -> BatchState:
    """The platform's rows of the batch tenant's batches and of the jobs' lines, and what Redis
    holds naming one of the jobs' batches (:func:`redis_left`)."""
    ids = [job.batch_id for job in jobs if job.batch_id]
    out = platform.manage("shell", "-c", _READ_BATCHES, CHAOS_BATCH_TENANT=tenant,
                          CHAOS_BATCH_IDS=json.dumps(ids))
    line = next(x for x in out.splitlines() if x.startswith("BATCHES "))
    rows = json.loads(line[len("BATCHES "):])
    return BatchState(batches=rows["batches"], lines=rows["lines"],
                      redis_left=redis_left(client, platform.stack.prefix, ids))


def redis_left(client: redis.Redis, prefix: str, batch_ids: list[str]) -> list[dict[str, Any]]:
    """What Redis holds under ``prefix`` that names one of ``batch_ids`` once they ended: a key
    without an expiry (an events stream may stay until its ``EVENTS_TTL_S``, a marker until its
    own expiry), an entry of the active batches' figures, or a member of a hash, set, sorted set
    (a concurrency lease not yet lapsed) or list that never expires (the shared queue, the usage
    ledger)."""
    if not batch_ids:
        return []

    def names(text: str) -> bool:
        return any(b in text for b in batch_ids)

    left: list[dict[str, Any]] = []
    now_ms = time.time() * 1000
    for raw in client.scan_iter(f"{prefix}:*", count=1000):
        key = raw.decode()
        ttl = client.ttl(raw)
        if names(key):
            if key.startswith(f"{prefix}:events:"):
                if not 0 < ttl <= EVENTS_TTL_S:
                    left.append({"key": key, "why": f"an events stream with TTL {ttl}"})
            elif ttl < 0:
                left.append({"key": key, "why": "a key that never expires"})
            continue
        if ttl >= 0:
            continue
        kind = client.type(raw).decode()
        if kind == "hash":
            members = [m.decode() for m in client.hkeys(raw)]
        elif kind == "set":
            members = [m.decode() for m in client.smembers(raw)]
        elif kind == "zset":
            low = now_ms if key.startswith(f"{prefix}:conc:") else "-inf"
            members = [m.decode() for m in client.zrangebyscore(raw, low, "+inf")]
        elif kind == "list":
            members = [m.decode(errors="replace") for m in client.lrange(raw, 0, -1)]
        else:
            continue
        left.extend({"key": key, "why": f"an entry of a {kind}", "member": m[:200]}
                    for m in members if names(m))
    return left
