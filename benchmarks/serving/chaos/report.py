"""The run's report: its figures (requests by outcome, faults, what each fault did to the
clients, the Batch API jobs, every count and its examples) as a dict, and as text."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from benchmarks.serving.chaos.findings import Findings
from benchmarks.serving.chaos.load import Result
from benchmarks.serving.chaos.timeline import Timeline


def summarize(results: list[Result], timeline: Timeline, findings: Findings,
              info: dict[str, int], settled: dict[str, Any], all_up: bool, load_s: float,
              leak_details: dict[str, Any], batches: dict[str, Any] | None = None,
              ) -> dict[str, Any]:
    """The report's figures (everything but the options and the wall time); ``batches``: the
    Batch API jobs (``jobs``, each :meth:`.batches.BatchJob.brief`) and how long their ends
    were waited for (``ended``)."""
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
        "batches": batches or {},
        "load_s": round(load_s, 1),
        "all_up_after_load": all_up,
        "settle": settled,
        "counts": counts,
        "info": info,
        "live_workers_after": leak_details.get("live_workers"),
        "examples": findings.examples,
        "notes": findings.notes,
        "results": [_compact(r) for r in results],
        "failing": failing,
        "verdict": "FAIL" if failing or timeline.errors else "PASS",
    }


def impact(results: list[Result], timeline: Timeline) -> dict[str, dict[str, Any]]:
    """What each kind of fault did to the clients, by kind and signal.

    For each: how many faults; the requests in flight at a fault (started before it, ended
    after it) by outcome and error code, and those of them not streamed apart; for those that
    did not complete, the seconds from the fault to their end (median and largest); and the
    requests sent in the 3 s after a fault (a pause: after its end) by outcome.
    """
    table: dict[str, dict[str, Any]] = {}
    for kill in timeline.kills:
        name = f"{kill['kind']} {kill['signal']}"
        row = table.setdefault(name, {"kills": 0, "in_flight": Counter(),
                                      "in_flight_not_streamed": Counter(), "after": Counter(),
                                      "_ends": []})
        row["kills"] += 1
        t, after = kill["t"], kill.get("resumed_at", kill["t"])
        for r in results:
            label = r.outcome + (f" {r.code}" if r.code else "")
            if r.start < t < r.end:
                row["in_flight"][label] += 1
                if not r.stream:
                    row["in_flight_not_streamed"][label] += 1
                if r.outcome != "complete":
                    row["_ends"].append(r.end - t)
            elif after <= r.start < after + 3:
                row["after"][label] += 1
    for row in table.values():
        ends = sorted(row.pop("_ends"))
        for key in ("in_flight", "in_flight_not_streamed", "after"):
            row[key] = dict(row[key].most_common())
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
            "code": result.code, "tokens": len(result.text), "received": result.received,
            "finish": result.finish_reason,
            "silence_s": round(result.max_silence_s, 2),
            "no_data_s": round(result.max_no_data_s, 2)}


def format_report(report: dict[str, Any], examples: bool = True) -> str:
    """The report as text: figures, every count, examples of each failure, the verdict."""
    lines = []
    req = report.get("requests", {})
    lines.append(f"requests: {req.get('total')} ({req.get('streamed')} streamed, "
                 f"{req.get('not_streamed')} not) by outcome {req.get('by_outcome')}")
    lines.append(f"faults: {len(report.get('kills', []))} by kind "
                 f"{report.get('kills_by_kind')}")
    for kill in report.get("kills", []):
        head = f"  {kill['t']:7.1f}s {kill['kind']:12} {kill['signal']:7} {kill['name']:8}"
        if kill["signal"] == "SIGSTOP":
            lines.append(f"{head} paused {kill.get('paused_s')} s (SIGCONT at "
                         f"{kill.get('resumed_at')} s)" + (
                             f"; it had taken {len(kill.get('taken') or [])} and was running "
                             f"{len(kill.get('running') or [])}"
                             if kill["kind"] == "pause-worker" else ""))
            continue
        drain = (f" with {kill.get('not_streamed_in_flight')} answer(s) not streamed in flight"
                 if kill["kind"] == "drain-daphne" else "")
        lines.append(f"{head}{drain} exited after {kill.get('exited_after_s')} s (status "
                     f"{kill.get('returncode')}), up after {kill.get('up_after_s')} s")
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
    lines.append("what each fault did to the clients (requests in flight at the fault, and of "
                 "them not streamed; those cut short ended this long after it; requests sent "
                 "in the 3 s after it):")
    for name, row in report.get("impact", {}).items():
        lines.append(f"  {name:20} x{row['kills']}: in flight {row['in_flight']}, not "
                     f"streamed {row.get('in_flight_not_streamed')}; cut short ended after "
                     f"{row['cut_short_ended_after_s']}; after {row['after']}")
    batches = report.get("batches") or {}
    lines.append(f"batch jobs: {len(batches.get('jobs') or [])}, their ends waited for "
                 f"{batches.get('ended')}")
    for job in batches.get("jobs") or []:
        lines.append(f"  job {job['job']} {job['batch_id'] or '(not created)'} created at "
                     f"{job['created_s']} s, in progress at {job['started_s']} s, "
                     f"{job['status'] or '?'} at {job['ended_s']} s: "
                     f"{job['lines']} lines ({job['invalid_lines']} invalid), "
                     f"{job['output_lines']} in the output file, {job['error_lines']} in the "
                     f"error file, request_counts {job['request_counts']}"
                     + (f"; {job['failure']}" if job["failure"] else "")
                     + (f"; calls that failed: {job['failed_calls']}" if job["calls"] else "")
                     + f"; faults meanwhile: {job.get('faults_during')}")
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
