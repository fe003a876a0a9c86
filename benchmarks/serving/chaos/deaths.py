"""What the faults may explain and what they may not: errors no fault of the run explains, deaths
declared of processes that were alive during a pause, and a paused worker's queued requests.

- ``error_without_cause``: an error whose code only a fault explains with no such fault during
  the request (``worker_lost`` without a worker killed or paused, ``interrupted`` without a web
  drain, ...: :data:`~.settings.CAUSED_BY`), or a client error (a 4xx but an admission's 429,
  such as a take refused as already live): the load sends only valid requests.
- ``error_not_retryable``: an error of :data:`~.settings.RETRYABLE_CODES` that does not tell its
  client it may retry.
- ``live_process_declared_dead``: from a pause to :data:`~.settings.DEATH_WINDOW_TTLS` TTLs after
  its end, a log line declaring the death of a process that was alive (a worker beating when the
  pause began and neither killed nor paused since; daphne with no fault for three web heartbeat
  TTLs): a worker reclaimed (``reclaimed dead worker(s)``), a worker told its heartbeat lapsed,
  a web process taken for gone. A Redis pause declares none; a worker's pause, only its own.
- ``paused_taken_not_served``: a request a paused worker had taken and not started that did not
  complete (it goes back to the queue and is served in full).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from typing import Any

from benchmarks.serving.chaos.findings import Evidence, Findings
from benchmarks.serving.chaos.load import Result
from benchmarks.serving.chaos.logclock import LogLine
from benchmarks.serving.chaos.settings import (
    CAUSED_BY,
    CLIENT_FAULT_CODES,
    DEATH_WINDOW_TTLS,
    PLATFORM_ENV,
    RETRYABLE_CODES,
)
from benchmarks.serving.chaos.timeline import Timeline

# Log lines that declare a death (gateway.housekeeping, inference.worker.recovery).
DEATH_LINE = re.compile(r"reclaimed dead worker\(s\)|heartbeat lapsed|is gone: stopping it")
WORKER_FAULTS = frozenset({"worker", "pause-worker"})
WEB_FAULTS = frozenset({"daphne", "drain-daphne"})
WEB_TTL_S = float(PLATFORM_ENV.get("WEB_HEARTBEAT_TTL_S", 10))


def check_errors(findings: Findings, results: list[Result], timeline: Timeline,
                 evidence: Evidence) -> None:
    """``error_without_cause`` and ``error_not_retryable`` (the module docstring)."""
    for r in results:
        if r.outcome != "error":
            continue
        code = r.code or ""
        status = r.status or 0
        if (400 <= status < 500 and status != 429) or code in CLIENT_FAULT_CODES:
            findings.add("error_without_cause", evidence(
                r, r.request_id, why="a client error: the load sends only valid requests"))
        elif code in CAUSED_BY and not timeline.faults(CAUSED_BY[code], r.start - 1, r.end):
            findings.add("error_without_cause", evidence(
                r, r.request_id, why=f"{code} with no fault of {sorted(CAUSED_BY[code])} "
                                     "during the request"))
        if code in RETRYABLE_CODES and not r.retryable:
            findings.add("error_not_retryable", evidence(r, r.request_id))


def _declared(line: LogLine, live: dict[str, str]) -> list[str]:
    """The processes ``line`` declares dead: worker names (of ``live``: id -> name), or
    ``daphne``."""
    if "is gone: stopping it" in line.text:
        return ["daphne"]
    if "heartbeat lapsed" in line.text:
        return [line.log.removesuffix(".log")]
    return [name for wid, name in live.items()
            if re.search(re.escape(wid) + r"(?![\w-])", line.text)]


def check_deaths(findings: Findings, info: Counter[str], lines: list[LogLine],
                 timeline: Timeline) -> None:
    """``live_process_declared_dead`` over ``lines`` (the logs' lines matching
    :data:`DEATH_LINE`, dated), for every pause of ``timeline``."""
    ttl = float(PLATFORM_ENV["WORKER_HEARTBEAT_TTL_S"])
    for pause in timeline.pauses():
        start = pause["t"]
        end = pause.get("resumed_at", start) + DEATH_WINDOW_TTLS * ttl + 1.0
        live: dict[str, str] = pause.get("live_workers") or {}
        for line in lines:
            if line.by < start or line.after > end:
                continue
            for name in _declared(line, live):
                if name == "daphne":
                    explained = timeline.faults(WEB_FAULTS, line.after - 3 * WEB_TTL_S,
                                                line.by)
                elif name not in live.values():
                    continue  # not beating when the pause began: it may have been dead
                else:
                    explained = (pause["kind"] == "pause-worker" and name == pause["name"]) \
                        or timeline.faults(WORKER_FAULTS, start, line.by, name=name)
                item = {"declared_dead": name, "line": line.brief(),
                        "pause": {k: pause.get(k) for k in ("t", "kind", "name", "paused_s",
                                                            "resumed_at", "live_workers")}}
                if explained:
                    info[f"deaths_declared_during_{pause['kind']}"] += 1
                    findings.note("deaths_explained", {
                        **item, "explained_by": "the pause" if explained is True else [
                            f"{k['t']}s {k['kind']} {k.get('signal', 'exit')}"
                            for k in explained]})
                    continue
                findings.add("live_process_declared_dead", item)


def check_refusals(findings: Findings, results: list[Result], timeline: Timeline,
                   evidence: Evidence) -> None:
    """``live_process_declared_dead`` for a request refused ``no_worker_available`` from a pause
    to the end of its death window while a worker beating when it began was neither paused nor
    killed since (the admission's count of live workers took it for dead)."""
    ttl = float(PLATFORM_ENV["WORKER_HEARTBEAT_TTL_S"])
    for pause in timeline.pauses():
        start = pause["t"]
        end = pause.get("resumed_at", start) + DEATH_WINDOW_TTLS * ttl + 1.0
        live = set((pause.get("live_workers") or {}).values()) - {pause["name"]}
        for r in results:
            if r.code != "no_worker_available" or not start <= r.start <= end:
                continue
            alive = sorted(n for n in live
                           if not timeline.faults(WORKER_FAULTS, start, r.end, name=n))
            if alive:
                findings.add("live_process_declared_dead", evidence(
                    r, r.request_id, why=f"refused no_worker_available while {alive} lived",
                    pause={k: pause.get(k) for k in ("t", "kind", "name", "resumed_at")}))


def check_paused_takes(findings: Findings, results: list[Result],
                       usage: dict[str, list[dict[str, Any]]], timeline: Timeline,
                       evidence: Evidence) -> None:
    """``paused_taken_not_served``: no request a paused worker had taken and not started ended
    with an error (its client's, or, for an answer not streamed whose error named no id, its
    usage record's) but one a later fault explains."""
    by_id = {r.request_id: r for r in results if r.request_id}
    for pause in timeline.pauses():
        resumed = pause.get("resumed_at", pause["t"])
        for rid in pause.get("taken") or []:
            result, rows = by_id.get(rid), usage.get(rid) or []
            if result is not None:
                code = result.code if result.outcome == "error" else None
                until = result.end
            else:
                code = next((row["error_code"] for row in rows if row.get("error_code")), None)
                until = math.inf
            later = CAUSED_BY.get(code or "", frozenset()) - {"pause-worker"}
            if code and not (later and timeline.faults(later, resumed, until)):
                findings.add("paused_taken_not_served", evidence(
                    result, rid, paused=pause["name"], paused_at=pause["t"]))
