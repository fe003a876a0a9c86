"""The chaos harness, short: the platform under load while its processes and Redis are killed,
paused and drained at random loses no request, no token, no usage record, bills no client more
than it received, declares no live process dead, answers every line of its Batch API jobs
exactly once and as expected, and leaks nothing (``benchmarks/serving/chaos/``;
``python -m benchmarks.serving.chaos`` is the long run)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from benchmarks.serving import chaos

# About 1.5 minutes in all, at most 2.5: 60 s of load and faults (a round of every kind takes
# about 45 s: two pauses of 1.5-2 heartbeat TTLs, a drain, daphne's restarts), the platform's
# start-up, at most 60 s draining a request that hangs and 25 s settling, the checks; 2 Batch API
# jobs of 30 lines among the faults (the long run, ``python -m benchmarks.serving.chaos``, runs 4
# of 60 lines by default).
SHORT_RUN = chaos.Options(duration_s=60, concurrency=6, workers=2, seed=7, warmup_s=3,
                          kill_interval_s=(1.5, 3.0), pause_ttls=(1.5, 2.0), settle_s=25,
                          batch_jobs=2, batch_lines=30, batch_wait_s=60)


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
    jobs = report["batches"]["jobs"]
    assert len(jobs) == SHORT_RUN.batch_jobs, text
    assert all(job["status"] == "completed" and job["output_lines"] > 0 for job in jobs), text
    # (the batch checks themselves are tested below on made-up observations)
    failing = {name: n for name, n in report["counts"].items() if n}
    assert not failing, text
    assert report["verdict"] == "PASS", text


# The checks themselves, on made-up observations (no processes): each failure they exist to
# catch is caught, and a clean run is clean.

ANSWERS = [("abcdefghijklmnopqrstuvwxyz" * 5, None), ("zyxwvutsrqponmlkjihgfedcba" * 5, None)]
TTL = chaos.PLATFORM_ENV["WORKER_HEARTBEAT_TTL_S"]


def sse(result: chaos.Result, *events: str) -> chaos.Result:
    for event in events:
        chaos.parse_sse_event(result, event)
    return result


def chunk(rid: str, text: str = "", finish: str | None = None) -> str:
    body = {"id": f"cmpl-{rid}", "choices": [{"index": 0, "text": text,
                                              "finish_reason": finish}]}
    return "data: " + json.dumps(body)


def error_event(code: str, retryable: bool = True) -> str:
    return "data: " + json.dumps({"error": {"code": code, "message": "m",
                                            "retryable": retryable}})


def tokens(result: chaos.Result, rid: str, text: str, at: float = 1.5) -> chaos.Result:
    """``text`` streamed one token an event, all arriving at ``at``."""
    for c in text:
        sse(result, chunk(rid, c))
        result.arrivals.append((at, 1))
    return result


def streamed(rid: str, text: str, max_tokens: int, prompt: int = 0, **fields) -> chaos.Result:
    result = chaos.Result(index=0, tenant="alpha", prompt=prompt, max_tokens=max_tokens,
                          stream=True, status=200, ending="eof", start=1.0, end=2.0, **fields)
    tokens(result, rid, text)
    return sse(result, chunk(rid, finish="length"), "data: [DONE]")


def cut(rid: str, text: str, code: str | None = None, retryable: bool = True,
        ending: str = "eof", at: float = 1.5, prompt: int = 0) -> chaos.Result:
    """A stream that got ``text``, then an error event of ``code`` (or lost its connection)."""
    result = chaos.Result(index=0, tenant="alpha", prompt=prompt, max_tokens=30, stream=True,
                          status=200, ending=ending, start=1.0, end=2.0)
    tokens(result, rid, text, at)
    return sse(result, error_event(code, retryable)) if code else result


def plain_error(status: int, code: str, retry_after: bool = True) -> chaos.Result:
    """An answer not streamed that ended in an error body (which names no request id)."""
    return chaos.Result(index=0, tenant="alpha", prompt=0, max_tokens=12, stream=False,
                        status=status, ending="body", start=1.0, end=2.0, retryable=retry_after,
                        error={"code": code, "message": "m"})


def events_stream(text: str, seqs: list[int] | None = None, finals: int = 1,
                  final_seq: int | None = None, error: str | None = None) -> chaos.StreamSummary:
    """A stream holding ``text`` one character a token (seqs 0.. unless given)."""
    seqs = list(range(len(text))) if seqs is None else seqs
    final = {"seq": len(text) if final_seq is None else final_seq,
             "finish_reason": "error" if error else "length", "error": error,
             "completion_tokens": len(text)}
    return chaos.StreamSummary(token_events=list(zip(seqs, text, strict=True)),
                               finals=[final] * finals, first_ms=1000, last_ms=2000)


def usage(rid: str, tokens: int, prompt: int | None = None, status: int = 200,
          code: str = "", tenant: str = "alpha") -> dict:
    """A usage record (prompt tokens: 4 when it bills tokens, else 0, unless given)."""
    return {"request_id": rid, "completion_tokens": tokens,
            "prompt_tokens": (4 if tokens else 0) if prompt is None else prompt,
            "status": status, "error_code": code, "tenant__slug": tenant}


def fault(kind: str, t: float = 1.5, name: str = "", signal: str = "SIGKILL", **fields) -> dict:
    return {"t": t, "kind": kind, "name": name or kind, "signal": signal, **fields}


def run_checks(results, streams, records, leaks=None, timeline=None, persistence="aof",
               death_lines=None, batch_jobs=None, batch_state=None):
    """The counts that are not 0 after classifying ``results`` (beside one clean request) and
    checking them (with the Batch API jobs ``batch_jobs`` and what the platform kept of them,
    ``batch_state``, when given)."""
    timeline = timeline or chaos.Timeline()
    clean = streamed("clean", ANSWERS[1][0][:20], 20, prompt=1)
    results, streams = [*results, clean], {**streams, "clean": events_stream(clean.text)}
    records = [*records, usage("clean", 20)]
    for result in results:
        chaos.classify(result, timeline)
    all_leaks = {name: 0 for name in chaos.Findings.NAMES if name.startswith("leak_")}
    all_leaks.update(leaks or {})
    findings, _ = chaos.check(results, streams, records, all_leaks, {}, ANSWERS, timeline,
                              chaos.Options(redis_persistence=persistence), collected_at=10.0,
                              death_lines=death_lines, batch_jobs=batch_jobs,
                              batch_state=batch_state)
    return {name: n for name, n in findings.counts.items() if n}


def test_a_clean_run_has_no_finding():
    good = streamed("a1", ANSWERS[0][0][:12], 12)
    assert run_checks([good], {"a1": events_stream(good.text)}, [usage("a1", 12)]) == {}
    assert good.outcome == "complete"


def test_a_run_where_nothing_completed_fails():
    findings, _ = chaos.check([], {}, [], {}, {}, ANSWERS, chaos.Timeline(), chaos.Options(),
                              collected_at=10.0)
    assert findings.counts["no_request_completed"] == 1


def test_every_kind_of_fault_is_in_the_schedule():
    assert set(chaos.settings.KILL_ROUND) == set(chaos.KINDS)


@pytest.mark.parametrize("name, client_text, stream, billed", [
    ("token_mismatch_complete", "abcdefghijkm", events_stream("abcdefghijkm"), 12),
    ("generated_twice", "abcdefghijkl", events_stream("abcdefghijkl", finals=2), 12),
    ("generated_twice", "abcdefghijkl",
     events_stream("abcdefghijkll", seqs=[*range(12), 11]), 12),
    ("stream_seq_gaps", "abcdefghijkl",
     events_stream("abcdefghijkl", seqs=[*range(5), *range(6, 13)]), 12),
    ("stream_without_final", "abcdefghijkl", events_stream("abcdefghijkl", finals=0), 12),
    ("usage_missing", "abcdefghijkl", events_stream("abcdefghijkl"), None),
    ("billed_less_than_received", "abcdefghijkl", events_stream("abcdefghijkl"), 11),
    ("billed_more_than_received", "abcdefghijkl", events_stream("abcdefghijkl"), 13),
    ("streams_missing", "abcdefghijkl", None, 12),
])
def test_each_kind_of_loss_or_doubling_is_counted(name, client_text, stream, billed):
    result = streamed("r1", client_text, 12)
    found = run_checks([result], {"r1": stream} if stream else {},
                       [] if billed is None else [usage("r1", billed)])
    assert name in found, found


def test_a_cut_stream_is_unclear_unless_daphne_was_killed_while_it_was_open():
    alive = chaos.Timeline()
    killed = chaos.Timeline(daphne_down=[[1.5, 3.0]], web_deaths=[1.5],
                            kills=[fault("daphne")])
    assert run_checks([cut("c1", "zyx", prompt=1)], {"c1": events_stream("zyx")},
                      [usage("c1", 3)], timeline=alive) == {"unclear": 1}
    result = cut("c1", "zyx", prompt=1)
    assert run_checks([result], {"c1": events_stream("zyx")}, [usage("c1", 3, status=499)],
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
    result = cut("p1", "abd", "worker_lost")
    found = run_checks([result], {"p1": events_stream("abd", error="worker_lost")},
                       [usage("p1", 3, status=503, code="worker_lost")],
                       timeline=chaos.Timeline(kills=[fault("worker", name="worker0")]))
    assert result.outcome == "error" and found == {"token_not_prefix": 2}


def test_leaks_are_counted():
    found = run_checks([streamed("l1", ANSWERS[0][0][:5], 5)],
                       {"l1": events_stream(ANSWERS[0][0][:5])}, [usage("l1", 5)],
                       leaks={"leak_fq_running": 2, "leak_gate1": 1})
    assert found == {"leak_fq_running": 2, "leak_gate1": 1}


def test_a_stream_missing_its_first_tokens_fails_unless_redis_lost_them():
    def client_and_stream() -> tuple[chaos.Result, dict]:
        # The client read 5 tokens before Redis went; the stream holds the rest (seq 5 on).
        result = streamed("g1", ANSWERS[0][0][:12], 12)
        return result, {"g1": events_stream(ANSWERS[0][0][5:12], seqs=list(range(5, 12)))}

    result, streams = client_and_stream()
    assert run_checks([result], streams, [usage("g1", 12)]) == {"stream_seq_gaps": 1}
    result, streams = client_and_stream()
    redis_restarted = chaos.Timeline(redis_kills=[1.5])
    assert run_checks([result], streams, [usage("g1", 12)], timeline=redis_restarted,
                      persistence="none") == {}
    assert run_checks([result], streams, [usage("g1", 12)], timeline=redis_restarted,
                      persistence="aof") == {"stream_seq_gaps": 1}


def test_a_final_event_counting_more_tokens_than_the_stream_holds_is_a_gap():
    result = streamed("f1", ANSWERS[0][0][:12], 12)
    stream = events_stream(ANSWERS[0][0][:12], final_seq=13)
    assert run_checks([result], {"f1": stream}, [usage("f1", 12)]) == {"stream_seq_gaps": 1}


# Billing: every record against what its client received.


@pytest.mark.parametrize("billed, prompt, finding", [
    (5, 4, None),  # its prompt and the 5 tokens it was sent
    (3, 4, "billed_less_than_received"),
    (6, 4, "billed_more_than_received"),
])
def test_a_stream_ended_by_its_worker_dying_is_billed_the_tokens_its_client_got(
        billed, prompt, finding):
    result = cut("w1", "abcde", "worker_lost")
    killed = chaos.Timeline(kills=[fault("worker", name="worker0")])
    found = run_checks([result], {"w1": events_stream("abcde", error="worker_lost")},
                       [usage("w1", billed, prompt, status=503, code="worker_lost")],
                       timeline=killed)
    assert found == ({finding: 1} if finding else {}), found


@pytest.mark.parametrize("billed, prompt, finding", [
    (0, 0, None),
    (0, 4, "billed_unreceived_non_streamed"),  # its prompt, for an answer it never got
    (5, 4, "billed_unreceived_non_streamed"),
])
def test_an_answer_not_streamed_ended_by_a_drain_is_billed_nothing(billed, prompt, finding):
    # A 503 body names no request id: the record is one no client knows.
    result = plain_error(503, "interrupted")
    drained = chaos.Timeline(kills=[fault("drain-daphne", name="daphne", signal="SIGTERM")],
                             daphne_down=[[1.5, 3.0]])
    found = run_checks([result], {"n1": events_stream("abcde", error="interrupted")},
                       [usage("n1", billed, prompt, status=503, code="interrupted")],
                       timeline=drained)
    assert result.outcome == "error"
    assert (finding in found) if finding else found == {}, found
    if billed:
        assert "billed_more_than_received" in found


def test_records_no_client_knows_beyond_the_clients_knowing_no_id_are_extra():
    result = plain_error(503, "worker_lost")
    killed = chaos.Timeline(kills=[fault("worker", name="worker0")])
    one = [usage("x1", 0, status=503, code="worker_lost")]
    two = [*one, usage("x2", 0, status=503, code="worker_lost")]
    assert run_checks([result], {}, one, timeline=killed) == {}
    assert run_checks([result], {}, two, timeline=killed) == {"usage_extra": 1}


@pytest.mark.parametrize("billed, status, finding", [
    (10, 499, None),  # all it received
    (7, 499, None),  # below it by the 3 tokens of its last 0.5 s: the checkpoint's lag
    (6, 499, "billed_below_checkpoint_bound"),
    (11, 499, "billed_more_than_received"),
    (10, 200, "usage_end_mismatch"),  # cut off, recorded as answered
    (10, "done", None),  # its [DONE] came, then the connection broke: answered
])
def test_a_stream_whose_web_process_died_is_billed_up_to_its_checkpoint(billed, status,
                                                                        finding):
    # 7 tokens arrived by 1.2 s, 3 more at 1.8 s; the connection was lost at 2.0 s.
    result = cut("k1", "abcdefg", ending="conn_lost", at=1.2)
    tokens(result, "k1", "hij", at=1.8)
    if status == "done":
        status = 200
        sse(result, chunk("k1", finish="length"), "data: [DONE]")
    died = chaos.Timeline(kills=[fault("daphne")], web_deaths=[1.9], daphne_down=[[1.9, 3.0]])
    found = run_checks([result], {"k1": events_stream("abcdefghij", finals=0)},
                       [usage("k1", billed, status=status)], timeline=died)
    found.pop("stream_without_final", None)  # (the made-up stream is cut too)
    assert result.outcome == "connection_lost"
    assert found == ({finding: 1} if finding else {}), found


def test_a_record_above_what_its_client_received_fails_even_when_redis_lost_data():
    # The client got 7 tokens, Redis (no persistence) restarted and the stream holds the final
    # event alone.
    result = cut("u1", ANSWERS[0][0][:7], ending="conn_lost")
    stream = events_stream("", final_seq=8)
    timeline = chaos.Timeline(redis_kills=[1.5], daphne_down=[[1.9, 2.5]], web_deaths=[1.9])
    assert run_checks([result], {"u1": stream}, [usage("u1", 7, status=499)],
                      timeline=timeline, persistence="none") == {}
    assert run_checks([result], {"u1": stream}, [usage("u1", 8, status=499)],
                      timeline=timeline, persistence="none") == {"billed_more_than_received": 1}
    assert run_checks([result], {"u1": stream}, [], timeline=timeline,
                      persistence="none") == {"usage_missing": 1}


def test_a_record_of_a_complete_answer_says_200_and_no_error():
    good = streamed("e1", ANSWERS[0][0][:12], 12)
    assert run_checks([good], {"e1": events_stream(good.text)},
                      [usage("e1", 12, status=499)]) == {"usage_end_mismatch": 1}


# Errors and deaths the faults must explain.


@pytest.mark.parametrize("result, faults, finding", [
    (lambda: cut("c1", "abc", "worker_lost"), [], "error_without_cause"),
    (lambda: cut("c1", "abc", "worker_lost"), [fault("worker", name="worker1")], None),
    (lambda: cut("c1", "abc", "worker_lost"),
     [fault("pause-worker", name="worker1", signal="SIGSTOP", resumed_at=6.0)], None),
    (lambda: cut("c1", "abc", "worker_lost"),
     [fault("pause-redis", name="redis", signal="SIGSTOP", resumed_at=6.0)],
     "error_without_cause"),
    (lambda: plain_error(503, "interrupted"), [], "error_without_cause"),
    (lambda: plain_error(503, "interrupted"),
     [fault("drain-daphne", name="daphne", signal="SIGTERM")], None),
    (lambda: plain_error(400, "invalid_request"), [fault("worker", name="worker0")],
     "error_without_cause"),
    (lambda: cut("c1", "abc", "invalid_request"), [], "error_without_cause"),
    (lambda: cut("c1", "abc", "worker_lost", retryable=False),
     [fault("worker", name="worker1")], "error_not_retryable"),
    (lambda: plain_error(503, "worker_lost", retry_after=False),
     [fault("worker", name="worker1")], "error_not_retryable"),
])
def test_an_error_no_fault_explains_is_counted(result, faults, finding):
    result = result()
    streams = ({result.request_id: events_stream(result.text, error=result.code)}
               if result.request_id else {})
    records = ([usage(result.request_id, len(result.text), status=503, code=result.code)]
               if result.request_id else [usage("z1", 0, status=503, code=result.code)])
    found = run_checks([result], streams, records, timeline=chaos.Timeline(kills=faults))
    assert result.outcome == "error"
    assert found == ({finding: 1} if finding else {}), found


def reclaim_line(worker_ids: str, at: float, log: str = "daphne.log") -> chaos.LogLine:
    return chaos.LogLine(log, at - 0.25, at, f"reclaimed dead worker(s) {worker_ids}: 1 "
                                            "request(s) back in the queue, 1 ended")


LIVE = {"e2e-1-w0": "worker0", "e2e-1-w1": "worker1"}


@pytest.mark.parametrize("pause, line, finding", [
    # Redis paused 6 s: nobody may take that for deaths.
    ("redis", reclaim_line('["e2e-1-w0"]', 8.0), True),
    ("redis", reclaim_line('["e2e-1-w0"]', 30.0), False),  # long after the pause
    ("redis", reclaim_line('["e2e-1-w9"]', 8.0), False),  # a worker not beating at the pause
    ("redis", chaos.LogLine("worker1.log", 7.5, 7.75, "2026-01-01 inference.worker.recovery "
                            "ERROR this worker's heartbeat lapsed and its 2 request(s) were "
                            "reclaimed: stopping them"), True),
    ("redis", chaos.LogLine("worker0.log", 7.5, 7.75, "the web process web-1 streaming "
                            "request r1 is gone: stopping it"), True),
    # worker0 paused: its own reclaim is expected, another's is not.
    ("worker0", reclaim_line("e2e-1-w0", 6.0, log="worker1.log"), False),
    ("worker0", reclaim_line("e2e-1-w1", 6.0, log="celery.log"), True),
    ("worker0", chaos.LogLine("worker0.log", 7.5, 7.75, "this worker's heartbeat lapsed and "
                              "its 2 request(s) were reclaimed: stopping them"), False),
])
def test_a_death_declared_of_a_live_process_during_a_pause_is_counted(pause, line, finding):
    kind = "pause-redis" if pause == "redis" else "pause-worker"
    timeline = chaos.Timeline(kills=[fault(kind, t=2.0, name=pause, signal="SIGSTOP",
                                           resumed_at=8.0, live_workers=LIVE)])
    found = run_checks([], {}, [], timeline=timeline, death_lines=[line])
    assert found == ({"live_process_declared_dead": 1} if finding else {}), found


@pytest.mark.parametrize("pause, other_killed, finding", [
    ("redis", False, True), ("worker0", False, True), ("worker0", True, False)])
def test_a_refusal_for_want_of_workers_while_one_lived_during_a_pause_is_counted(
        pause, other_killed, finding):
    kind = "pause-redis" if pause == "redis" else "pause-worker"
    faults = [fault(kind, t=2.0, name=pause, signal="SIGSTOP", resumed_at=8.0,
                    live_workers=LIVE)]
    if other_killed:
        faults.append(fault("worker", t=8.5, name="worker1"))
    result = plain_error(503, "no_worker_available")
    result.start, result.end = 9.0, 9.1
    found = run_checks([result], {}, [], timeline=chaos.Timeline(kills=faults))
    assert result.outcome == "refused"
    assert found == ({"live_process_declared_dead": 1} if finding else {}), found


@pytest.mark.parametrize("ending, finding", [("complete", None),
                                             ("worker_lost", "paused_taken_not_served")])
def test_a_request_a_paused_worker_had_taken_and_not_started_is_served(ending, finding):
    paused = fault("pause-worker", t=1.2, name="worker0", signal="SIGSTOP", resumed_at=6.0,
                   live_workers=LIVE, taken=["t1"], running=[])
    if ending == "complete":
        result = streamed("t1", ANSWERS[0][0][:12], 12)
        streams, records = {"t1": events_stream(result.text)}, [usage("t1", 12)]
    else:
        result = cut("t1", "abc", "worker_lost")
        streams = {"t1": events_stream("abc", error="worker_lost")}
        records = [usage("t1", 3, status=503, code="worker_lost")]
    found = run_checks([result], streams, records, timeline=chaos.Timeline(kills=[paused]))
    assert found == ({finding: 1} if finding else {}), found


def test_the_log_clock_dates_each_line_by_the_samples_around_it(tmp_path):
    log = tmp_path / "daphne.log"
    log.write_text("one\n")
    now = iter([1.0, 2.0, 3.0])
    clock = chaos.LogClock(tmp_path, lambda: next(now))
    clock.sample()  # at 1.0: "one"
    with log.open("a") as handle:
        handle.write("reclaimed dead worker(s) w0: 0 request(s) back in the queue, 1 ended\n")
    clock.sample()  # at 2.0
    with log.open("a") as handle:
        handle.write("two\nreclaimed dead worker(s) w1: 0 request(s) back in the queue\n")
    lines = clock.lines(chaos.deaths.DEATH_LINE)
    assert [(x.after, x.by) for x in lines] == [(1.0, 2.0), (2.0, float("inf"))]
    clock.sample()  # at 3.0
    assert [x.by for x in clock.lines(chaos.deaths.DEATH_LINE)] == [2.0, 3.0]


# The Batch API jobs: every line answered exactly once, as expected, counted and billed once,
# nothing left behind.

BATCH = "batch_0123456789abcdef01234567"
PROMPT_TOKENS = 5


def batch_answer(rid: str, cid: str, text: str, finish: str = "length",
                 prompt_tokens: int = PROMPT_TOKENS) -> dict:
    """An output-file line, as the platform writes it."""
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": len(text),
             "total_tokens": prompt_tokens + len(text)}
    return {"id": "batch_req_1", "custom_id": cid, "error": None,
            "response": {"status_code": 200, "request_id": rid,
                         "body": {"id": f"cmpl-{rid}", "object": "text_completion",
                                  "choices": [{"index": 0, "text": text,
                                               "finish_reason": finish}], "usage": usage}}}


def batch_error(cid: str, status: int, code: str, message: str = "m",
                rid: str | None = None) -> dict:
    """An error-file line with the endpoint's error."""
    return {"id": "batch_req_2", "custom_id": cid, "error": None,
            "response": {"status_code": status, "request_id": rid,
                         "body": {"error": {"code": code, "message": message}}}}


def batch_record(rid: str, tokens: int, prompt: int | None = None, code: str = "",
                 at: float = 5.0, timeline: chaos.Timeline | None = None) -> dict:
    """A batch line's usage record, written ``at`` seconds into the run."""
    status = 503 if code else 200
    row = usage(rid, tokens, PROMPT_TOKENS if prompt is None and tokens else prompt or 0,
                status=status, code=code, tenant="delta")
    t0 = timeline.t0_unix if timeline else 0.0
    return {**row, "batch_id": rid.rsplit("-", 2)[0], "created_at": t0 + at}


def batch_run(lines: int = 4, invalid: tuple[int, ...] = (3,), timeline=None):
    """A batch that went right: (job, state, records, streams) whose lines ``invalid`` are
    planted invalid (in the error file with a 400), the others answered as expected, each by
    its attempt 0, billed once."""
    job = chaos.BatchJob(index=0, at_s=1.0, file_id="file-1", batch_id=BATCH, created_s=1.0,
                         ended_s=20.0, status="completed", lines=[
                             {"custom_id": f"job0-line{n}", "prompt": n % 2,
                              "max_tokens": 10 + n, "body": {},
                              "invalid": "no body.prompt" if n in invalid else ""}
                             for n in range(lines)])
    records, streams, db = [], {}, []
    for n, line in enumerate(job.lines):
        cid, rid = line["custom_id"], f"{BATCH}-{n}-0"
        if line["invalid"]:
            job.error.append(batch_error(cid, 400, "invalid_value"))
            db.append({"batch_id": BATCH, "index": n, "custom_id": cid, "state": "failed",
                       "attempt": 0, "request_id": ""})
            continue
        text, finish = chaos.expected_for(ANSWERS[line["prompt"]], line["max_tokens"])
        job.output.append(batch_answer(rid, cid, text, finish))
        records.append(batch_record(rid, len(text), timeline=timeline))
        streams[rid] = events_stream(text)
        db.append({"batch_id": BATCH, "index": n, "custom_id": cid, "state": "done",
                   "attempt": 0, "request_id": rid})
    counted(job)
    state = chaos.BatchState(batches=[{"id": BATCH, "input_file_id": "file-1",
                                       "status": "completed"}], lines=db)
    return job, state, records, streams


def counted(job: chaos.BatchJob) -> chaos.BatchJob:
    """``request_counts`` as the files say."""
    job.request_counts = {"total": len(job.lines), "completed": len(job.output),
                          "failed": len(job.error)}
    return job


def batch_checks(job, state, records, streams, timeline=None):
    return run_checks([], streams, records, timeline=timeline, batch_jobs=[job],
                      batch_state=state)


def test_a_clean_batch_has_no_finding_and_its_records_are_not_the_clients():
    # Its records are no interactive client's (none knows their ids), nor its lines' streams.
    job, state, records, streams = batch_run()
    assert batch_checks(job, state, records, streams) == {}
    assert run_checks([], streams, records) == {}


def _lost(job, state, records):
    del job.output[0]
    counted(job)


def _doubled(job, state, records):
    job.output.append(job.output[0])
    counted(job)


def _in_both_files(job, state, records):
    job.error.append(batch_error(job.lines[0]["custom_id"], 503, "service_unavailable"))
    counted(job)


def _unknown(job, state, records):
    job.output.append(batch_answer(f"{BATCH}-9-0", "job0-line9", "abc"))
    counted(job)


def _answer(n: int, **changes):
    """Change the answer of line ``n``: its choice's fields, its usage's, or the entry's."""
    def change(job, state, records):
        entry = job.output[n]
        body = entry["response"]["body"]
        for key, value in changes.items():
            if key in body["choices"][0]:
                body["choices"][0][key] = value
            elif key in body["usage"]:
                body["usage"][key] = value
            else:
                entry["response"][key] = value
    return change


def _invalid_answered(job, state, records):
    cid = job.lines[3]["custom_id"]
    job.error.clear()
    job.output.append(batch_answer(f"{BATCH}-3-0", cid, "abc"))
    counted(job)


def _invalid_not_400(job, state, records):
    job.error[0] = batch_error(job.lines[3]["custom_id"], 503, "service_unavailable")


def _valid_failed(job, state, records):
    job.output.pop(1)
    job.error.append(batch_error(job.lines[1]["custom_id"], 503, "service_unavailable",
                                 "The request failed 3 times (worker_lost: gone).",
                                 f"{BATCH}-1-2"))
    records[:] = [r for r in records if r["request_id"] != f"{BATCH}-1-0"]
    counted(job)


def _counts_off(job, state, records):
    job.request_counts["completed"] -= 1


def _record_dropped(job, state, records):
    del records[0]


def _record_off(job, state, records):
    records[0]["completion_tokens"] += 1


def _attempt_billed(job, state, records):
    # Line 0 was answered by attempt 1; its attempt 0 (worker lost) bills tokens too.
    first = job.output[0]["response"]
    rid = f"{BATCH}-0-1"
    first["request_id"] = rid
    records[0]["request_id"] = rid
    records.append(batch_record(f"{BATCH}-0-0", 4, code="worker_lost"))


def _failed_line_billed(job, state, records):
    _valid_failed(job, state, records)
    records.append(batch_record(f"{BATCH}-1-2", 3, code="worker_lost"))


def _invalid_billed(job, state, records):
    records.append(batch_record(f"{BATCH}-3-0", 0))


def _record_of_no_line(job, state, records):
    records.append(batch_record(f"{BATCH}-7-0", 3))


def _other_batch(job, state, records):
    records[0]["batch_id"] = "batch_ffffffffffffffffffffffff"


def _line_running(job, state, records):
    state.lines[0]["state"] = "running"


def _redis_left(job, state, records):
    state.redis_left.append({"key": "p:fq:wait", "why": "an entry of a hash",
                             "member": f"{BATCH}-0-0"})


def _prompt_tokens_differ(job, state, records):
    # Line 2 (prompt 0, as line 0) counts 6 prompt tokens, and so does its record.
    usage_ = job.output[2]["response"]["body"]["usage"]
    usage_["prompt_tokens"], usage_["total_tokens"] = 6, 6 + usage_["completion_tokens"]
    records[2]["prompt_tokens"] = 6


def _status(status):
    def change(job, state, records):
        job.status = status
    return change


def _not_created(job, state, records):
    job.batch_id, job.failure = "", "not created: HTTP 400"
    state.batches.clear()
    records.clear()


def _created_twice(job, state, records):
    state.batches.append({"id": "batch_eeeeeeeeeeeeeeeeeeeeeeee", "input_file_id": "file-1",
                          "status": "completed"})


def _unreadable(job, state, records):
    job.unreadable.append("{not json")


@pytest.mark.parametrize("change, found", [
    (_lost, {"batch_lines_lost": 1}),
    (_doubled, {"batch_lines_duplicated": 1}),
    (_in_both_files, {"batch_lines_duplicated": 1}),
    (_unknown, {"batch_lines_unknown": 1}),
    (_answer(0, text=ANSWERS[0][0][:9] + "X"), {"batch_output_mismatch": 1,
                                                "batch_usage_mismatch": 0}),
    (_answer(1, finish_reason="stop"), {"batch_output_mismatch": 1}),
    (_answer(0, completion_tokens=11), {"batch_output_mismatch": 1,
                                        "batch_usage_mismatch": 1}),
    (_answer(0, total_tokens=3), {"batch_output_mismatch": 1}),
    (_answer(0, status_code=201), {"batch_output_mismatch": 1}),
    (_answer(0, request_id=f"{BATCH}-1-0"), {"batch_output_mismatch": 1,
                                             "batch_usage_missing": 1,
                                             "batch_billed_twice": 1}),
    (_prompt_tokens_differ, {"batch_output_mismatch": 1}),
    (_invalid_answered, {"batch_invalid_not_refused": 1}),
    (_invalid_not_400, {"batch_invalid_not_refused": 1}),
    (_valid_failed, {"batch_error_unexplained": 1}),  # no fault during the batch
    (_counts_off, {"batch_counts_mismatch": 1}),
    (_record_dropped, {"batch_usage_missing": 1}),
    (_record_off, {"batch_usage_mismatch": 1}),
    (_other_batch, {"batch_usage_mismatch": 1}),
    (_attempt_billed, {"batch_billed_twice": 1, "batch_retry_without_cause": 1}),
    (_failed_line_billed, {"batch_billed_failed_line": 1, "batch_error_unexplained": 1,
                           "batch_retry_without_cause": 1}),
    (_invalid_billed, {"batch_billed_failed_line": 1}),
    (_record_of_no_line, {"batch_usage_extra": 1}),
    (_line_running, {"batch_leak_lines": 1}),
    (_redis_left, {"batch_leak_redis": 1}),
    (_status("in_progress"), {"batch_not_ended": 1}),
    (_status("expired"), {"batch_ended_not_completed": 1}),
    (_status("failed"), {"batch_ended_not_completed": 1}),
    (_not_created, {"batch_not_created": 1}),
    (_created_twice, {"batch_created_twice": 1}),
    (_unreadable, {"batch_files_unreadable": 1}),
])
def test_each_batch_line_lost_doubled_wrong_unexplained_misbilled_or_left_is_counted(
        change, found):
    job, state, records, streams = batch_run()
    change(job, state, records)
    assert batch_checks(job, state, records, streams) == {k: v for k, v in found.items() if v}


@pytest.mark.parametrize("kills, finding", [(3, None), (2, "batch_error_unexplained")])
def test_a_line_that_failed_every_attempt_is_explained_by_as_many_worker_faults(kills,
                                                                               finding):
    timeline = chaos.Timeline(kills=[fault("worker", t=2.0 + i, name="worker0")
                                     for i in range(kills)])
    job, state, records, streams = batch_run(timeline=timeline)
    _valid_failed(job, state, records)
    for attempt in range(3):  # each attempt lost its worker: billed nothing
        records.append(batch_record(f"{BATCH}-1-{attempt}", 0, code="worker_lost", at=6.0,
                                    timeline=timeline))
    found = batch_checks(job, state, records, streams, timeline=timeline)
    assert found == ({finding: 1} if finding else {}), found


@pytest.mark.parametrize("faults, finding", [
    ([], "batch_retry_without_cause"),
    ([fault("worker", t=3.0, name="worker1")], None),
    ([fault("worker", t=9.0, name="worker1")], "batch_retry_without_cause"),  # after it
    ([fault("drain-daphne", t=3.0, name="daphne", signal="SIGTERM")],
     "batch_retry_without_cause"),  # a line has no web process
])
def test_a_line_sent_again_after_an_error_no_fault_explains_is_counted(faults, finding):
    timeline = chaos.Timeline(kills=faults)
    job, state, records, streams = batch_run(timeline=timeline)
    _attempt_billed(job, state, records)
    records[-1] = batch_record(f"{BATCH}-0-0", 0, code="worker_lost", at=5.0,
                               timeline=timeline)
    found = batch_checks(job, state, records, streams, timeline=timeline)
    assert found == ({finding: 1} if finding else {}), found


def test_a_batch_record_redis_took_with_it_is_counted_apart():
    redis_restarted = chaos.Timeline(redis_kills=[5.0])
    job, state, records, streams = batch_run()
    del records[0]
    assert run_checks([], streams, records, timeline=redis_restarted, persistence="none",
                      batch_jobs=[job], batch_state=state) == {}
    assert run_checks([], streams, records, timeline=redis_restarted, persistence="aof",
                      batch_jobs=[job], batch_state=state) == {"batch_usage_missing": 1}


def test_the_batch_jobs_plant_their_invalid_lines_and_fall_within_the_load():
    options = dataclasses.replace(SHORT_RUN, batch_jobs=3, batch_lines=30)
    jobs = chaos.make_jobs(options)
    assert [len(job.lines) for job in jobs] == [30, 30, 30]
    assert all(options.warmup_s <= job.at_s <= options.duration_s * 2 / 3 for job in jobs)
    for job in jobs:
        lines = [json.loads(raw) for raw in chaos.batches.jsonl(job).splitlines()]
        assert len({line["custom_id"] for line in lines}) == 30
        planted = [line for line in lines if "prompt" not in line["body"]]
        assert len(planted) == chaos.settings.BATCH_INVALID_LINES
        assert all(options.max_tokens[0] <= line["body"]["max_tokens"] <= options.max_tokens[1]
                   for line in lines)
    assert chaos.make_jobs(options)[1].lines == jobs[1].lines


def test_a_create_whose_reply_was_lost_is_resolved_not_sent_twice():
    import httpx
    import openai

    request = httpx.Request("POST", "http://x/v1/batches")
    job = chaos.BatchJob(index=0, at_s=0.0, lines=[])

    def failing(*errors):
        sent = []

        def fn():
            sent.append(1)
            if len(sent) <= len(errors):
                raise errors[len(sent) - 1]
            return "made"
        return fn, sent

    def lost(cause):
        try:
            raise openai.APIConnectionError(request=request) from cause
        except openai.APIConnectionError as exc:
            return exc

    refused = lost(httpx.ConnectError("refused"))
    cut_off = lost(httpx.RemoteProtocolError("Server disconnected without sending a response."))
    fn, sent = failing(refused, refused)  # never reached the platform: sent again
    assert chaos.batches.call(job, "create", fn, lambda: 0.0, resolve=lambda: None) == "made"
    assert len(sent) == 3
    fn, sent = failing(cut_off)  # it may have been made: found, not sent again
    assert chaos.batches.call(job, "create", fn, lambda: 0.0, resolve=lambda: "found") == "found"
    assert len(sent) == 1
    fn, sent = failing(cut_off)  # not found: sent again
    assert chaos.batches.call(job, "create", fn, lambda: 0.0, resolve=lambda: None) == "made"
    assert len(sent) == 2
    bad = openai.BadRequestError("no", response=httpx.Response(400, request=request), body={})
    fn, sent = failing(bad)
    with pytest.raises(chaos.batches.CallFailed):
        chaos.batches.call(job, "create", fn, lambda: 0.0)
    assert len(sent) == 1


def test_what_redis_keeps_of_an_ended_batch_is_found():
    import uuid

    import redis

    prefix = f"chaos-test-{uuid.uuid4().hex[:8]}"
    client = redis.Redis.from_url("redis://127.0.0.1:6379/0")
    try:
        client.hset(f"{prefix}:fq:wait", f"{BATCH}-0-0", "1")  # a queue entry
        client.hset(f"{prefix}:batch:active", BATCH, "{}")  # its figures
        client.xadd(f"{prefix}:events:{BATCH}-1-0", {"t": "x"})  # a stream never ended
        client.xadd(f"{prefix}:events:{BATCH}-2-0", {"t": "x"})
        client.expire(f"{prefix}:events:{BATCH}-2-0", 600)  # ended: within its TTL
        client.set(f"{prefix}:admitted:{BATCH}-2-0", "1", ex=600)  # a marker that expires
        client.hset(f"{prefix}:fq:wait", "other-request", "1")
        left = chaos.batches.redis_left(client, prefix, [BATCH])
    finally:
        stale = list(client.scan_iter(f"{prefix}:*"))
        if stale:
            client.delete(*stale)
    assert sorted((item["key"].removeprefix(prefix), item.get("member")) for item in left) == [
        (":batch:active", BATCH), (f":events:{BATCH}-1-0", None), (":fq:wait", f"{BATCH}-0-0")]
