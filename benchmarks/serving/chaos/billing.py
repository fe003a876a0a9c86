"""The usage records against what each client received (``gateway.usage.bill``: a record bills
what its client got, as its web process says it got it: ``gateway.delivery``).

Per record, ``received`` being the completion tokens its client received (a stream's characters,
an answer's ``usage.completion_tokens``; 0 for a client that knows no request id):

- never above it (``billed_more_than_received``), with or without Redis's data;
- a request whose web process lived to say what its client got: exactly it
  (``billed_less_than_received``), with the status and error code the client got
  (``usage_end_mismatch``: 200 and no code for a complete answer, the code of the error it got);
- a request whose web process died (daphne SIGKILL or an exit on its own while it was open):
  billed up to its delivered checkpoint, so at most the tokens that reached the client in the
  last :data:`~.settings.CHECKPOINT_LAG_S` before its end below it
  (``billed_below_checkpoint_bound``), with status 499 when its connection was lost before its
  end (``[DONE]`` or an error event) reached it (``usage_end_mismatch``);
- a client that received nothing (an answer not streamed that ended in an error, a stream
  refused before its status or cut before its first token): nothing at all, prompt included
  (``billed_unreceived_non_streamed``). Every client that received a token or an answer knows its
  request id (an error body names none), so the records no client knows are these.

And one record per request that produced tokens (``usage_missing``), at most one per request
(``usage_duplicate``), and no more records no client knows than the clients of their tenant that
know no request id (``usage_extra``). With ``--redis-persistence none`` a record Redis took with
it, or one it left billed from what was kept, is counted apart (informational).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from benchmarks.serving.chaos.findings import Evidence, Findings
from benchmarks.serving.chaos.load import Result
from benchmarks.serving.chaos.settings import CHECKPOINT_LAG_S, USAGE_RECORDED_WITHIN_S
from benchmarks.serving.chaos.state import StreamSummary
from benchmarks.serving.chaos.timeline import Timeline

# A web process that died this long after its client's end may not have written its end note
# (the record then bills up to the checkpoint, status 499; seconds).
NOTE_WRITTEN_WITHIN_S = 1.0


def check_usage(findings: Findings, info: Counter[str], results: list[Result],
                streams: dict[str, StreamSummary], usage: dict[str, list[dict[str, Any]]],
                timeline: Timeline, evidence: Evidence,
                redis_lost_data: Callable[..., bool]) -> None:
    """Add the usage records' counts (the module docstring) to ``findings`` and ``info``.

    Args:
        usage: every usage record, by request id.
        redis_lost_data: ``(request id, within_s=...) -> bool``: whether a Redis without
            persistence restarted while the request could lose data by it.
    """
    by_id = {r.request_id: r for r in results if r.request_id}
    for rid, rows in usage.items():
        if len(rows) > 1:
            findings.add("usage_duplicate", evidence(by_id.get(rid), rid), n=len(rows) - 1)
    _check_produced(findings, info, results, streams, usage, by_id, evidence, redis_lost_data)
    unknown: Counter[str] = Counter()
    for rid, rows in usage.items():
        row, result = rows[0], by_id.get(rid)
        if result is None:
            unknown[row.get("tenant__slug", "")] += 1
            _check_unknown(findings, row, rid, evidence, _candidates(results, row, timeline))
        else:
            _check_known(findings, info, row, result, timeline, evidence,
                         lost=redis_lost_data(rid, within_s=USAGE_RECORDED_WITHIN_S))
    info["usage_records_no_client_knows"] = sum(unknown.values())
    idless = Counter(r.tenant for r in results if not r.request_id)
    for tenant, n in unknown.items():
        if tenant and n > idless[tenant]:
            findings.add("usage_extra", {"tenant": tenant, "records_no_client_knows": n,
                                         "clients_knowing_no_id": idless[tenant]},
                         n=n - idless[tenant])


def _check_produced(findings: Findings, info: Counter[str], results: list[Result],
                    streams: dict[str, StreamSummary], usage: dict[str, list[dict[str, Any]]],
                    by_id: dict[str, Result], evidence: Evidence,
                    redis_lost_data: Callable[..., bool]) -> None:
    """One record per request that produced tokens (known from its stream, or its client)."""
    produced: dict[str, int] = {}
    for rid, s in streams.items():
        sent = max([s.tokens, *(f["seq"] for f in s.finals)])
        if sent:
            produced[rid] = sent
    for r in results:
        if r.request_id and r.text:
            produced[r.request_id] = max(produced.get(r.request_id, 0), len(r.text))
    for rid, tokens in produced.items():
        if rid in usage:
            continue
        if rid not in streams and redis_lost_data(rid, within_s=USAGE_RECORDED_WITHIN_S):
            info["usage_unverifiable"] += 1  # its stream and ledger entry went with Redis
        else:
            findings.add("usage_missing", evidence(by_id.get(rid), rid, produced_tokens=tokens))


def _candidates(results: list[Result], row: dict[str, Any],
                timeline: Timeline) -> list[dict[str, Any]]:
    """The clients that may have sent the request of a record no client knows: of its tenant,
    knowing no request id, ended from 15 s before it was recorded to 1 s after (closest first,
    at most 3)."""
    if "created_at" not in row:
        return []
    at = timeline.of_unix(row["created_at"])
    near = sorted((r for r in results if not r.request_id and r.tenant == row.get("tenant__slug")
                   and at - 15 <= r.end <= at + 1), key=lambda r: abs(at - r.end))
    return [{"start_s": round(r.start, 2), "end_s": round(r.end, 2), "stream": r.stream,
             "status": r.status, "code": r.code, "outcome": r.outcome,
             "max_tokens": r.max_tokens} for r in near[:3]]


def _check_unknown(findings: Findings, row: dict[str, Any], rid: str, evidence: Evidence,
                   candidates: list[dict[str, Any]]) -> None:
    """A record no client knows: its client received nothing."""
    billed, prompt = row["completion_tokens"], row.get("prompt_tokens", 0)
    why = "no client knows this request id: its client received no token and no answer"
    if billed:
        findings.add("billed_more_than_received", evidence(None, rid, received=0, why=why,
                                                           clients_near=candidates))
    if billed or prompt:
        findings.add("billed_unreceived_non_streamed", evidence(
            None, rid, received=0, why=why, clients_near=candidates))


def _check_known(findings: Findings, info: Counter[str], row: dict[str, Any], result: Result,
                 timeline: Timeline, evidence: Evidence, lost: bool) -> None:
    """A record of a request its client knows, against what that client received."""
    rid, billed = result.request_id, row["completion_tokens"]
    received = result.received
    if billed > received:
        findings.add("billed_more_than_received", evidence(result, rid, received=received,
                                                           billed=billed))
        return
    if received == 0 and result.outcome != "complete" and (billed or row.get("prompt_tokens")):
        findings.add("billed_unreceived_non_streamed", evidence(result, rid, received=0))
        return
    if lost:
        if billed < received:
            info["billing_unverifiable_with_redis"] += 1  # what Redis kept is what was billed
        return
    if timeline.web_died_during(result.start, result.end + NOTE_WRITTEN_WITHIN_S):
        # Billed up to the checkpoint: below what arrived by at most its last CHECKPOINT_LAG_S.
        allowed = result.received_since(result.end - CHECKPOINT_LAG_S)
        cut_off = not result.done and result.error is None  # its end never reached it
        if result.outcome == "connection_lost" and cut_off and row.get("status", 499) != 499:
            findings.add("usage_end_mismatch", evidence(
                result, rid, want="status 499: cut off when its web process died"))
        if received - billed > allowed:
            findings.add("billed_below_checkpoint_bound", evidence(
                result, rid, received=received, billed=billed, allowed_below=allowed))
        elif billed < received:
            info["web_died_billed_below_received_within_bound"] += 1
            info["web_died_largest_shortfall_tokens"] = max(
                info["web_died_largest_shortfall_tokens"], received - billed)
        else:
            info["web_died_billed_all_received"] += 1
        return
    if billed < received:
        findings.add("billed_less_than_received", evidence(result, rid, received=received,
                                                           billed=billed))
        return
    status, code = row.get("status"), row.get("error_code")
    if status is None and code is None:
        return  # a record read without them
    if result.outcome == "complete" and (status != 200 or code):
        findings.add("usage_end_mismatch", evidence(result, rid, want="status 200, no error"))
    elif result.outcome == "error" and result.code and code != result.code:
        findings.add("usage_end_mismatch", evidence(result, rid,
                                                    want=f"error code {result.code}"))
