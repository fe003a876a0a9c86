"""The checks of the run's Batch API jobs (:mod:`.batches`), each count's target 0; each failure
with its evidence (the batch, the ``custom_id``, what the output and error files said of it, its
database row and usage records, the faults during its batch).

- ``batch_not_created``: a job whose batch could not be created (its calls say why);
  ``batch_created_twice``: more batches of the batch tenant than jobs made (two of one input
  file, or one no job knows);
- ``batch_not_ended``: not in a final status within ``--batch-wait-s`` after the load;
  ``batch_ended_not_completed``: ``failed``, ``expired`` or ``cancelled`` (the run cancels
  none, and its window is 24 h);
- ``batch_files_unreadable``: a line of an output or error file that is not JSON;
- ``batch_lines_lost`` / ``batch_lines_duplicated`` / ``batch_lines_unknown``: an input
  ``custom_id`` in neither file, in them more than once, a ``custom_id`` the input does not hold;
- ``batch_output_mismatch``: an output line whose text is not the reference backend's answer to
  its prompt cut to its ``max_tokens`` (:func:`.expected.expected_for`), whose ``finish_reason``
  is not the one that cut implies, whose usage does not count its text (completion tokens its
  characters, total their sum with the prompt's, the same prompt tokens for every line of a
  prompt), or whose status or request id is not its line's;
- ``batch_invalid_not_refused``: a planted invalid line (no ``body.prompt``) not in the error
  file with a 400;
- ``batch_error_unexplained``: an error line of a valid line, but a 503 ``service_unavailable``
  saying it failed ``BATCH_MAX_ATTEMPTS`` times with at least that many faults of
  :data:`~.settings.BATCH_RETRY_FAULTS` during its batch;
  ``batch_retry_without_cause``: a line's request that ended with an error (its usage record's
  code) that no fault of its kind (:data:`~.settings.CAUSED_BY`, daphne's faults aside: a line
  has no web process) explains from its batch's creation to the record;
- ``batch_counts_mismatch``: ``request_counts`` (total, completed, failed) not the input's and
  the files' line counts;
- ``batch_usage_missing``: an output line without the usage record of its request (with
  ``--redis-persistence none`` and a Redis restart during its batch, counted apart: the ledger
  entry may have gone with Redis);
  ``batch_usage_mismatch``: that record's prompt or completion tokens not the line's usage, its
  status not 200, its ``batch_id`` not the line's batch; ``batch_billed_twice``: another record
  of the same line billing tokens; ``batch_billed_failed_line``: a record billing tokens of a line
  in the error file (any record at all of a planted invalid line: it never ran);
  ``batch_usage_extra``: a batch's record that is no line's;
- ``batch_leak_lines``: a line of an ended batch still ``waiting`` or ``running`` in the
  database; ``batch_leak_redis``: what Redis still holds naming an ended batch
  (:func:`.batches.redis_left`: the shared queue's entries, the usage ledger, the active batches'
  figures, a key that never expires; an events stream within its TTL is fine).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from typing import Any

from benchmarks.serving.chaos.batches import FINAL_STATUSES, BatchJob, BatchState
from benchmarks.serving.chaos.expected import expected_for
from benchmarks.serving.chaos.findings import Findings
from benchmarks.serving.chaos.settings import BATCH_RETRY_FAULTS, CAUSED_BY, PLATFORM_ENV
from benchmarks.serving.chaos.timeline import Timeline

ATTEMPTS = int(PLATFORM_ENV["BATCH_MAX_ATTEMPTS"])
# The Batch object's times are whole seconds: a batch ended up to this long after its ``ended_s``.
END_SLACK_S = 1.0
FAILED_TIMES = re.compile(r"failed (\d+) times")


def is_batch_request(request_id: str) -> bool:
    """Whether ``request_id`` is a batch line's (``{batch id}-{line}-{attempt}``)."""
    return request_id.startswith("batch_")


def is_batch_record(row: dict[str, Any]) -> bool:
    return bool(row.get("batch_id")) or is_batch_request(row.get("request_id") or "")


def _line_of(request_id: str) -> tuple[str, int] | None:
    """(batch id, line index) of a batch line's request id, None if it is none."""
    parts = request_id.rsplit("-", 2)
    if len(parts) != 3 or not all(p.isdigit() for p in parts[1:]):
        return None
    return parts[0], int(parts[1])


class _Job:
    """One job's observations, indexed: its files' entries and its usage records by line."""

    def __init__(self, job: BatchJob, state: BatchState, timeline: Timeline,
                 records: dict[int, list[dict[str, Any]]]):
        self.job = job
        self.by_cid = {line["custom_id"]: n for n, line in enumerate(job.lines)}
        self.output: dict[str, list[dict[str, Any]]] = {}
        self.error: dict[str, list[dict[str, Any]]] = {}
        for entries, into in ((job.output, self.output), (job.error, self.error)):
            for entry in entries:
                into.setdefault(str(entry.get("custom_id")), []).append(entry)
        self.db = {row["index"]: row for row in state.lines if row["batch_id"] == job.batch_id}
        self.records = records
        self.lossy = False  # a Redis that starts empty restarted during the batch
        end = job.ended_s + END_SLACK_S if job.ended_s is not None else math.inf
        self.faults = timeline.kills_during(job.created_s or 0.0, end)

    def evidence(self, cid: str, **extra: Any) -> dict[str, Any]:
        n = self.by_cid.get(cid)
        line = self.job.lines[n] if n is not None else None
        outs, errs = self.output.get(cid, []), self.error.get(cid, [])
        db = self.db.get(n) if n is not None else None
        rid = next((e["response"].get("request_id") for e in outs + errs
                    if e.get("response") and e["response"].get("request_id")),
                   (db or {}).get("request_id") or None)
        return {"batch_id": self.job.batch_id, "custom_id": cid, "request_id": rid,
                "line": {k: line[k] for k in ("prompt", "max_tokens", "invalid")}
                if line else None,
                "output_file": [_brief(e) for e in outs], "error_file": [_brief(e) for e in errs],
                "db_line": db, "usage_records": self.records.get(n, []) if n is not None else [],
                "faults_during_batch": self.faults,
                **({"job_failure": self.job.failure} if self.job.failure else {}), **extra}


def _brief(entry: dict[str, Any]) -> dict[str, Any]:
    """A file line for an example (a long text cut)."""
    response = dict(entry.get("response") or {})
    body = dict(response.get("body") or {})
    if body.get("choices"):
        body["choices"] = [{**c, "text": (c.get("text") or "")[:80]} for c in body["choices"]]
    if response:
        response["body"] = body
    return {**entry, "response": response or None}


def check_batches(findings: Findings, info: Counter[str], jobs: list[BatchJob],
                  state: BatchState, records: list[dict[str, Any]],
                  answers: list[tuple[str, int | None]], timeline: Timeline,
                  lossy_redis: bool = False) -> None:
    """Add the batch counts (the module docstring) to ``findings`` and ``info``.

    Args:
        records: every usage record (those of batch lines are used).
        lossy_redis: a restarted Redis starts empty (``--redis-persistence none``).
    """
    by_line: dict[tuple[str, int], list[dict[str, Any]]] = {}
    known = {job.batch_id: job for job in jobs if job.batch_id}
    for row in records:
        if not is_batch_record(row):
            continue
        where = _line_of(row["request_id"])
        job = known.get(where[0]) if where else None
        if where is None or job is None or not 0 <= where[1] < len(job.lines):
            findings.add("batch_usage_extra", {"usage_record": row,
                                               "why": "no line of the run's batches"})
            continue
        by_line.setdefault(where, []).append(row)
        if row.get("batch_id", where[0]) != where[0]:
            findings.add("batch_usage_mismatch", {"usage_record": row,
                                                  "why": "its batch_id is not its line's"})
        _check_attempt(findings, info, row, job, timeline)
    _check_created(findings, jobs, state)
    prompt_tokens: dict[int, Counter[int]] = {}
    checked: list[_Job] = []
    for job in jobs:
        if not job.batch_id:
            findings.add("batch_not_created", job.brief())
            continue
        info["batch_lines"] += len(job.lines)
        if job.status not in FINAL_STATUSES:
            findings.add("batch_not_ended", job.brief())
            continue
        if job.status != "completed":
            findings.add("batch_ended_not_completed", job.brief())
        for raw in job.unreadable:
            findings.add("batch_files_unreadable", {"batch_id": job.batch_id, "line": raw})
        if job.status == "failed":
            continue  # its file was not read as a batch: no lines (its errors say why)
        records_of = {n: rows for (b, n), rows in by_line.items() if b == job.batch_id}
        seen = _Job(job, state, timeline, records_of)
        seen.lossy = lossy_redis and any(
            (job.created_s or 0.0) <= t <= (job.ended_s or math.inf) + END_SLACK_S
            for t in timeline.redis_kills)
        checked.append(seen)
        _check_lines(findings, info, seen, answers, timeline, prompt_tokens)
        _check_counts(findings, job)
    _check_prompt_tokens(findings, checked, prompt_tokens)
    for row in state.lines:
        if row["state"] in ("waiting", "running") and row["batch_id"] in known:
            job = known[row["batch_id"]]
            if job.status in FINAL_STATUSES:
                findings.add("batch_leak_lines", {"batch_id": row["batch_id"], "db_line": row,
                                                  "batch_status": job.status})
    for item in state.redis_left:
        findings.add("batch_leak_redis", item)
    info["batch_lines_sent_again"] += sum(1 for row in state.lines if row["attempt"])


def _check_created(findings: Findings, jobs: list[BatchJob], state: BatchState) -> None:
    """Each batch of the batch tenant is a job's (a job makes at most one)."""
    ids = {job.batch_id for job in jobs if job.batch_id}
    for row in state.batches:
        if row["id"] in ids:
            continue
        mine = [job.brief() for job in jobs if job.file_id == row["input_file_id"]]
        findings.add("batch_created_twice", {
            "batch": row, "jobs": mine,
            "why": "a second batch of a job's input file" if mine else "a batch no job knows"})


def _check_attempt(findings: Findings, info: Counter[str], row: dict[str, Any], job: BatchJob,
                   timeline: Timeline) -> None:
    """A line's request that ended with an error: a fault of its kind explains it."""
    code = row.get("error_code") or ""
    if not code:
        return
    kinds = CAUSED_BY.get(code, frozenset()) & BATCH_RETRY_FAULTS
    at = timeline.of_unix(row["created_at"]) if "created_at" in row else math.inf
    start = (job.created_s or 0.0) - 1
    if kinds and timeline.faults(kinds, start, at):
        info[f"batch_requests_ended_{code}"] += 1
    else:
        findings.add("batch_retry_without_cause", {
            "batch_id": job.batch_id, "request_id": row["request_id"], "usage_record": row,
            "why": f"{code} with no fault of {sorted(kinds)} from its batch's creation to its "
                   "record" if kinds else f"{code}: no fault explains it",
            "faults_during_batch": timeline.kills_during(start, at)})


def _check_lines(findings: Findings, info: Counter[str], seen: _Job,
                 answers: list[tuple[str, int | None]], timeline: Timeline,
                 prompt_tokens: dict[int, Counter[int]]) -> None:
    """Each input line in exactly one file once, as its answer or its explained error, and
    billed as it ended."""
    job = seen.job
    for cid in sorted(set(seen.output) | set(seen.error)):
        if cid not in seen.by_cid:
            findings.add("batch_lines_unknown", seen.evidence(cid),
                         n=len(seen.output.get(cid, [])) + len(seen.error.get(cid, [])))
    for n, line in enumerate(job.lines):
        cid = line["custom_id"]
        outs, errs = seen.output.get(cid, []), seen.error.get(cid, [])
        if not outs and not errs:
            findings.add("batch_lines_lost", seen.evidence(cid))
            continue
        if len(outs) + len(errs) > 1:
            findings.add("batch_lines_duplicated", seen.evidence(cid),
                         n=len(outs) + len(errs) - 1)
            continue
        rows = seen.records.get(n, [])
        billing = [r for r in rows if r["completion_tokens"] or r["prompt_tokens"]]
        if line["invalid"]:
            response = (errs[0].get("response") or {}) if errs else {}
            if outs or response.get("status_code") != 400:
                findings.add("batch_invalid_not_refused", seen.evidence(
                    cid, why="a planted invalid line must end in the error file with a 400"))
            else:
                info["batch_error_lines_planted"] += 1
            if rows:
                findings.add("batch_billed_failed_line", seen.evidence(
                    cid, why="a line refused before it ran has no request to bill"))
            continue
        if errs:
            why = _explained(errs[0], job, timeline)
            if why is None:
                findings.add("batch_error_unexplained", seen.evidence(cid))
            else:
                info["batch_lines_failed_after_retries"] += 1
                findings.note("batch_errors_explained", {"batch_id": job.batch_id,
                                                         "custom_id": cid, "why": why})
            if billing:
                findings.add("batch_billed_failed_line", seen.evidence(
                    cid, why="a line that ended in the error file is billed nothing"),
                    n=len(billing))
            continue
        info["batch_output_lines"] += 1
        _check_output(findings, info, seen, n, outs[0], answers, prompt_tokens)


def _check_output(findings: Findings, info: Counter[str], seen: _Job, n: int,
                  entry: dict[str, Any],
                  answers: list[tuple[str, int | None]],
                  prompt_tokens: dict[int, Counter[int]]) -> None:
    """One output line against the expected answer, and its usage record."""
    job, line = seen.job, seen.job.lines[n]
    cid = line["custom_id"]
    response = entry.get("response") or {}
    body = response.get("body") or {}
    choice = (body.get("choices") or [{}])[0]
    text, finish = choice.get("text"), choice.get("finish_reason")
    usage = body.get("usage") or {}
    want_text, want_finish = expected_for(answers[line["prompt"]], line["max_tokens"])
    rid = str(response.get("request_id") or "")
    wrong = [why for bad, why in (
        (response.get("status_code") != 200, "status not 200"),
        (entry.get("error") is not None, "an error beside its answer"),
        (text != want_text, f"text is not the expected {len(want_text)} characters"),
        (finish != want_finish, f"finish_reason is not {want_finish}"),
        (usage.get("completion_tokens") != len(text or ""),
         "usage.completion_tokens is not its text's tokens"),
        (not usage.get("prompt_tokens"), "no prompt tokens"),
        (usage.get("total_tokens") != (usage.get("prompt_tokens") or 0)
         + (usage.get("completion_tokens") or 0), "usage.total_tokens is not the sum"),
        (_line_of(rid) != (job.batch_id, n), "its request_id is not its line's"),
    ) if bad]
    if wrong:
        findings.add("batch_output_mismatch", seen.evidence(
            cid, why=wrong, want_tokens=len(want_text), want_finish=want_finish))
    if usage.get("prompt_tokens"):
        prompt_tokens.setdefault(line["prompt"], Counter())[usage["prompt_tokens"]] += 1
    rows = seen.records.get(n, [])
    mine = [r for r in rows if r["request_id"] == rid]
    if not mine and seen.lossy:
        info["batch_usage_unverifiable_with_redis"] += 1
    elif not mine:
        findings.add("batch_usage_missing", seen.evidence(cid))
    else:
        row = mine[0]
        if (row["completion_tokens"] != usage.get("completion_tokens")
                or row["prompt_tokens"] != usage.get("prompt_tokens")
                or row.get("status", 200) != 200 or row.get("error_code")):
            findings.add("batch_usage_mismatch", seen.evidence(
                cid, why="its record does not bill the line's usage, status 200"))
    others = [r for r in rows if r["request_id"] != rid
              and (r["completion_tokens"] or r["prompt_tokens"])]
    if others:
        findings.add("batch_billed_twice", seen.evidence(cid), n=len(others))


def _explained(entry: dict[str, Any], job: BatchJob, timeline: Timeline) -> str | None:
    """Why a valid line's error line is explained (a 503 after ``BATCH_MAX_ATTEMPTS`` requests
    with as many faults that end or lose one during its batch), or None."""
    response = entry.get("response") or {}
    error = (response.get("body") or {}).get("error") or {}
    said = FAILED_TIMES.search(error.get("message") or "")
    if (response.get("status_code") != 503 or error.get("code") != "service_unavailable"
            or said is None or int(said.group(1)) < ATTEMPTS):
        return None
    end = job.ended_s + END_SLACK_S if job.ended_s is not None else math.inf
    faults = timeline.faults(BATCH_RETRY_FAULTS, (job.created_s or 0.0) - 1, end)
    if len(faults) < ATTEMPTS:
        return None
    return f"failed {said.group(1)} times; {len(faults)} faults of " \
           f"{sorted(BATCH_RETRY_FAULTS)} during its batch"


def _check_counts(findings: Findings, job: BatchJob) -> None:
    counts = job.request_counts or {}
    want = {"total": len(job.lines), "completed": len(job.output), "failed": len(job.error)}
    if any(counts.get(k) != v for k, v in want.items()):
        findings.add("batch_counts_mismatch", {**job.brief(), "want_request_counts": want})


def _check_prompt_tokens(findings: Findings, checked: list[_Job],
                         prompt_tokens: dict[int, Counter[int]]) -> None:
    """Every output line of one prompt counts the same prompt tokens (the most common)."""
    usual = {p: c.most_common(1)[0][0] for p, c in prompt_tokens.items()}
    for seen in checked:
        for line in seen.job.lines:
            if line["invalid"] or line["prompt"] not in usual:
                continue
            for entry in seen.output.get(line["custom_id"], []):
                got = ((entry.get("response") or {}).get("body") or {}).get("usage") or {}
                if got.get("prompt_tokens") and got["prompt_tokens"] != usual[line["prompt"]]:
                    findings.add("batch_output_mismatch", seen.evidence(
                        line["custom_id"], why=[f"{got['prompt_tokens']} prompt tokens, where "
                                                f"the prompt's other lines count "
                                                f"{usual[line['prompt']]}"]))
