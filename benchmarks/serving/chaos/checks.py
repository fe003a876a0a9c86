"""The checks of a run, each count's target 0: what every client received against the reference
backend's own output, every events stream, requests generated twice, the errors and deaths the
faults explain (:mod:`.deaths`), what was billed against what each client received
(:mod:`.billing`), the leaks, and the Batch API jobs' lines, counts, usage and leftovers
(:mod:`.batch_checks`); each failure with its evidence (:mod:`.findings`)."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any

from benchmarks.serving.chaos.batch_checks import (
    check_batches,
    is_batch_record,
    is_batch_request,
)
from benchmarks.serving.chaos.batches import BatchJob, BatchState
from benchmarks.serving.chaos.billing import check_usage
from benchmarks.serving.chaos.deaths import (
    check_deaths,
    check_errors,
    check_paused_takes,
    check_refusals,
)
from benchmarks.serving.chaos.expected import expected_for
from benchmarks.serving.chaos.findings import Evidence, Findings
from benchmarks.serving.chaos.load import Result
from benchmarks.serving.chaos.logclock import LogLine
from benchmarks.serving.chaos.settings import MAX_EXAMPLES, Options
from benchmarks.serving.chaos.state import StreamSummary
from benchmarks.serving.chaos.timeline import Timeline
from inference.protocol.keys import EVENTS_TTL_S


def check(results: list[Result], streams: dict[str, StreamSummary],
          records: list[dict[str, Any]], leaks: dict[str, int], leak_details: dict[str, Any],
          answers: list[tuple[str, int | None]], timeline: Timeline, options: Options,
          collected_at: float, death_lines: list[LogLine] | None = None,
          batch_jobs: list[BatchJob] | None = None, batch_state: BatchState | None = None,
          ) -> tuple[Findings, dict[str, int]]:
    """The checks: (findings whose target is 0, informational counts).

    ``death_lines`` are the logs' lines that declare a death, dated
    (:data:`.deaths.DEATH_LINE`). ``batch_jobs`` are the run's Batch API jobs as their client
    saw them and ``batch_state`` what the platform kept of them (:mod:`.batch_checks`); their
    lines' events streams are checked as every stream is, their usage records apart from the
    interactive clients' (:mod:`.billing`).

    With ``options.redis_persistence == "none"`` a Redis restart loses what it held: a stream
    missing, or holding only part of its request's events, when Redis restarted while the
    request was open is counted apart (informational), not as a failure, and so is a usage
    record it took with it.
    """
    findings = Findings()
    info: Counter[str] = Counter()
    usage: dict[str, list[dict[str, Any]]] = {}
    for row in records:
        usage.setdefault(row["request_id"], []).append(row)
    by_id = {r.request_id: r for r in results if r.request_id}
    evidence = Evidence(streams, usage, timeline, answers)

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

    # The errors and deaths the faults explain, and what was billed.
    check_errors(findings, results, timeline, evidence)
    check_deaths(findings, info, death_lines or [], timeline)
    check_refusals(findings, results, timeline, evidence)
    check_paused_takes(findings, results, usage, timeline, evidence)
    interactive = {rid: rows for rid, rows in usage.items()
                   if not any(is_batch_record(row) for row in rows)}
    check_usage(findings, info, results,
                {rid: s for rid, s in streams.items() if not is_batch_request(rid)},
                interactive, timeline, evidence, redis_lost_data)
    if batch_jobs:
        check_batches(findings, info, batch_jobs, batch_state or BatchState(), records,
                      answers, timeline, lossy_redis=options.redis_persistence == "none")

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
