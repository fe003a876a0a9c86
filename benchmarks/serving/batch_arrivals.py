"""What an interactive request arriving beside batch work waits for, in one engine.

An engine (in this process, the worker's settings and the real model, its own tick thread as
in the worker) serves ``--lines`` batch lines (48 prompt tokens, 16 generated, as
:mod:`benchmarks.serving.batch_impact`'s) while ``--arrivals`` interactive requests (a
41-word prompt each, 2 tokens) arrive ``--gap-s`` apart (uniform); each arrival's time to first
token is read from the engine's events. Runs, side by side in one invocation:

* ``alone``: the arrivals on an idle engine (no batch);
* ``batch``: the same arrivals beside the batch, the engine as it ships (a pass of batch rows
  alone gives way between layers to an arrival, and the pass that computes an interactive
  prompt carries no batch row: ``docs/design.md``, "The batch service class");
* ``batch, no give-way``: the same, a batch pass never stopped for an arrival.

Each is run with ``BATCH_YIELD_S`` as the settings give it and with 0 (batch passes never held
short: what the first arrival after a quiet while meets). Printed: TTFT p50 / p90 / max and their
ratios to ``alone``, the batch tokens generated meanwhile, the passes that gave way.

Usage::

    python -m benchmarks.serving.batch_arrivals            # about 4 minutes
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from benchmarks.harness.cli import HelpFormatter, add_out_dir_flag
from benchmarks.harness.common import machine, print_table, write_json
from benchmarks.serving.batch_impact import batch_lines, platform_env

WORDS = ("alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "ember")


def engine_config(args: argparse.Namespace, batch_yield_s: float | None) -> Any:
    from inference.engine.model_store import prepare_default_model
    from inference.worker.settings import WorkerSettings

    env = platform_env(argparse.Namespace(**{**vars(args), "batch_yield_s": None}), "")
    worker = WorkerSettings(**{k.lower(): v for k, v in env.items()
                               if k.lower() in WorkerSettings.model_fields})
    config = worker.engine_config().model_copy(update={"max_pending": args.lines + 100})
    if batch_yield_s is not None:
        config = config.model_copy(update={"batch_yield_s": batch_yield_s})
    if not config.model_path:
        config = config.model_copy(
            update={"model_path": str(prepare_default_model(worker.model_cache_dir))})
    return config


def one_run(args: argparse.Namespace, config: Any, with_batch: bool,
            give_way: bool) -> dict[str, Any]:
    from inference.engine.llm_engine import LLMEngine
    from inference.engine.request import SamplingParams
    from inference.engine.sched import mixed_tick

    first: dict[str, float] = {}

    def sink(events: list) -> None:
        now = time.perf_counter()
        for event in events:
            if event.request_id.startswith("i-") and event.request_id not in first:
                first[event.request_id] = now

    arrived = mixed_tick.MixedPass._interactive_arrived
    if not give_way:
        mixed_tick.MixedPass._interactive_arrived = lambda self: False
    engine = LLMEngine(config, event_sink=sink)
    try:
        engine.start()
        if with_batch:
            for line in batch_lines(args):
                body = line["body"]
                engine.submit(prompt=body["prompt"], request_id=line["custom_id"], batch=True,
                              sampling=SamplingParams(max_tokens=body["max_tokens"],
                                                      ignore_eos=True))
        time.sleep(args.settle_s)
        rng = random.Random(args.seed)
        sent: dict[str, float] = {}
        before = engine.stats().get("tokens_generated", 0)
        for k in range(args.arrivals):
            time.sleep(rng.uniform(*args.gap_s))
            rid = f"i-{k}"
            sent[rid] = time.perf_counter()
            engine.submit(prompt=" ".join(rng.choice(WORDS) for _ in range(41)),
                          request_id=rid, sampling=SamplingParams(max_tokens=2))
        time.sleep(2.0)
        stats = engine.stats()
    finally:
        engine.shutdown(1.0)
        mixed_tick.MixedPass._interactive_arrived = arrived
    ttft = sorted(1000 * (first[r] - sent[r]) for r in sent if r in first)
    return {"answered": len(ttft), "ttft_ms": {
                "p50": ttft[len(ttft) // 2], "p90": ttft[int(len(ttft) * 0.9)], "max": ttft[-1]},
            "batch_tokens": stats.get("tokens_generated", 0) - before - 2 * len(ttft),
            "passes_yielded": stats.get("batch_passes_yielded", 0)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--lines", type=int, default=600, help="batch lines")
    parser.add_argument("--line-input", type=int, default=48, help="prompt tokens per line")
    parser.add_argument("--line-output", type=int, default=16, help="tokens each line makes")
    parser.add_argument("--batch", type=int, default=16, help="the engine's MAX_BATCH_SIZE")
    parser.add_argument("--in-flight", type=int, default=64, help="(the batch run's setting)")
    parser.add_argument("--arrivals", type=int, default=25, help="interactive requests a run")
    parser.add_argument("--gap-s", type=float, nargs=2, default=(0.5, 1.5),
                        help="seconds between arrivals (uniform between the two)")
    parser.add_argument("--settle-s", type=float, default=2.0,
                        help="seconds the batch runs before the first arrival")
    parser.add_argument("--seed", type=int, default=0)
    add_out_dir_flag(parser)
    args = parser.parse_args(argv)
    runs: list[dict[str, Any]] = []
    for yield_s in (None, 0.0):
        config = engine_config(args, yield_s)
        for name, with_batch, give_way in (("alone", False, True), ("batch", True, True),
                                           ("batch, no give-way", True, False)):
            run = one_run(args, config, with_batch, give_way)
            runs.append({"name": name, "batch_yield_s": config.batch_yield_s, **run})
    rows = []
    for run in runs:
        base = next(r for r in runs if r["name"] == "alone"
                    and r["batch_yield_s"] == run["batch_yield_s"])
        ratio = {k: run["ttft_ms"][k] / base["ttft_ms"][k] for k in ("p50", "p90", "max")}
        rows.append({"run": run["name"], "BATCH_YIELD_S": run["batch_yield_s"],
                     "TTFT p50 / p90 / max ms": "{p50:.0f} / {p90:.0f} / {max:.0f}".format(
                         **run["ttft_ms"]),
                     "x alone": "{p50:.2f} / {p90:.2f} / {max:.2f}".format(**ratio),
                     "batch tokens": run["batch_tokens"] if run["name"] != "alone" else "",
                     "passes given way": run["passes_yielded"]})
    print(f"machine: {machine()}")
    print_table(rows, list(rows[0]))
    write_json("batch_arrivals", {"args": vars(args), "runs": runs}, args.out_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
