"""Chaos harness: the platform under load while its processes and Redis are killed, paused and
drained at random.

The acceptance check of the platform's fault tolerance. It starts a private ``redis-server`` on a
free port (AOF with ``appendfsync always`` by default, or no persistence), the platform on it
(:class:`benchmarks.harness.servers.Platform`: its own SQLite database and files folder, three
tenants without rate limits, one of them with a concurrency limit, a fourth without limits for the
Batch API (:data:`~.settings.BATCH_TENANT`), an operator key; the reference backend at a
model-like pace, ``--workers`` inference workers, Celery worker and beat; a worker heartbeat TTL
of 3 s, a web drain of 1 s, 8 lines of a batch in flight at most: :data:`PLATFORM_ENV`), then:

1. drives ``--concurrency`` client loops against ``POST /v1/completions`` (greedy, one of
   :data:`PROMPTS`, ``max_tokens`` 10-120, mostly streamed), and the bursts and long answers not
   streamed the faults ask for (:class:`Steer`): each request is one attempt with a hard
   client-side timeout, recorded with what it received and when each token arrived, and ends as
   ``complete``, ``error`` (a JSON error or an SSE error event with a code), ``refused`` (429/503
   at admission), ``connection_lost`` (daphne was killed while it was open), ``unreachable``
   (daphne was down when it connected) or ``unclear`` (anything else: a hang, a stream cut while
   daphne lived, a 500, unparsable data); beside them, ``--batch-jobs`` Batch API jobs
   (:mod:`.batches`) of ``--batch-lines`` greedy ``/v1/completions`` lines each (one of the
   prompts, ``max_tokens`` drawn as the load's; two lines planted invalid, without a prompt),
   each uploaded and created once with the unmodified ``openai`` client at its moment over the
   first two thirds of the load (a call is retried while the platform cannot have acted on it:
   a connection never made, a 503 or 429; a create whose reply was lost looks for its batch
   before it is sent again);
2. meanwhile runs one fault after another at random moments from a seeded generator, every kind
   of :data:`KINDS` once a round: kills (SIGKILL or SIGTERM) and restarts an inference worker,
   daphne (SIGKILL: the web process dies), the Celery worker, Celery beat or Redis (same port and
   data folder); pauses (SIGSTOP, then SIGCONT after 1.5 to 3 heartbeat TTLs) a worker, once it
   holds requests it has taken and not started (after a burst), or Redis; drains daphne (SIGTERM:
   ``llm_platform/serve.py``) while answers not streamed are in flight, some longer than the
   drain, then restarts it; and restarts any process that exits on its own (as supervisord
   would). A thread dates the processes' log lines (:class:`LogClock`);
3. stops the load, waits for every batch to end (at most ``--batch-wait-s``) and reads back its
   output and error files, lets the platform settle (bounded), and checks, each count's target
   being 0:
   ``unclear`` outcomes; errors that no fault explains (``worker_lost`` without a worker killed or
   paused, ``interrupted`` without a drain, a 4xx such as a take refused as already live) or that
   do not say they may be retried; token integrity against the reference backend's own output
   computed in-process (a complete answer equals the expected text cut to its length, any other
   is a prefix of it); every request's Redis events stream (token ``seq`` 0..n-1, exactly one
   final event); requests generated twice; deaths declared during a pause of a process that was
   alive (a worker reclaimed, a web process taken for gone, a request refused for want of
   workers), and a paused worker's taken requests not served; leaks (gate 1, the shared queue's
   hashes, concurrency leases, the live workers' queues and KV, the Celery queue, the usage
   ledger); usage records: one per request that produced tokens, each billing what its client
   received (never more; exactly it while its web process lived; at most the tokens of its last
   0.5 s less, status 499, when that process died; nothing, prompt included, for a client that
   received nothing, as an answer not streamed that ended in an error): :mod:`.billing`;
4. and the batch jobs, each count's target 0 (:mod:`.batch_checks`): each batch created once and
   ``completed``; every input ``custom_id`` in exactly one of the two files, once; each output
   line the reference backend's answer to its prompt cut to its ``max_tokens``, with the
   ``finish_reason`` that cut implies and usage that counts its text; in the error file only the
   planted lines (400) and lines that failed ``BATCH_MAX_ATTEMPTS`` times (503) with that many
   faults of a worker or Redis during their batch, and every request of a line that ended with
   an error explained by a fault of its kind; ``request_counts`` the files' line counts; one
   usage record per output line billing its usage (its request's, with the batch's id), none
   billing a line in the error file or a line twice; once ended, no line ``waiting`` or
   ``running`` in the database and nothing in Redis naming the batch but events streams within
   their TTL and markers that expire. A batch line's events stream is checked as every stream
   is; its usage records apart from the interactive clients'.

With ``--redis-persistence none`` a restarted Redis starts empty: streams (or parts of streams)
and usage entries it took with it are counted apart, as informational figures, not failures;
a record that exists still never bills more than its client received.

It prints every count and a PASS/FAIL line (exit status 1 on FAIL) and writes the JSON report with
``--out``: every request (``results``), the faults (``kills``, ``kills_by_kind``), what each did
to the clients (``impact``), and for each failure its evidence (``examples``: request ids, what
the client saw, the events stream, the usage records, the log lines naming the request; for a
batch line its batch, ``custom_id``, what the files, its database row and its usage records say,
and the faults during its batch), and the batch jobs (``batches``). The processes' logs stay in
``--log-dir`` (printed).

Its parts: :mod:`.settings` (the prompts, tenants, kinds of fault, platform settings, the checks'
bounds and :class:`Options`), :mod:`.load` (the clients, what each received and how it ended),
:mod:`.batches` (the Batch API jobs, their client, what the platform keeps of them),
:mod:`.expected` (the reference backend's answers),
:mod:`.faults` (the kills, pauses, drains and restarts), :mod:`.timeline` (when each happened),
:mod:`.logclock` (when each log line was written), :mod:`.state` (settling, leaks, events streams
and usage records read back), :mod:`.checks` (the outcomes, tokens, streams and leaks, and the
others' calls), :mod:`.deaths` (the errors and deaths the faults explain), :mod:`.billing` (the
usage records against what each client received), :mod:`.batch_checks` (the batch jobs' lines,
counts, usage and leftovers), :mod:`.findings` (every count and its
evidence), :mod:`.report`, :mod:`.runner` (one run from start to end) and :mod:`.cli`; the
private Redis is the harness's :class:`benchmarks.harness.redis_server.PrivateRedis`.

Usage::

    python -m benchmarks.serving.chaos                       # 7 minutes of chaos, about 7.5 in all
    python -m benchmarks.serving.chaos --duration-s 60 --seed 3 --out /tmp/chaos.json
    python -m benchmarks.serving.chaos --duration-s 60 --batch-jobs 2 --batch-lines 30
    python -m benchmarks.serving.chaos --redis-persistence none --fresh-worker-ids
"""

from __future__ import annotations

from benchmarks.serving.chaos.batch_checks import check_batches
from benchmarks.serving.chaos.batches import BatchJob, BatchState, make_jobs
from benchmarks.serving.chaos.checks import check
from benchmarks.serving.chaos.cli import main, parse_args
from benchmarks.serving.chaos.expected import expected_for, expected_outputs
from benchmarks.serving.chaos.faults import Chaos
from benchmarks.serving.chaos.findings import Findings
from benchmarks.serving.chaos.load import (
    Result,
    Steer,
    classify,
    drive_load,
    parse_sse_event,
    send_one,
)
from benchmarks.serving.chaos.logclock import LogClock, LogLine
from benchmarks.serving.chaos.report import format_report, summarize
from benchmarks.serving.chaos.runner import run
from benchmarks.serving.chaos.settings import KINDS, PLATFORM_ENV, PROMPTS, TENANTS, Options
from benchmarks.serving.chaos.state import StreamSummary, read_leaks, read_streams, settle
from benchmarks.serving.chaos.timeline import Timeline

__all__ = [
    "KINDS", "PLATFORM_ENV", "PROMPTS", "TENANTS", "BatchJob", "BatchState", "Chaos",
    "Findings", "LogClock", "LogLine", "Options", "Result", "Steer", "StreamSummary",
    "Timeline", "check", "check_batches", "classify", "drive_load", "expected_for",
    "expected_outputs", "format_report", "main", "make_jobs", "parse_args", "parse_sse_event",
    "read_leaks", "read_streams", "run", "send_one", "settle", "summarize",
]
