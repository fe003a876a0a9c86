"""The counts of a run's checks, each with a few examples, and the evidence an example carries:
what the client saw, the events stream, the usage records (and, added after the checks, the log
lines naming the request); a batch line's evidence is :mod:`.batch_checks`'."""

from __future__ import annotations

from typing import Any

from benchmarks.serving.chaos.load import Result
from benchmarks.serving.chaos.settings import MAX_EXAMPLES
from benchmarks.serving.chaos.state import StreamSummary
from benchmarks.serving.chaos.timeline import Timeline


class Findings:
    """Counts whose target is 0, each with a few examples; and ``notes``: evidence of what the
    checks accepted, by topic (the deaths declared that a fault explains), for the report."""

    NAMES = (
        "unclear", "error_without_cause", "error_not_retryable",
        "token_mismatch_complete", "token_not_prefix", "stream_client_mismatch",
        "stream_seq_gaps", "stream_without_final", "stream_events_after_final",
        "stream_bad_entries", "streams_missing", "generated_twice",
        "live_process_declared_dead", "paused_taken_not_served",
        "leak_gate1", "leak_fq_wait", "leak_fq_inflight", "leak_fq_taken", "leak_fq_running",
        "leak_fq_held", "leak_fq_indexes", "leak_concurrency_leases", "leak_worker_state",
        "leak_celery_queue", "leak_usage_pending",
        "usage_missing", "usage_extra", "usage_duplicate", "usage_end_mismatch",
        "billed_more_than_received", "billed_less_than_received",
        "billed_below_checkpoint_bound", "billed_unreceived_non_streamed",
        "no_request_completed",
        "batch_not_created", "batch_created_twice", "batch_not_ended",
        "batch_ended_not_completed", "batch_files_unreadable", "batch_lines_lost",
        "batch_lines_duplicated", "batch_lines_unknown", "batch_output_mismatch",
        "batch_invalid_not_refused", "batch_error_unexplained", "batch_retry_without_cause",
        "batch_counts_mismatch", "batch_usage_missing", "batch_usage_mismatch",
        "batch_billed_twice", "batch_billed_failed_line", "batch_usage_extra",
        "batch_leak_lines", "batch_leak_redis",
    )

    def __init__(self) -> None:
        self.counts = dict.fromkeys(self.NAMES, 0)
        self.examples: dict[str, list[Any]] = {}
        self.notes: dict[str, list[Any]] = {}

    def add(self, name: str, example: Any, n: int = 1) -> None:
        self.counts[name] += n
        bucket = self.examples.setdefault(name, [])
        if len(bucket) < MAX_EXAMPLES:
            bucket.append(example)

    def note(self, topic: str, item: Any) -> None:
        """Keep ``item`` under ``topic`` in :attr:`notes` (at most 4 x MAX_EXAMPLES a topic)."""
        bucket = self.notes.setdefault(topic, [])
        if len(bucket) < 4 * MAX_EXAMPLES:
            bucket.append(item)


class Evidence:
    """Makes an example: ``evidence(result, request_id, **extra)`` (``result`` None when no
    client knows the request)."""

    def __init__(self, streams: dict[str, StreamSummary], usage: dict[str, list[dict[str, Any]]],
                 timeline: Timeline, answers: list[tuple[str, int | None]]):
        self.streams = streams
        self.usage = usage
        self.timeline = timeline
        self.answers = answers

    def __call__(self, result: Result | None, rid: str, **extra: Any) -> dict[str, Any]:
        item: dict[str, Any] = {"request_id": rid or None, **extra}
        if result is not None:
            item["client"] = client_view(result, self.timeline, self.answers)
        if rid and rid in self.streams:
            item["stream"] = self.streams[rid].brief()
        if rid and rid in self.usage:
            item["usage_records"] = self.usage[rid]
        return item


def client_view(result: Result, timeline: Timeline,
                answers: list[tuple[str, int | None]]) -> dict[str, Any]:
    """What the client of one request saw, for an example."""
    tail = [[round(t, 2), n] for t, n in result.arrivals[-5:]]
    return {
        "tenant": result.tenant, "prompt": result.prompt, "max_tokens": result.max_tokens,
        "stream": result.stream, "start_s": round(result.start, 2),
        "end_s": round(result.end, 2), "outcome": result.outcome, "why": result.why,
        "status": result.status, "ending": result.ending, "detail": result.detail[:300],
        "error": result.error, "retryable": result.retryable,
        "finish_reason": result.finish_reason, "done": result.done,
        "text": result.text[:60], "tokens": len(result.text), "received": result.received,
        "last_arrivals": tail, "usage_completion": result.usage_completion,
        "max_silence_s": round(result.max_silence_s, 2),
        "max_no_data_s": round(result.max_no_data_s, 2),
        "expected": answers[result.prompt][0][:60],
        "kills_during": timeline.kills_during(result.start, result.end)}
