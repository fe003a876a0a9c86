"""The checks of a run, each count's target 0: what every client received against the reference
backend's own output, every events stream, requests generated twice, what was billed, and the
leaks; each failure with its evidence."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any

from benchmarks.serving.chaos.load import Result
from benchmarks.serving.chaos.settings import MAX_EXAMPLES, USAGE_RECORDED_WITHIN_S, Options
from benchmarks.serving.chaos.state import StreamSummary
from benchmarks.serving.chaos.timeline import Timeline
from inference.protocol.keys import EVENTS_TTL_S


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
