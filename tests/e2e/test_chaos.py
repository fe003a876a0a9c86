"""The chaos harness, short: the platform under load while its processes and Redis are killed,
paused and drained at random loses no request, no token, no usage record, bills no client more
than it received, declares no live process dead and leaks nothing (``benchmarks/serving/chaos/``;
``python -m benchmarks.serving.chaos`` is the long run)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from benchmarks.serving import chaos

# About 1.5 minutes in all, at most 2.5: 60 s of load and faults (a round of every kind takes
# about 45 s: two pauses of 1.5-2 heartbeat TTLs, a drain, daphne's restarts), the platform's
# start-up, at most 60 s draining a request that hangs and 25 s settling, the checks.
SHORT_RUN = chaos.Options(duration_s=60, concurrency=6, workers=2, seed=7, warmup_s=3,
                          kill_interval_s=(1.5, 3.0), pause_ttls=(1.5, 2.0), settle_s=25)


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
               death_lines=None):
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
                              chaos.Options(redis_persistence=persistence), collected_at=10.0,
                              death_lines=death_lines)
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
