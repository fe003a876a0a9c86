"""The command line of ``python -m benchmarks.serving.chaos``: its flags as :class:`Options`, the
run, the printed report and the exit status (0 on PASS, 1 on FAIL)."""

from __future__ import annotations

import argparse
import dataclasses

from benchmarks.harness.cli import (
    HelpFormatter,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)
from benchmarks.serving.chaos.report import format_report
from benchmarks.serving.chaos.runner import run
from benchmarks.serving.chaos.settings import Options


def float_pair(text: str) -> tuple[float, float]:
    """``MIN,MAX`` numbers with 0 <= MIN <= MAX (an argparse type)."""
    try:
        low, high = (float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"need MIN,MAX, got {text!r}") from None
    if not 0 <= low <= high:
        raise argparse.ArgumentTypeError(f"need 0 <= MIN <= MAX, got {text!r}")
    return low, high


def int_pair(text: str) -> tuple[int, int]:
    """``MIN,MAX`` integers with 1 <= MIN <= MAX (an argparse type)."""
    try:
        low, high = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"need MIN,MAX integers, got {text!r}") from None
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"need 1 <= MIN <= MAX, got {text!r}")
    return low, high


def fraction(text: str) -> float:
    """A number in [0, 1] (an argparse type)."""
    value = non_negative_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"{text} must be at most 1")
    return value


def parse_args(argv: list[str] | None = None) -> Options:
    """The flags (``argv``, else the command line's) as :class:`Options`; a bad one exits with
    argparse's status 2."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.serving.chaos", formatter_class=HelpFormatter,
        description="Run the platform under load while killing, pausing and draining its "
                    "processes and Redis at random; check that every request ended exactly "
                    "once with its full output or a clear error that a fault explains, that no "
                    "token was lost or doubled, that no live process was declared dead, that "
                    "nothing leaked and that usage was recorded once per request, billing what "
                    "its client received; and that every line of the Batch API jobs run beside "
                    "the load was answered exactly once, as the reference backend answers it "
                    "or with an error that a fault explains, counted and billed once, leaving "
                    "nothing behind. Prints every count (target 0) and PASS or FAIL (exit "
                    "status 1).")
    d = Options()
    parser.add_argument("--duration-s", type=positive_float, default=d.duration_s,
                        help="seconds of load and chaos (the whole run takes up to about 3 "
                             "minutes more: start-up, requests draining, settling, checks; "
                             "about 30 s on a platform that loses nothing)")
    parser.add_argument("--concurrency", type=positive_int, default=d.concurrency,
                        help="client loops, each sending one request after the other")
    parser.add_argument("--workers", type=positive_int, default=d.workers,
                        help="inference worker processes")
    parser.add_argument("--seed", type=int, default=d.seed,
                        help="seed of the kills' schedule and the requests")
    parser.add_argument("--redis-persistence", choices=("aof", "none"),
                        default=d.redis_persistence,
                        help="aof: append-only file fsynced on every write; none: a restarted "
                             "Redis starts empty (events streams lost with it are counted "
                             "apart, not as failures)")
    parser.add_argument("--step-delay-s", type=non_negative_float, default=d.step_delay_s,
                        help="REFERENCE_STEP_DELAY_S: seconds each forward pass takes")
    parser.add_argument("--request-timeout-s", type=positive_float,
                        default=d.request_timeout_s,
                        help="hard client-side limit of one request: past it, it counts as a "
                             "hang (unclear)")
    parser.add_argument("--settle-s", type=positive_float, default=d.settle_s,
                        help="at most this long for the platform to go idle after the load")
    parser.add_argument("--kill-interval-s", type=float_pair,
                        default=",".join(f"{v:g}" for v in d.kill_interval_s),
                        metavar="MIN,MAX", help="seconds between the end of one fault (a "
                                                "restart, a resume) and the next, drawn "
                                                "uniformly")
    parser.add_argument("--pause-ttls", type=float_pair,
                        default=",".join(f"{v:g}" for v in d.pause_ttls), metavar="MIN,MAX",
                        help="how long a worker or Redis stays paused (SIGSTOP), in worker "
                             "heartbeat TTLs (3 s), drawn uniformly")
    parser.add_argument("--warmup-s", type=non_negative_float, default=d.warmup_s,
                        help="seconds of load before the first kill")
    parser.add_argument("--stream-fraction", type=fraction, default=d.stream_fraction,
                        help="share of the requests that stream (SSE)")
    parser.add_argument("--max-tokens", type=int_pair,
                        default=",".join(map(str, d.max_tokens)), metavar="MIN,MAX",
                        help="range of each request's max_tokens")
    parser.add_argument("--fresh-worker-ids", action="store_true",
                        help="a restarted inference worker gets a new WORKER_ID (as with the "
                             "default host-pid ids) instead of keeping its own")
    parser.add_argument("--batch-jobs", type=non_negative_int, default=d.batch_jobs,
                        help="Batch API jobs (tenant delta, /v1/completions), created evenly "
                             "over the first two thirds of the load")
    parser.add_argument("--batch-lines", type=positive_int, default=d.batch_lines,
                        help="lines of each batch job (2 of them, in a job of 4 or more, "
                             "planted invalid: no prompt)")
    parser.add_argument("--batch-wait-s", type=positive_float, default=d.batch_wait_s,
                        help="at most this long after the load for every batch to end")
    parser.add_argument("--log-dir", default=None, metavar="DIR",
                        help="folder for the processes' logs (default: a new temporary "
                             "folder, kept and printed)")
    parser.add_argument("--out", default=None, metavar="FILE",
                        help="write the JSON report there")
    args = parser.parse_args(argv)
    return Options(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Options)})


def main(argv: list[str] | None = None) -> int:
    """One run from the command line: prints the report; returns 0 on PASS, 1 on FAIL."""
    options = parse_args(argv)
    report = run(options)
    print(format_report(report))
    return 0 if report["verdict"] == "PASS" else 1
