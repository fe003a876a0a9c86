"""Batch work beside interactive traffic: what a running batch costs interactive streams, and
how fast a batch goes on an idle platform.

Runs, in this order, each alone on the machine (the platform's processes are stopped between
runs; the real model on the default backend):

* ``interactive``: tenant ``chat`` streams completions (Poisson at ``--rate`` for
  ``--duration`` s, greedy, ``ignore_eos``) through the REST API;
* ``interactive+batch``: the same arrivals while tenant ``bulk``'s batch of ``--lines`` lines
  (``/v1/completions``, the Batch API, stepped by Celery beat) runs; the batch is cancelled once
  the interactive requests are done;
* ``batch``: the batch alone on the idle platform, until it completes;
* ``offline``: the same lines through the engine in this process (``LLMEngine``, the same
  batch size, every line submitted at once): the throughput the batch is measured against.

The two interactive runs alternate ``--rounds`` times (3 by default; each round its own
arrivals, the same in both of its runs), and each one's figures pool its rounds' requests: a
p99 of one 60-second run is its few largest samples (TTFT: the largest of 50), and the
machine's own speed drifts over minutes, so one pair of runs moves the ratio by more than its
bound; each round's p99s are printed beside. The ``batch`` and ``offline`` runs alternate
``--throughput-rounds`` times (2 by default) for the same reason: one offline run moved by 5 %
from one run to the next on the same machine, more than the ratio's margin; each pools its
rounds' tokens and seconds.

The verdict (printed, not asserted): interactive TTFT p99 and ITL p99 with the batch within
15 % of those without it, and the batch's output tokens/s on the idle platform (from its
``in_progress_at`` to its ``completed_at``, read to the microsecond from the platform's database:
the API's whole seconds would move a 70 s batch's figure by up to 1.4 %) at least 0.9x the
offline engine's. The client reads the batch every ``--poll-s`` seconds while it runs (5 by
default, as a script waiting for a job would; each read costs the web process about 7 ms of CPU
on 2 cores, which the engine loses). Beside them, for
each run: the CPU seconds each platform process spent (psutil), the engine's ticks, the tokens a
tick generated and its mean wall time, and the share of CPU time the hypervisor stole
(``/proc/stat``), which on a shared virtual machine moves every figure.

Usage::

    python -m benchmarks.serving.batch_impact                     # ~25 min
    python -m benchmarks.serving.batch_impact --lines 200 --duration 20 --rounds 1 --out-dir /tmp/bi
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import random
import time
from contextlib import closing
from typing import Any

import httpx

from benchmarks.harness.cli import HelpFormatter, add_out_dir_flag, name_list
from benchmarks.harness.common import (
    cpu_counters,
    cpu_seconds,
    machine,
    pass_counts,
    pass_figures,
    print_table,
    redis_server_pid,
    reference_tokenizer,
    steal_share,
    write_json,
)
from benchmarks.harness.metrics import summarize
from benchmarks.harness.servers import Platform, TenantSpec
from benchmarks.harness.targets import RestTarget, run_load
from benchmarks.harness.workload import PromptMaker, poisson_arrivals, random_requests
from benchmarks.serving.batch_rounds import pooled, pooled_throughput

RUNS = ("interactive", "interactive+batch", "batch", "offline")
INTERACTIVE_RUNS = ("interactive", "interactive+batch")
MODEL = "SmolLM2-135M-Instruct"
INPUT_LEN, OUTPUT_LEN = (32, 96), (32, 64)
# The verdict's bounds.
INTERACTIVE_SLACK = 0.15
BATCH_VS_OFFLINE = 0.9


def batch_lines(args: argparse.Namespace) -> list[dict[str, Any]]:
    rng = random.Random(args.seed + 1)
    maker = PromptMaker(reference_tokenizer(), seed=args.seed + 1)
    return [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
             "body": {"model": MODEL, "prompt": maker.make(args.line_input, rng),
                      "max_tokens": args.line_output, "temperature": 0, "ignore_eos": True}}
            for i in range(args.lines)]


def interactive_specs(args: argparse.Namespace, round_: int = 0) -> list:
    """The interactive arrivals of round ``round_`` (the same in both runs of a round)."""
    seed = args.seed + 1000 * round_
    rng = random.Random(seed)
    maker = PromptMaker(reference_tokenizer(), seed=seed)
    return random_requests(maker, poisson_arrivals(args.rate, args.duration, rng), INPUT_LEN,
                           OUTPUT_LEN, rng, tenant="chat")


def platform_env(args: argparse.Namespace, files_root: str) -> dict[str, Any]:
    # The real model (the harness's stack defaults to the model-free reference backend).
    env = {"BACKEND": "transformers", "MAX_BATCH_SIZE": args.batch, "FILES_ROOT": files_root,
           "BATCH_LINES_IN_FLIGHT": args.in_flight}
    if args.batch_yield_s is not None:
        env["BATCH_YIELD_S"] = args.batch_yield_s
    return env


async def start_batch(url: str, key: str, lines: list[dict[str, Any]]) -> tuple[Any, Any]:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=2)
    data = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    made = await client.files.create(file=("lines.jsonl", io.BytesIO(data)), purpose="batch")
    batch = await client.batches.create(input_file_id=made.id, endpoint="/v1/completions",
                                        completion_window="24h")
    return client, batch


async def platform_run(name: str, args: argparse.Namespace, tmp: str,
                       round_: int = 0) -> dict[str, Any]:
    with_chat, with_batch = name != "batch", name != "interactive"
    tenants = [TenantSpec("chat", "standard"), TenantSpec("bulk", "standard")]
    with Platform(tenants, beat=True,
                  **platform_env(args, f"{tmp}/{name}-{round_}-files")) as platform:
        out: dict[str, Any] = {"name": name}
        processes = {n: p.pid for n, p in platform.stack.processes.items()}
        redis_pid = redis_server_pid()
        if redis_pid is not None:
            processes["redis"] = redis_pid
        before = cpu_seconds(processes)
        passes_before = pass_counts(engine_totals(platform))
        counters = cpu_counters()
        started = time.monotonic()
        client = batch = None
        if with_batch:
            client, batch = await start_batch(platform.url, platform.keys["bulk"],
                                              batch_lines(args))
        if with_chat:
            async with RestTarget(platform.url, platform.keys, model=MODEL) as target:
                results, duration = await run_load(target, interactive_specs(args, round_),
                                                   desc=f"{name} (round {round_ + 1})")
            out["interactive"] = summarize(results, duration)
            out["_results"], out["_duration"] = results, duration
            # When the slowest first tokens came (s into the run, ms): at the batch's start
            # (its validation), or anywhere.
            out["slowest_ttft"] = sorted(
                ((round(r.sent_s, 1), round(1000 * r.ttft_s)) for r in results
                 if r.ttft_s is not None), key=lambda sent_ttft: -sent_ttft[1])[:3]
        if client is not None and batch is not None:
            if with_chat:  # the interactive window is over: what the batch did meanwhile
                shown = await client.batches.retrieve(batch.id)
                out["batch_lines_done_meanwhile"] = shown.request_counts.completed
                out["batch_status_after"] = shown.status
                if shown.status in ("validating", "in_progress"):
                    await client.batches.cancel(batch.id)
            else:
                deadline = time.monotonic() + args.batch_timeout
                while time.monotonic() < deadline:
                    shown = await client.batches.retrieve(batch.id)
                    if shown.status in ("completed", "failed", "expired", "cancelled"):
                        break
                    await asyncio.sleep(args.poll_s)
                out["batch"] = {"status": shown.status,
                                "request_counts": shown.request_counts.model_dump(),
                                "seconds": batch_seconds(platform, batch.id),
                                "output_tokens": await output_tokens(client, shown)}
                seconds = out["batch"]["seconds"]
                out["batch"]["tokens_per_s"] = (out["batch"]["output_tokens"] / seconds
                                                if seconds > 0 else None)
            await client.close()
        # CPU seconds each process spent over the run, beside its wall time.
        after = cpu_seconds(processes)
        out["wall_s"] = round(time.monotonic() - started, 1)
        out["passes"] = pass_figures(passes_before, pass_counts(engine_totals(platform)),
                                     out["wall_s"])
        out["cpu_s"] = {k: round(after[k] - before[k], 2) for k in processes}
        out["steal"] = steal_share(counters, cpu_counters())
    return out


def batch_seconds(platform: Platform, batch_id: str) -> float:
    """From the batch's ``in_progress_at`` to its ``completed_at`` (s), to the microsecond the
    platform's database holds (the API gives whole seconds: up to 1 s off either way)."""
    import sqlite3
    from datetime import datetime

    with closing(sqlite3.connect(f"file:{platform.dir / 'db.sqlite3'}?mode=ro", uri=True)) as db:
        started, ended = db.execute("SELECT in_progress_at, completed_at FROM api_batch "
                                    "WHERE id = ?", (batch_id,)).fetchone()
    if started is None or ended is None:
        return 0.0
    return (datetime.fromisoformat(ended) - datetime.fromisoformat(started)).total_seconds()


def engine_totals(platform: Platform) -> dict[str, Any]:
    """The workers' summed stats (``/scheduler/stats``), asked up to 3 times (a web tier busy
    with the load may answer late); empty if it never answered."""
    for _ in range(3):
        try:
            return platform.stats()["total"]
        except httpx.HTTPError:
            time.sleep(1.0)
    return {}


async def output_tokens(client: Any, batch: Any) -> int:
    if not batch.output_file_id:
        return 0
    content = (await client.files.content(batch.output_file_id)).content
    return sum(json.loads(raw)["response"]["body"]["usage"]["completion_tokens"]
               for raw in content.splitlines() if raw.strip())


def offline_run(args: argparse.Namespace) -> dict[str, Any]:
    """The same lines through an in-process engine of the same batch size."""
    from inference.engine.llm_engine import LLMEngine
    from inference.engine.request import FinalEvent, SamplingParams
    from inference.worker.settings import WorkerSettings

    lines = batch_lines(args)
    # The worker's own engine configuration (its settings, dtype and cost model included) as
    # the platform runs read it, with room for every line at once.
    worker = WorkerSettings(**{k.lower(): v for k, v in platform_env(args, "").items()
                               if k.lower() in WorkerSettings.model_fields})
    config = worker.engine_config().model_copy(update={"max_pending": len(lines) + 1})
    if not config.model_path:  # the default model, prepared as the worker prepares it
        from concurrent.futures import ThreadPoolExecutor

        from inference.engine.model_store import prepare_default_model

        with ThreadPoolExecutor(1) as once:
            path = once.submit(prepare_default_model, worker.model_cache_dir).result()
        config = config.model_copy(update={"model_path": str(path)})
    engine = LLMEngine(config)
    # Warm up (the model's first passes, the kernels' build) before the clock starts, as the
    # platform's worker is warm when the batch arrives.
    engine.submit(prompt=lines[0]["body"]["prompt"], request_id="warm-up",
                  sampling=SamplingParams(max_tokens=4, ignore_eos=True))
    while not any(isinstance(e, FinalEvent) for e in engine.step()):
        pass
    passes_before = pass_counts(engine.stats())
    counters = cpu_counters()
    started = time.perf_counter()
    for line in lines:
        body = line["body"]
        engine.submit(prompt=body["prompt"], request_id=line["custom_id"],
                      sampling=SamplingParams(max_tokens=body["max_tokens"], ignore_eos=True))
    tokens = ended = 0
    while ended < len(lines):
        for event in engine.step():
            if isinstance(event, FinalEvent):
                ended += 1
                tokens += event.usage.completion_tokens
    seconds = time.perf_counter() - started
    stats = engine.stats()
    passes = pass_figures(passes_before, pass_counts(stats), seconds)
    engine.shutdown()
    return {"name": "offline", "batch": {"output_tokens": tokens, "seconds": seconds,
                                         "tokens_per_s": tokens / seconds},
            "passes": passes, "steal": steal_share(counters, cpu_counters()),
            "engine": {"dtype": stats.get("dtype"), "prefill_mode": stats.get("prefill_mode"),
                       "max_batch_size": config.max_batch_size}}


def verdict(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    alone, beside = runs.get("interactive"), runs.get("interactive+batch")
    if alone and beside:
        for figure in ("ttft_ms", "itl_ms"):
            base = alone["interactive"][figure].get("p99")
            got = beside["interactive"][figure].get("p99")
            if base and got is not None:
                out[f"{figure}_p99_ratio"] = got / base
                out[f"{figure}_within"] = got <= base * (1 + INTERACTIVE_SLACK)
    batch, offline = runs.get("batch"), runs.get("offline")
    if batch and offline and batch["batch"].get("tokens_per_s"):
        ratio = batch["batch"]["tokens_per_s"] / offline["batch"]["tokens_per_s"]
        out["batch_vs_offline"] = ratio
        out["batch_vs_offline_pass"] = ratio >= BATCH_VS_OFFLINE
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--runs", type=name_list(RUNS), default=list(RUNS))
    parser.add_argument("--duration", type=float, default=60.0,
                        help="seconds of interactive arrivals")
    parser.add_argument("--rate", type=float, default=1.0, help="interactive requests/s")
    parser.add_argument("--lines", type=int, default=2000, help="lines in the batch")
    parser.add_argument("--line-input", type=int, default=48, help="prompt tokens per line")
    parser.add_argument("--line-output", type=int, default=16, help="tokens each line makes")
    parser.add_argument("--batch", type=int, default=16, help="the worker's MAX_BATCH_SIZE")
    parser.add_argument("--in-flight", type=int, default=64, help="BATCH_LINES_IN_FLIGHT")
    parser.add_argument("--batch-yield-s", type=float, default=None,
                        help="the worker's BATCH_YIELD_S (default: the setting's default)")
    parser.add_argument("--batch-timeout", type=float, default=1800.0)
    parser.add_argument("--poll-s", type=float, default=5.0,
                        help="seconds between the client's reads of the batch while it runs "
                             "(each read is a request the web process serves beside the batch)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of the two interactive runs, alternating (their figures "
                             "pool every round's requests; each round's p99 is kept beside)")
    parser.add_argument("--throughput-rounds", type=int, default=2,
                        help="rounds of the batch run and the offline run, alternating (the "
                             "machine's speed drifts by several %% over minutes; each figure "
                             "pools its rounds' tokens and seconds, each round's kept beside)")
    parser.add_argument("--seed", type=int, default=0)
    add_out_dir_flag(parser)
    args = parser.parse_args(argv)
    import tempfile

    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="batch-impact-") as tmp:
        rounds: dict[str, list[dict[str, Any]]] = {}
        for round_ in range(args.rounds):  # the two interactive runs alternate, round by round
            for name in (n for n in args.runs if n in INTERACTIVE_RUNS):
                rounds.setdefault(name, []).append(
                    asyncio.run(platform_run(name, args, tmp, round_)))
        for round_ in range(args.throughput_rounds):  # batch and offline alternate too
            for name in (n for n in args.runs if n not in INTERACTIVE_RUNS):
                rounds.setdefault(name, []).append(
                    offline_run(args) if name == "offline"
                    else asyncio.run(platform_run(name, args, tmp, round_)))
        for name in args.runs:
            if name in rounds:
                runs[name] = (pooled(rounds[name]) if name in INTERACTIVE_RUNS
                              else pooled_throughput(rounds[name]))
    rows = []
    for name, run in runs.items():
        chat = run.get("interactive") or {}
        batch = run.get("batch") or {}
        rows.append({"run": name, "TTFT p99 ms": (chat.get("ttft_ms") or {}).get("p99", ""),
                     "ITL p99 ms": (chat.get("itl_ms") or {}).get("p99", ""),
                     "batch lines meanwhile": run.get("batch_lines_done_meanwhile", ""),
                     "batch tok/s": batch.get("tokens_per_s") or ""})
    print(f"machine: {machine()}")
    print_table(rows, ["run", "TTFT p99 ms", "ITL p99 ms", "batch lines meanwhile",
                       "batch tok/s"])
    for name, run in runs.items():
        for i, one in enumerate(run.get("rounds") or []):
            lines = one["batch_lines_done_meanwhile"]
            print(f"{name}, round {i + 1}: TTFT p99 {one['ttft_p99_ms']:.0f} ms, ITL p50 "
                  f"{one['itl_p50_ms']:.1f} / p99 {one['itl_p99_ms']:.1f} ms"
                  + (f", batch lines meanwhile {lines}" if lines is not None else "")
                  + f"; slowest TTFT (s into the run, ms): {one['slowest_ttft']}")
    for name, run in runs.items():
        if run.get("rounds_tokens_per_s"):
            print(f"{name}: tokens/s by round: "
                  + ", ".join(f"{t:.1f}" for t in run["rounds_tokens_per_s"] if t))
    for name, run in runs.items():
        if run.get("cpu_s"):
            shares = ", ".join(f"{k} {v:.1f}" for k, v in run["cpu_s"].items())
            print(f"{name}: CPU s over {run['wall_s']} s of wall time: {shares}")
        if run.get("passes"):
            print(f"{name}: engine ticks: {json.dumps(run['passes'])}; CPU time stolen by the "
                  f"hypervisor: {run.get('steal')}")
    judged = verdict(runs)
    print("verdict:", json.dumps(judged, indent=1))
    write_json("batch_impact", {"args": vars(args), "runs": runs, "verdict": judged},
               args.out_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
