"""The prefill experiment's modes, its control workload and its verdict (no model, no run)."""

from __future__ import annotations

import argparse
import math

import pytest

from benchmarks.harness.common import reference_tokenizer
from benchmarks.harness.workload import PromptMaker
from benchmarks.serving import prefill, prefill_modes
from benchmarks.serving.prefill import verdicts
from benchmarks.serving.prefill_modes import Mode, parse_mode


@pytest.mark.parametrize("text, name, settings, control", [
    ("default", "default", {}, False),
    ("control", "control", {}, True),
    ("monolithic", "monolithic", {"prefill_mode": "monolithic"}, False),
    ("chunked", "chunked:256", {"prefill_mode": "chunked", "prefill_chunk_size": 256}, False),
    ("chunked:64", "chunked:64", {"prefill_mode": "chunked", "prefill_chunk_size": 64}, False),
    ("mixed_batch", "mixed_batch", {"prefill_mode": "mixed_batch"}, False),
    ("mixed_batch:512", "mixed_batch:512",
     {"prefill_mode": "mixed_batch", "prefill_chunk_size": 512}, False),
    ("itl:80", "itl:80", {"target_itl_ms": 80.0}, False),
    ("itl:0", "itl:0", {"target_itl_ms": 0.0}, False),
    ("itl:62.5+mixed_batch:128+control", "control+mixed_batch:128+itl:62.5",
     {"prefill_mode": "mixed_batch", "prefill_chunk_size": 128, "target_itl_ms": 62.5}, True),
])
def test_modes(text, name, settings, control):
    assert parse_mode(text) == Mode(name, settings, control)


@pytest.mark.parametrize("text, message", [
    ("chunked:0", "greater than 0"),
    ("chunked:x", "not a number"),
    ("mixed_batch:1.5", "not a number"),
    ("itl:-1", "at least 0"),
    ("itl:nan", "at least 0"),
    ("monolithic:64", "no chunk size"),
    ("chunked+monolithic", "more than one prefill mode"),
    ("itl:50+itl:60", "more than one itl"),
    ("default+itl:50", "default takes no other term"),
    ("control+control", "control twice"),
    ("disaggregated", "unknown mode term"),
    ("chunked+", "empty mode"),
])
def test_bad_modes(text, message):
    with pytest.raises(ValueError, match=message):
        parse_mode(text)


def test_chunked_alone_takes_the_chunk_flag_and_lists_merge_duplicates():
    assert parse_mode("chunked", chunk=128).name == "chunked:128"
    modes = prefill_modes.mode_list(256)("default, chunked,chunked:256,control")
    assert [m.name for m in modes] == ["default", "chunked:256", "control"]
    assert [m.name for m in prefill_modes.mode_list(256)(",".join(prefill.MODES))] == list(
        prefill.MODES)


@pytest.mark.parametrize("argv, message", [
    (["--modes", "chunked:0"], "argument --modes"),
    (["--modes", " , "], "empty list of modes"),
    (["--dtype", "int8"], "invalid choice"),
])
def test_bad_flags_are_argparse_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        prefill.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def args(**overrides) -> argparse.Namespace:
    values = {"seed": 3, "streams": 2, "stream_tokens": 100, "long_lens": "96,160",
              "long_every": 2.0, "warmup": 1.0, "short_every": 1.0, "batch": 16,
              "dtype": "auto"}
    return argparse.Namespace(**{**values, **overrides})


def test_the_control_workload_has_no_long_prompts_and_the_same_streams_and_shorts():
    maker = PromptMaker(reference_tokenizer(), seed=3, corpus_words=2_000)
    full = prefill.workload(args(), PromptMaker(reference_tokenizer(), seed=3,
                                                corpus_words=2_000))
    control = prefill.workload(args(), maker, with_long=False)
    assert sorted(s.tag for s in full if s.tag == "long") == ["long", "long"]
    assert not [s for s in control if s.tag == "long"]
    assert [(s.tag, s.arrival_s, s.prompt) for s in full if s.tag != "long"] == [
        (s.tag, s.arrival_s, s.prompt) for s in control]
    # The short requests keep arriving until the last long prompt's slot (1 + 2 x 2 s).
    assert [s.arrival_s for s in control if s.tag == "short"] == [0.5, 1.5, 2.5, 3.5, 4.5]


def test_default_modes_pass_the_engines_settings_check():
    modes = [parse_mode(m) for m in prefill.MODES]
    assert prefill_modes.check_modes(modes, args()) == []
    assert prefill_modes.engine_settings(parse_mode("control"), args()) == {
        "max_batch_size": 16, "kv_num_blocks": 1024, "max_pending": 1000, "dtype": "auto"}


def run(mode: str, itl_p50: float, itl_p99: float, long_mean: float | None) -> dict:
    return {"mode": mode,
            "stream_itl_ms": {"mean": itl_p50, "median": itl_p50, "std": 1.0,
                              "p90": itl_p99, "p99": itl_p99, "max": itl_p99},
            "long_ttft_ms": None if long_mean is None else {"mean": long_mean,
                                                            "median": long_mean}}


def test_verdict_passes_and_misses():
    runs = [run("default", 60, 170, 15_000), run("control", 60, 80, None),
            run("chunked:256", 64, 2_800, 17_400)]
    itl, ttft = verdicts(runs)
    assert itl["check"] == "itl" and itl["measured_ms"] == 170 and itl["limit_ms"] == 180
    assert itl["verdict"] == "PASS"
    assert ttft["check"] == "long_ttft" and ttft["limit_ms"] == 17_400
    assert ttft["verdict"] == "PASS"

    runs[0] = run("default", 60, 181, 17_401)
    itl, ttft = verdicts(runs)
    assert (itl["verdict"], ttft["verdict"]) == ("MISS", "MISS")
    text = prefill.format_verdicts(verdicts(runs))
    assert "181 ms against 180 ms  MISS" in text and "17.4 s against 17.4 s  MISS" in text


def test_verdict_is_not_applicable_without_its_modes_or_figures():
    assert [v["verdict"] for v in verdicts([run("default", 60, 170, 15_000)])] == ["n/a", "n/a"]
    nan_control = run("control", math.nan, math.nan, None)
    itl, ttft = verdicts([run("default", 60, 170, None), nan_control,
                          run("chunked:256", 64, 2_800, 17_400)])
    assert itl["verdict"] == "n/a" and itl["limit_ms"] is None
    assert ttft["verdict"] == "n/a" and ttft["measured_ms"] is None


def test_a_mode_the_engine_refuses_is_reported_before_any_run():
    refused = prefill_modes.check_modes([Mode("reserved", {"prefill_mode": "disaggregated"}),
                                         Mode("typo", {"prefill_chunk_sise": 64})], args())
    assert len(refused) == 2
    assert refused[0].startswith("reserved: ") and "not implemented" in refused[0]
    assert refused[1].startswith("typo: prefill_chunk_sise")
