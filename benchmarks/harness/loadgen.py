"""A load generator for serving benchmarks: workloads, targets, and vLLM's serving metrics.

Workloads are lists of :class:`RequestSpec` (a prompt, ``max_tokens``, a tenant, an arrival
time). They are sent by :func:`run_load` to a target, either the REST API (:class:`RestTarget`:
``POST /v1/completions`` with SSE streaming, one API key per tenant) or the engine in-process
(:class:`EngineTarget`), with open-loop arrivals (each request at its ``arrival_s``, e.g. Poisson)
and an optional bound on requests in flight (fixed concurrency: every ``arrival_s`` 0 and a
bound). Each request gives a :class:`RequestResult`; :func:`summarize` turns them into the metrics
of vLLM's ``benchmarks/benchmark_serving.py``:

* TTFT: from sending a request to its first streamed token;
* TPOT: per request, ``(e2e - ttft) / (output_tokens - 1)``, over requests of more than one token;
* ITL: every gap between two consecutive streamed chunks, over all requests;
* E2EL: from sending a request to its last chunk;
* request, output-token and total-token throughput over the run's duration (first send to last
  completion), and goodput: requests per second that meet every stated SLO.

Latencies are reported in milliseconds (mean, median, std, p90, p99); rejected requests (HTTP
429) and errors are counted apart, with their reasons (:func:`failure_counts`), and excluded from
the latency figures.

The parts live in their own modules: the workload in :mod:`benchmarks.harness.workload`, the results
and metrics in :mod:`benchmarks.harness.metrics`, the targets and :func:`run_load` in
:mod:`benchmarks.harness.targets`, the argparse types in :mod:`benchmarks.harness.cli`. This module
is the command line, ``python -m benchmarks.harness.loadgen``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from collections.abc import Sequence
from typing import Any

from benchmarks.harness.cli import (
    HelpFormatter,
    non_negative_float,
    non_negative_int,
    positive_int,
    slo,
    tenant_key,
)
from benchmarks.harness.common import (
    finite,
    machine,
    make_engine,
    model_tokenizer,
    reference_tokenizer,
    write_json,
)
from benchmarks.harness.metrics import (
    RequestResult,
    failure_reason,
    records,
    report,
    summarize,
    summarize_by,
)
from benchmarks.harness.targets import EngineTarget, RestTarget, run_load
from benchmarks.harness.workload import PromptMaker, random_requests, shared_prefix_requests


def build_parser():
    """The command line of ``python -m benchmarks.harness.loadgen``."""
    parser = argparse.ArgumentParser(
        description="Send one workload and print vLLM's serving metrics (JSON under "
                    "benchmarks/results/).",
        formatter_class=HelpFormatter)
    parser.add_argument("--target", choices=("rest", "engine"), default="rest",
                        help="the REST API of a running platform, or the engine in-process")
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the platform (rest)")
    parser.add_argument("--key", action="append", type=tenant_key, default=[],
                        metavar="TENANT=KEY",
                        help="an API key per tenant (rest); requests go round-robin")
    parser.add_argument("--backend", choices=("transformers", "reference"),
                        default="transformers",
                        help="prompts' tokenizer, and the engine's backend (engine); with "
                             "--target rest, give the platform's BACKEND")
    parser.add_argument("--dataset", choices=("random", "shared-prefix"), default="random",
                        help="random-length prompts, or shared prefixes plus unique suffixes")
    parser.add_argument("--requests", type=positive_int, default=64, help="requests to send")
    parser.add_argument("--rate", type=non_negative_float, default=0,
                        help="Poisson arrivals, requests/s over all tenants (0: all at once)")
    parser.add_argument("--concurrency", type=non_negative_int, default=0,
                        help="max in flight (0: no bound)")
    parser.add_argument("--input-len", type=positive_int, nargs=2, default=(64, 256),
                        metavar=("MIN", "MAX"),
                        help="prompt tokens (shared-prefix: MIN is the suffix length)")
    parser.add_argument("--output-len", type=positive_int, nargs=2, default=(32, 128),
                        metavar=("MIN", "MAX"),
                        help="output tokens (shared-prefix: MIN for every request)")
    parser.add_argument("--prefixes", type=positive_int, default=4, help="shared-prefix: prefixes")
    parser.add_argument("--prefix-len", type=positive_int, default=512,
                        help="shared-prefix: tokens")
    parser.add_argument("--slo", action="append", type=slo, default=[], metavar="NAME=MS",
                        help="goodput SLO, NAME one of ttft, tpot, e2el, e.g. ttft=500")
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    parser.add_argument("--name", default="loadgen", help="results file name")
    parser.add_argument("--out-dir", default=None, metavar="DIR",
                        help="folder for the JSON (default: benchmarks/results/)")
    return parser


def parse_args(argv: list[str] | None = None):
    """Parsed and checked arguments (``parser.error`` on a bad combination)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    for flag in ("input_len", "output_len"):
        lo, hi = getattr(args, flag)
        if lo > hi:
            parser.error(f"--{flag.replace('_', '-')}: MIN ({lo}) is greater than MAX ({hi})")
    tenants = [t for t, _ in args.key]
    if len(set(tenants)) != len(tenants):
        parser.error("--key: a tenant is given more than once")
    if args.key and args.target == "engine":
        parser.error("--key applies to --target rest only")
    return args


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.harness.loadgen``: one load against a running platform or the engine.

    Exit status 0, or 1 when no request completed (the first failure's reason on stderr).
    """
    args = parse_args(argv)
    keys = dict(args.key) or {"default": ""}
    tenants = list(keys)
    tokenizer = model_tokenizer() if args.backend == "transformers" else reference_tokenizer()
    rng = random.Random(args.seed)
    maker = PromptMaker(tokenizer, seed=args.seed)
    arrivals = _n_arrivals(args, rng) if args.rate else [0.0] * args.requests
    if args.dataset == "random":
        specs = random_requests(maker, arrivals, tuple(args.input_len), tuple(args.output_len),
                                rng)
    else:
        specs = shared_prefix_requests(maker, arrivals, args.prefixes, args.prefix_len,
                                       args.input_len[0], args.output_len[0], rng)
    for i, spec in enumerate(specs):
        spec.tenant = tenants[i % len(tenants)]
    slos = dict(args.slo)
    before = machine()

    async def go() -> tuple[list[RequestResult], float]:
        if args.target == "rest":
            target: Any = RestTarget(args.url, keys)
        else:
            target = EngineTarget(make_engine(real_model=args.backend == "transformers",
                                              max_pending=max(256, args.requests)))
        async with target:
            return await run_load(target, specs, max_concurrency=args.concurrency or None)

    results, duration = asyncio.run(go())
    summary = summarize(results, duration, slos or None)
    print(json.dumps(finite(summary), indent=1, default=float))
    path = write_json(args.name, {"args": vars(args), "machine_before": before,
                                  "summary": summary,
                                  "per_tenant": summarize_by(results, lambda r: r.tenant,
                                                             duration, slos or None),
                                  "results": records(results)}, args.out_dir)
    print(f"wrote {path}")
    all_failed = report(summary)
    if all_failed is not None:
        print(f"ERROR: no request completed; first error: {_first_error(results)}",
              file=sys.stderr)
        return 1
    return 0


def _first_error(results: Sequence[RequestResult]) -> str:
    """The reason of the first request (by send time) that did not complete."""
    failed = sorted((r for r in results if r.status != "ok"), key=lambda r: r.sent_s)
    return failure_reason(failed[0]) if failed else "none"


def _n_arrivals(args: Any, rng: random.Random) -> list[float]:
    """``args.requests`` Poisson arrival times at ``args.rate`` requests/s."""
    times, t = [], 0.0
    for _ in range(args.requests):
        t += rng.expovariate(args.rate)
        times.append(t)
    return times


if __name__ == "__main__":
    raise SystemExit(main())
