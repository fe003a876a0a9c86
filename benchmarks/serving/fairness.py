"""Experiment 1: fairness of VTC against FCFS with two and three tenants.

Scenarios (the tenants together ask for about twice what the engine serves, so they compete;
through the platform each rate is multiplied by the number of workers):

* ``two``: tenants ``A`` and ``B`` send the same requests, ``B`` at twice ``A``'s rate;
* ``three``: ``A`` sends short requests, ``B`` requests four times longer (prompt and output) at
  the same request rate, and ``C`` short requests at 0.4 times A's rate, switching on and off
  (on for the first and last thirds of the run, off in the middle).

Each scenario runs under FCFS and under VTC, on two targets (``--targets``):

* ``engine``: the engine in-process (the reference backend with a step delay: the question is the
  scheduler's, not the model's);
* ``rest``: the whole platform, through the REST API, Redis's shared queue and ``--workers``
  inference workers (the reference backend, or the real model with ``--backend transformers``
  and ``--threads-per-worker`` torch threads each, as 2 cores cannot host two 2-thread workers).

Every ``--sample-every`` seconds the stats give each tenant's accumulated weighted service
(``per_key`` -> ``weighted_service``: input weight x computed prompt tokens + output weight x
generated tokens, divided by the tenant's weight; summed over the workers through
``/scheduler/stats``) and whether it is backlogged (has requests queued or running anywhere: the
engine's ``in_flight``, or the shared queue's). The max-min difference is taken over the tenants
backlogged since the backlogged set last changed (the interval over which VTC's bound holds,
Sheng et al., OSDI 2024, Theorem 4.3): ``2 x max(w_in x longest prompt, w_out x M)``, with ``M``
the tokens the batch can hold: one engine's active-KV budget, or ``n`` workers' together.

Usage::

    python -m benchmarks.serving.fairness                  # ~3 min: 2 scenarios x 2 policies x 40 s
    python -m benchmarks.serving.fairness --targets engine,rest  # through the platform, 2 workers
    python -m benchmarks.serving.fairness --targets rest --backend transformers --workers 2 \
        --threads-per-worker 1 --step-delay 0      # the real model
    python -m benchmarks.serving.fairness --duration 120   # longer runs
    python -m benchmarks.serving.fairness --duration 4 --out-dir /tmp/fairness   # a quick check
"""

from __future__ import annotations

import argparse
import asyncio
import random
from typing import Any

from benchmarks.harness.cli import (
    HelpFormatter,
    add_out_dir_flag,
    name_list,
    non_negative_float,
    positive_float,
    positive_int,
)
from benchmarks.harness.common import (
    exit_status,
    legend_outside,
    make_engine,
    model_tokenizer,
    print_table,
    reference_tokenizer,
    save_figure,
    warn_if_all_failed,
    write_json,
)
from benchmarks.harness.metrics import records, summarize_by
from benchmarks.harness.servers import Platform, TenantSpec
from benchmarks.harness.targets import EngineTarget, RestTarget, run_load
from benchmarks.harness.workload import (
    PromptMaker,
    RequestSpec,
    merge,
    poisson_arrivals,
    random_requests,
)

W_IN, W_OUT = 1.0, 2.0
# Tenant C's request rate relative to A's in scenario ``three``.
ON_OFF_RATE = 0.4


def build_workload(scenario: str, duration: float, rate: float, seed: int,
                   maker: PromptMaker) -> tuple[list[RequestSpec], int]:
    """The scenario's requests and its longest prompt (tokens)."""
    rng = random.Random(f"{seed}-{scenario}")
    short_in, short_out = (48, 80), (24, 40)
    long_in, long_out = (4 * short_in[0], 4 * short_in[1]), (4 * short_out[0], 4 * short_out[1])
    if scenario == "two":
        parts = [
            random_requests(maker, poisson_arrivals(rate, duration, rng),
                            short_in, short_out, rng, tenant="A"),
            random_requests(maker, poisson_arrivals(2 * rate, duration, rng),
                            short_in, short_out, rng, tenant="B"),
        ]
        return merge(*parts), short_in[1]
    third = duration / 3
    parts = [
        random_requests(maker, poisson_arrivals(rate, duration, rng),
                        short_in, short_out, rng, tenant="A"),
        random_requests(maker, poisson_arrivals(rate, duration, rng),
                        long_in, long_out, rng, tenant="B"),
        # C asks for a little more than its share while on, so its backlog drains when off.
        random_requests(
            maker, poisson_arrivals(ON_OFF_RATE * rate, duration, rng,
                                    windows=[(0, third), (2 * third, duration)]),
            short_in, short_out, rng, tenant="C"),
    ]
    return merge(*parts), long_in[1]


def max_min_difference(samples: list[dict[str, Any]]) -> list[float]:
    """Per sample: max - min of the service gained since the backlogged set last changed, over
    the tenants in that set (0 with fewer than two)."""
    diffs: list[float] = []
    base: dict[str, float] = {}
    current: frozenset[str] = frozenset()
    for s in samples:
        backlogged = frozenset(k for k, v in s["keys"].items() if v["backlogged"])
        if backlogged != current:
            current = backlogged
            base = {k: s["keys"][k]["weighted_service"] for k in backlogged}
        gained = [s["keys"][k]["weighted_service"] - base[k] for k in current]
        diffs.append(max(gained) - min(gained) if len(gained) > 1 else 0.0)
    return diffs


def engine_settings(policy: str, args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig fields of a run (besides the backend)."""
    return {"scheduling_policy": policy, "max_batch_size": args.batch,
            "prefill_chunk_size": 64, "kv_block_size": 16, "kv_num_blocks": 256,
            "active_kv_budget": args.kv_budget, "max_pending": 100_000,
            "vtc_input_weight": W_IN, "vtc_output_weight": W_OUT}


async def run_one(scenario: str, policy: str, target: str,
                  args: argparse.Namespace) -> dict[str, Any]:
    tokenizer = reference_tokenizer() if args.backend == "reference" else model_tokenizer()
    maker = PromptMaker(tokenizer, seed=args.seed)
    # The tenants ask for the same multiple of what the deployment serves: n workers, n x rate.
    rate = args.rate * (args.workers if target == "rest" else 1)
    specs, longest_prompt = build_workload(scenario, args.duration, rate, args.seed, maker)
    samples: list[dict[str, Any]] = []
    name = f"{scenario}/{policy}" if target == "engine" else f"{target}/{scenario}/{policy}"
    if target == "engine":
        engine = make_engine(real_model=args.backend != "reference",
                             step_delay_s=args.step_delay, **engine_settings(policy, args))
        budget = engine.scheduler.active_kv_budget

        def sample(now: float) -> None:
            per_key = engine.stats()["per_key"]
            samples.append({"t": now, "keys": {
                k: {"weighted_service": v["weighted_service"],
                    "backlogged": v["in_flight"] > 0, "pending": v["pending"]}
                for k, v in per_key.items()}})

        async with EngineTarget(engine) as load_target:
            results, _ = await run_load(load_target, specs, desc=name, sample=sample,
                                        sample_every_s=args.sample_every,
                                        stop_at_s=args.duration)
        workers = 1
    else:
        results, budget = await _run_rest(specs, policy, args, name, samples)
        workers = args.workers
    diffs = max_min_difference(samples)
    memory = budget * workers
    bound = 2 * max(W_IN * longest_prompt, W_OUT * memory)
    tenants = sorted({s.tenant for s in specs})
    final = samples[-1]["keys"] if samples else {}
    return {
        "target": target, "workers": workers, "backend": args.backend,
        "scenario": scenario, "policy": policy, "bound": bound, "active_kv_budget": budget,
        "batch_memory": memory, "longest_prompt": longest_prompt,
        "max_difference": max(diffs, default=0.0),
        "final_difference": diffs[-1] if diffs else 0.0,
        "within_bound": max(diffs, default=0.0) <= bound,
        "service": {k: final.get(k, {}).get("weighted_service", 0.0) for k in tenants},
        "sent": {k: sum(s.tenant == k for s in specs) for k in tenants},
        "per_tenant": summarize_by(results, lambda r: r.tenant),
        "samples": samples, "differences": diffs,
        # Requests without a first token by the end count with their wait so far (a lower bound).
        "ttft": [{"tenant": r.tenant, "sent_s": r.sent_s,
                  "ttft_s": r.ttft_s if r.ttft_s is not None else r.ended_s - r.sent_s,
                  "waiting": r.ttft_s is None} for r in results],
        "results": records(results),
        "all_failed": warn_if_all_failed(results, name),
    }


async def _run_rest(specs: list[RequestSpec], policy: str, args: argparse.Namespace, name: str,
                    samples: list[dict[str, Any]]) -> tuple[list, int]:
    """Run ``specs`` through the platform; sample service from ``/scheduler/stats``.

    Returns:
        (the results, one worker's active-KV budget in tokens).
    """
    import httpx

    settings = engine_settings(policy, args)
    env: dict[str, Any] = {name.upper(): value for name, value in settings.items()
                           if name != "max_pending"}
    env.update(BACKEND=args.backend, REFERENCE_STEP_DELAY_S=args.step_delay,
               MAX_QUEUE_SIZE=100_000, MAX_QUEUE_WAIT_S=0)
    if args.threads_per_worker:
        env.update(OMP_NUM_THREADS=args.threads_per_worker,
                   MKL_NUM_THREADS=args.threads_per_worker)
    tenants = sorted({s.tenant for s in specs})
    with Platform([TenantSpec(t) for t in tenants], workers=args.workers, **env) as platform:
        headers = {"Authorization": f"Bearer {platform.keys['operator']}"}
        async with httpx.AsyncClient(base_url=platform.url, headers=headers,
                                     timeout=10) as client:
            budgets = {s.get("active_kv_budget") for s in
                       (await client.get("/scheduler/stats")).json()["workers"].values()}

            async def sample(now: float) -> None:
                stats = (await client.get("/scheduler/stats")).json()
                served = stats["total"].get("per_key") or {}
                queued = stats["queue"]["per_key"]
                # A tenant's fairness key is its slug: the name in lower case.
                samples.append({"t": now, "keys": {
                    k: {"weighted_service": (served.get(k.lower()) or {}).get(
                            "weighted_service") or 0.0,
                        "backlogged": (queued.get(k.lower()) or {}).get("in_flight", 0) > 0}
                    for k in tenants}})

            async with RestTarget(platform.url, platform.keys) as load_target:
                results, _ = await run_load(load_target, specs, desc=name, sample=sample,
                                            sample_every_s=args.sample_every,
                                            stop_at_s=args.duration)
    return results, max(budgets)


def plot(runs: list[dict[str, Any]], scenario: str, out_dir: str | None = None) -> None:
    """One column per policy: accumulated service, the max-min difference against VTC's bound,
    and TTFT by send time; each row's legend to the right of the row."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    mine = [r for r in runs if r["scenario"] == scenario]
    fig, axes = plt.subplots(3, len(mine), figsize=(4.6 * len(mine) + 2.2, 9.5), squeeze=False,
                             sharex=True, layout="constrained")
    colors = {"A": "tab:blue", "B": "tab:orange", "C": "tab:green"}
    last = len(mine) - 1
    for col, run in enumerate(mine):
        t = [s["t"] for s in run["samples"]]
        tenants = sorted(run["service"])
        ax = axes[0][col]
        for k in tenants:
            ax.plot(t, [s["keys"].get(k, {}).get("weighted_service", 0) / 1000
                        for s in run["samples"]], label=f"tenant {k}", color=colors.get(k))
        where = ("in-process" if run.get("target", "engine") == "engine"
                 else f"platform, {run['workers']} workers")
        ax.set_title(f"{run['policy'].upper()} ({where}): weighted service", fontsize=10)
        ax.set_ylabel("service (thousand weighted tokens)")
        if col == last:
            legend_outside(ax)
        ax = axes[1][col]
        bound_k = run["bound"] / 1000
        ax.plot(t, [d / 1000 for d in run["differences"]], color="black",
                label="max - min service of\nthe backlogged tenants")
        ax.axhline(bound_k, color="red", ls="--",
                   label=f"VTC bound {run['bound']:,.0f} = 2 x max(\n"
                         f"  {W_IN:g} x {run['longest_prompt']} (longest prompt),\n"
                         f"  {W_OUT:g} x {run.get('batch_memory', run['active_kv_budget'])}"
                         " (active-KV budget"
                         f"{' of all workers' if run.get('workers', 1) > 1 else ''}))")
        # The bound named on the right-hand spine, where it covers no data.
        right = ax.secondary_yaxis("right")
        right.set_yticks([bound_k], [f"bound\n{run['bound']:,.0f}"], color="red", fontsize=8)
        right.tick_params(colors="red")
        top = max([bound_k, *(d / 1000 for d in run["differences"])])
        ax.set_ylim(0, top * 1.2)
        ax.set_title("Service difference while backlogged", fontsize=10)
        ax.set_ylabel("difference (thousand weighted tokens)")
        if col == last:
            legend_outside(ax, gap=0.14)
        ax = axes[2][col]
        for k in tenants:
            for waiting in (False, True):
                pts = [p for p in run["ttft"] if p["tenant"] == k and p["waiting"] == waiting]
                ax.scatter([p["sent_s"] for p in pts], [p["ttft_s"] for p in pts], s=6,
                           color=colors.get(k), marker="x" if waiting else "o",
                           alpha=0.35 if waiting else 1.0)
        ax.set_title("TTFT by send time", fontsize=10)
        ax.set_ylabel("TTFT (s)")
        ax.set_xlabel("time since the start of the run (s)")
        if col == last:
            handles = [Line2D([], [], ls="", marker="o", ms=4, color=colors.get(k),
                              label=f"tenant {k}") for k in tenants]
            handles.append(Line2D([], [], ls="", marker="x", ms=5, color="gray", alpha=0.6,
                                  label="no token by the end\n(wait so far, a lower bound)"))
            legend_outside(ax, handles=handles)
    fig.suptitle(f"Fairness, scenario '{scenario}'")
    save_figure(fig, f"fairness-{scenario}", out_dir)


SCENARIOS = ("two", "three")
POLICIES = ("fcfs", "vtc")
TARGETS = ("engine", "rest")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parsed and checked arguments (``parser.error`` on a bad value or combination)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=HelpFormatter)
    parser.add_argument("--duration", type=positive_float, default=40,
                        help="seconds per run")
    parser.add_argument("--rate", type=positive_float, default=6.0,
                        help="requests/s of tenant A (B and C relative to it), per worker")
    parser.add_argument("--step-delay", type=non_negative_float, default=0.01,
                        help="seconds per forward pass of the reference backend")
    parser.add_argument("--batch", type=positive_int, default=4, help="MAX_BATCH_SIZE")
    parser.add_argument("--kv-budget", type=int, default=512,
                        help="ACTIVE_KV_BUDGET (tokens; 0: the largest the KV pool holds)")
    parser.add_argument("--sample-every", type=positive_float, default=0.2,
                        help="seconds between samples of the engine's stats (at most --duration)")
    parser.add_argument("--scenarios", type=name_list(SCENARIOS), default=",".join(SCENARIOS),
                        metavar="LIST", help=f"comma-separated, out of {', '.join(SCENARIOS)}")
    parser.add_argument("--policies", type=name_list(POLICIES), default=",".join(POLICIES),
                        metavar="LIST", help=f"comma-separated, out of {', '.join(POLICIES)}")
    parser.add_argument("--seed", type=int, default=1, help="workload seed")
    parser.add_argument("--targets", type=name_list(TARGETS), default="engine", metavar="LIST",
                        help=f"comma-separated, out of {', '.join(TARGETS)}")
    parser.add_argument("--workers", type=positive_int, default=2,
                        help="inference workers of the rest target")
    parser.add_argument("--backend", choices=("reference", "transformers"), default="reference",
                        help="the model: the reference backend, or the real default model")
    parser.add_argument("--threads-per-worker", type=positive_int, default=None,
                        help="torch threads of each worker (OMP_NUM_THREADS; rest target)")
    add_out_dir_flag(parser)
    args = parser.parse_args(argv)
    if args.sample_every > args.duration:
        parser.error(f"--sample-every ({args.sample_every:g} s) is longer than --duration "
                     f"({args.duration:g} s)")
    from pydantic import ValidationError

    from inference.engine.config import EngineConfig

    try:
        EngineConfig(backend="reference", reference_step_delay_s=args.step_delay,
                     **engine_settings(args.policies[0], args))
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "engine settings"
        flag = {"active_kv_budget": "--kv-budget", "max_batch_size": "--batch"}.get(where)
        if flag is None and "ACTIVE_KV_BUDGET" in first["msg"]:
            flag, where = "--kv-budget", "active_kv_budget"
        parser.error(f"{flag + ' (' + where + ')' if flag else where}: {first['msg']}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from benchmarks.harness.common import machine

    before = machine()
    runs = []
    for scenario in args.scenarios:
        for target in args.targets:
            for policy in args.policies:
                runs.append(asyncio.run(run_one(scenario, policy, target, args)))
        plot(runs, scenario, args.out_dir)
    print_table([{"target": f"{r['target']} x{r['workers']}", "scenario": r["scenario"],
                  "policy": r["policy"],
                  "service": ", ".join(f"{k}={v:.0f}" for k, v in r["service"].items()),
                  "max difference": r["max_difference"], "bound": r["bound"],
                  "within": "yes" if r["within_bound"] else "no"} for r in runs],
                ["target", "scenario", "policy", "service", "max difference", "bound", "within"])
    path = write_json("fairness", {"args": vars(args), "machine_before": before, "runs": runs},
                      args.out_dir)
    print(f"wrote {path}")
    return exit_status([f"{r['scenario']}/{r['policy']}" for r in runs if r["all_failed"]])


if __name__ == "__main__":
    raise SystemExit(main())
