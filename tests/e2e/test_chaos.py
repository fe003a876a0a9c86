"""The chaos harness, short: the platform under load while its processes and Redis are killed at
random loses no request, no token, no usage record and leaks nothing
(``benchmarks/serving/chaos/``; ``python -m benchmarks.serving.chaos`` is the long run)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from benchmarks.serving import chaos

# About a minute in all, at most 2.5: 40 s of load and chaos, the platform's start-up, at most
# 60 s draining a request that hangs and 25 s settling, the checks.
SHORT_RUN = chaos.Options(duration_s=40, concurrency=6, workers=2, seed=7, warmup_s=3,
                          kill_interval_s=(2.0, 4.0), settle_s=25)


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_killing_workers_daphne_celery_beat_and_redis_loses_and_leaks_nothing(tmp_path):
    options = dataclasses.replace(SHORT_RUN, log_dir=str(tmp_path / "logs"),
                                  out=str(tmp_path / "chaos.json"))
    report = chaos.run(options)
    text = chaos.format_report(report)
    print(text)
    assert not report.get("harness_errors"), text
    assert set(report["kills_by_kind"]) == set(chaos.KINDS), text
    assert report["requests"]["by_outcome"].get("complete", 0) > 0, text
    failing = {name: n for name, n in report["counts"].items() if n}
    assert not failing, text
    assert report["verdict"] == "PASS", text


# The checks themselves, on made-up observations (no processes): each failure they exist to
# catch is caught, and a clean run is clean.

ANSWERS = [("abcdefghijklmnopqrstuvwxyz" * 5, None), ("zyxwvutsrqponmlkjihgfedcba" * 5, None)]


def sse(result: chaos.Result, *events: str) -> chaos.Result:
    for event in events:
        chaos.parse_sse_event(result, event)
    return result


def chunk(rid: str, text: str = "", finish: str | None = None) -> str:
    body = {"id": f"cmpl-{rid}", "choices": [{"index": 0, "text": text,
                                              "finish_reason": finish}]}
    return "data: " + json.dumps(body)


def streamed(rid: str, text: str, max_tokens: int, prompt: int = 0, **fields) -> chaos.Result:
    result = chaos.Result(index=0, tenant="alpha", prompt=prompt, max_tokens=max_tokens,
                          stream=True, status=200, ending="eof", start=1.0, end=2.0, **fields)
    return sse(result, *(chunk(rid, c) for c in text), chunk(rid, finish="length"),
               "data: [DONE]")


def events_stream(text: str, seqs: list[int] | None = None, finals: int = 1,
                  final_seq: int | None = None) -> chaos.StreamSummary:
    """A stream holding ``text`` one character a token (seqs 0.. unless given)."""
    seqs = list(range(len(text))) if seqs is None else seqs
    final = {"seq": len(text) if final_seq is None else final_seq, "finish_reason": "length",
             "error": None, "completion_tokens": len(text)}
    return chaos.StreamSummary(token_events=list(zip(seqs, text, strict=True)),
                               finals=[final] * finals, first_ms=1000, last_ms=2000)


def run_checks(results, streams, records, leaks=None, timeline=None, persistence="aof"):
    """The counts that are not 0 after classifying ``results`` (beside one clean request) and
    checking them."""
    timeline = timeline or chaos.Timeline()
    clean = streamed("clean", ANSWERS[1][0][:20], 20, prompt=1)
    results, streams = [*results, clean], {**streams, "clean": events_stream(clean.text)}
    records = [*records, usage("clean", 20)]
    for result in results:
        chaos.classify(result, timeline)
    all_leaks = {name: 0 for name in chaos.Findings.NAMES if name.startswith("leak_")}
    all_leaks.update(leaks or {})
    findings, _ = chaos.check(results, streams, records, all_leaks, {}, ANSWERS, timeline,
                              chaos.Options(redis_persistence=persistence), collected_at=10.0)
    return {name: n for name, n in findings.counts.items() if n}


def usage(rid: str, tokens: int) -> dict:
    return {"request_id": rid, "completion_tokens": tokens}


def test_a_clean_run_has_no_finding():
    good = streamed("a1", ANSWERS[0][0][:12], 12)
    assert run_checks([good], {"a1": events_stream(good.text)}, [usage("a1", 12)]) == {}
    assert good.outcome == "complete"


def test_a_run_where_nothing_completed_fails():
    findings, _ = chaos.check([], {}, [], {}, {}, ANSWERS, chaos.Timeline(), chaos.Options(),
                              collected_at=10.0)
    assert findings.counts["no_request_completed"] == 1


@pytest.mark.parametrize("name, client_text, stream, billed", [
    ("token_mismatch_complete", "abcdefghijkm", events_stream("abcdefghijkm"), 12),
    ("generated_twice", "abcdefghijkl", events_stream("abcdefghijkl", finals=2), 12),
    ("generated_twice", "abcdefghijkl",
     events_stream("abcdefghijkll", seqs=[*range(12), 11]), 12),
    ("stream_seq_gaps", "abcdefghijkl",
     events_stream("abcdefghijkl", seqs=[*range(5), *range(6, 13)]), 12),
    ("stream_without_final", "abcdefghijkl", events_stream("abcdefghijkl", finals=0), 12),
    ("usage_missing", "abcdefghijkl", events_stream("abcdefghijkl"), None),
    ("usage_token_mismatch", "abcdefghijkl", events_stream("abcdefghijkl"), 11),
    ("streams_missing", "abcdefghijkl", None, 12),
])
def test_each_kind_of_loss_or_doubling_is_counted(name, client_text, stream, billed):
    result = streamed("r1", client_text, 12)
    found = run_checks([result], {"r1": stream} if stream else {},
                       [] if billed is None else [usage("r1", billed)])
    assert name in found, found


def test_a_cut_stream_is_unclear_unless_daphne_was_killed_while_it_was_open():
    def cut() -> chaos.Result:
        result = chaos.Result(index=0, tenant="alpha", prompt=1, max_tokens=30, stream=True,
                              status=200, ending="eof", start=1.0, end=2.0)
        return sse(result, chunk("c1", "zyx"))

    alive, killed = chaos.Timeline(), chaos.Timeline(daphne_down=[[1.5, 3.0]])
    assert run_checks([cut()], {"c1": events_stream("zyx")}, [usage("c1", 3)],
                      timeline=alive) == {"unclear": 1}
    result = cut()
    assert run_checks([result], {"c1": events_stream("zyx")}, [usage("c1", 3)],
                      timeline=killed) == {}
    assert result.outcome == "connection_lost"


@pytest.mark.parametrize("status, code, ending, outcome", [
    (429, "queue_full", "body", "refused"),
    (503, "no_worker_available", "body", "refused"),
    (503, "worker_lost", "body", "error"),
    (504, "worker_timeout", "body", "error"),
    (500, "internal_error", "body", "unclear"),
    (None, None, "timeout", "unclear"),
    (None, None, "connect_error", "unclear"),
])
def test_how_a_request_that_did_not_complete_is_classified(status, code, ending, outcome):
    result = chaos.Result(index=0, tenant="alpha", prompt=0, max_tokens=10, stream=False,
                          status=status, ending=ending, start=1.0, end=2.0,
                          error={"code": code, "message": "m"} if code else None)
    chaos.classify(result, chaos.Timeline())
    assert result.outcome == outcome


def test_a_partial_answer_must_be_a_prefix_of_the_expected_one():
    result = chaos.Result(index=0, tenant="alpha", prompt=0, max_tokens=30, stream=True,
                          status=200, ending="eof", start=1.0, end=2.0)
    sse(result, chunk("p1", "abd"), 'data: {"error": {"code": "worker_lost", "message": "m"}}')
    found = run_checks([result], {"p1": events_stream("abd")}, [usage("p1", 3)])
    assert result.outcome == "error" and found == {"token_not_prefix": 2}


def test_leaks_are_counted():
    found = run_checks([streamed("l1", ANSWERS[0][0][:5], 5)],
                       {"l1": events_stream(ANSWERS[0][0][:5])}, [usage("l1", 5)],
                       leaks={"leak_fq_running": 2, "leak_gate1": 1})
    assert found == {"leak_fq_running": 2, "leak_gate1": 1}


def test_a_stream_missing_its_first_tokens_fails_unless_redis_lost_them():
    def cut() -> tuple[chaos.Result, dict]:
        # The client read 5 tokens before Redis went; the stream holds the rest (seq 5 on).
        result = streamed("g1", ANSWERS[0][0][:12], 12)
        return result, {"g1": events_stream(ANSWERS[0][0][5:12], seqs=list(range(5, 12)))}

    result, streams = cut()
    assert run_checks([result], streams, [usage("g1", 12)]) == {"stream_seq_gaps": 1}
    result, streams = cut()
    redis_restarted = chaos.Timeline(redis_kills=[1.5])
    assert run_checks([result], streams, [usage("g1", 12)], timeline=redis_restarted,
                      persistence="none") == {}
    assert run_checks([result], streams, [usage("g1", 12)], timeline=redis_restarted,
                      persistence="aof") == {"stream_seq_gaps": 1}


def test_a_final_event_counting_more_tokens_than_the_stream_holds_is_a_gap():
    result = streamed("f1", ANSWERS[0][0][:12], 12)
    stream = events_stream(ANSWERS[0][0][:12], final_seq=13)
    assert run_checks([result], {"f1": stream}, [usage("f1", 12)]) == {"stream_seq_gaps": 1}


def test_usage_is_checked_against_what_the_client_received_when_the_stream_says_less():
    # The client got 7 tokens, Redis (no persistence) restarted and the stream holds the final
    # event alone: the record's 8 cannot be checked, and is no extra record.
    result = chaos.Result(index=0, tenant="alpha", prompt=0, max_tokens=30, stream=True,
                          status=200, ending="eof", start=1.0, end=2.0)
    sse(result, *(chunk("u1", c) for c in ANSWERS[0][0][:7]))
    stream = events_stream("", final_seq=8)
    found = run_checks([result], {"u1": stream}, [usage("u1", 8)],
                       timeline=chaos.Timeline(redis_kills=[1.5], daphne_down=[[1.9, 2.5]]),
                       persistence="none")
    assert found == {}
    assert run_checks([result], {"u1": stream}, [],
                      timeline=chaos.Timeline(redis_kills=[1.5], daphne_down=[[1.9, 2.5]]),
                      persistence="none") == {"usage_missing": 1}


@pytest.mark.parametrize("stream, billed, finding", [
    (False, 0, None), (False, 5, "usage_token_mismatch"),  # it got nothing: billed nothing
    (True, 5, None), (True, 0, "usage_token_mismatch"),  # it got 5 tokens: billed them
])
def test_an_answer_ended_by_its_worker_dying_is_billed_what_its_client_got(stream, billed,
                                                                          finding):
    result = chaos.Result(index=0, tenant="alpha", prompt=0, max_tokens=12, stream=stream,
                          status=200 if stream else 503, ending="eof" if stream else "body",
                          start=1.0, end=2.0, error={"code": "worker_lost", "retryable": True})
    if stream:
        sse(result, *(chunk("r1", c) for c in "abcde"))
    summary = events_stream("abcde")
    summary.finals = [{"seq": 5, "finish_reason": "error", "error": "worker_lost",
                       "completion_tokens": 5}]
    result.request_id = "r1"
    found = run_checks([result], {"r1": summary}, [usage("r1", billed)])
    assert (finding in found) if finding else ("usage_token_mismatch" not in found), found


@pytest.mark.parametrize("billed, finding", [(0, None), (5, None),
                                             (3, "usage_token_mismatch")])
def test_an_answer_ended_by_an_error_and_unknown_to_the_client_is_billed_0_or_its_stream(
        billed, finding):
    # A 503 body names no request id: whether it streamed is unknown, so both bills are right.
    summary = events_stream("abcde")
    summary.finals = [{"seq": 5, "finish_reason": "error", "error": "worker_lost",
                       "completion_tokens": 5}]
    found = run_checks([], {"r1": summary}, [usage("r1", billed)])
    assert (finding in found) if finding else ("usage_token_mismatch" not in found), found
