"""Experiment 7: large prompts beside running streams: the web tier stays responsive.

A platform (daphne, one inference worker on the reference backend, Celery; started here) serves
``--streams`` streaming completions of one tenant (a closed loop: each stream sends its next
request when the last one ends, ``--stream-tokens`` tokens each at ``--step-delay-ms`` per decode
step) while a prober sends ``GET /healthz`` every ``--probe-every-ms`` ms. Phases of
``--duration`` seconds each:

* a warm-up of ``--warmup`` seconds (streams, prober, and 1 KB chat prompts), not reported;
* ``baseline``: the streams and the prober alone;
* one phase per ``--prompt-bytes`` size: another tenant also sends chat completions whose one
  message has that many bytes, ``--rate`` per second (evenly spaced). The defaults are a 2.4 MB
  prompt (under the 2.5 MB body limit, far over the context: refused from its size in bytes) and a
  400 KB one (under that bound: tokenized, in a counting process, then refused).

Reported per phase: ``/healthz`` latency p50, p99 and max (target: under 200 ms), the streams'
largest gap between two tokens beside the baseline's (target: within 2x) and their ITL p99, and
the large requests' answers and latencies. The web tier must do the large prompts' work off its
event loop for both targets to hold.

Usage::

    python -m benchmarks.serving.large_prompts                     # about 1.5 min on 2 cores
    python -m benchmarks.serving.large_prompts --prompt-bytes 2400000 --rate 2 --duration 30
    python -m benchmarks.serving.large_prompts --duration 3 --prompt-bytes 100000 --out-dir /tmp/lp
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections import Counter
from typing import Any

from benchmarks.harness.cli import HelpFormatter, add_out_dir_flag, positive_float, positive_int
from benchmarks.harness.common import exit_status, machine, print_table, write_json
from benchmarks.harness.metrics import RequestResult, describe_ms, percentile
from benchmarks.harness.servers import Platform, TenantSpec
from benchmarks.harness.targets import RestTarget
from benchmarks.harness.workload import RequestSpec

MODEL = "SmolLM2-135M-Instruct"
STREAM_PROMPT = "Write about queues, streams and the people who wait in them."
# Targets: /healthz p99 under this (ms); the streams' largest gap within this factor of the
# baseline's.
HEALTHZ_TARGET_MS = 200.0
GAP_TARGET_RATIO = 2.0


def chat_body(n_bytes: int) -> bytes:
    """A chat completion request whose one message is ``n_bytes`` bytes of words (JSON)."""
    phrase = "the quick brown fox jumps over a lazy dog "
    words = (phrase * (n_bytes // len(phrase) + 1))[:n_bytes]
    return json.dumps({"model": MODEL, "max_tokens": 16,
                       "messages": [{"role": "user", "content": words}]}).encode()


async def probe(client: Any, url: str, every_s: float, until: float,
                latencies_s: list[float]) -> None:
    """``GET /healthz`` every ``every_s`` seconds until ``until`` (perf_counter); latencies."""
    while time.perf_counter() < until:
        start = time.perf_counter()
        try:
            response = await client.get(f"{url}/healthz")
            response.raise_for_status()
        except Exception:  # noqa: BLE001 - a failed probe counts as the time it took
            pass
        latencies_s.append(time.perf_counter() - start)
        await asyncio.sleep(max(0.0, every_s - (time.perf_counter() - start)))


async def stream_loop(target: RestTarget, spec: RequestSpec, until: float, t0: float,
                      results: list[RequestResult]) -> None:
    """One closed-loop stream: a new request as soon as the last one ends, until ``until``."""

    def clock() -> float:
        return time.perf_counter() - t0

    while time.perf_counter() < until:
        result = RequestResult(spec.tenant, spec.tag, "error", 0, clock(),
                               max_tokens=spec.max_tokens)
        results.append(result)
        await target.send(spec, clock, result)


async def large_sender(client: Any, url: str, key: str, body: bytes, rate: float, until: float,
                       answers: list[dict[str, Any]]) -> None:
    """Send ``body`` to ``/v1/chat/completions`` ``rate`` times a second until ``until``."""

    async def one() -> None:
        start = time.perf_counter()
        answer: dict[str, Any] = {"status": 0, "code": ""}
        try:
            response = await client.post(f"{url}/v1/chat/completions", content=body, headers={
                "Authorization": f"Bearer {key}", "Content-Type": "application/json"})
            answer["status"] = response.status_code
            if response.status_code != 200:
                answer["code"] = (response.json().get("error") or {}).get("code") or ""
        except Exception as exc:  # noqa: BLE001 - counted by kind
            answer["code"] = type(exc).__name__
        answer["latency_s"] = time.perf_counter() - start
        answers.append(answer)

    tasks = []
    next_at = time.perf_counter()
    while next_at < until:
        await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
        tasks.append(asyncio.create_task(one()))
        next_at += 1 / rate
    await asyncio.gather(*tasks)


async def run_phase(platform: Platform, args: argparse.Namespace, prompt_bytes: int | None,
                    duration_s: float | None = None) -> dict[str, Any]:
    """One phase (``--duration`` seconds, or ``duration_s``): the streams and the prober, plus
    chat prompts of ``prompt_bytes`` bytes when given."""
    import httpx

    t0 = time.perf_counter()
    until = t0 + (duration_s or args.duration)
    latencies: list[float] = []
    streams: list[RequestResult] = []
    answers: list[dict[str, Any]] = []
    spec = RequestSpec(STREAM_PROMPT, args.stream_tokens, tenant="streams", tag="stream")
    limits = httpx.Limits(max_connections=None)
    async with RestTarget(platform.url, platform.keys) as target, \
            httpx.AsyncClient(timeout=httpx.Timeout(120), limits=limits) as client:
        jobs = [probe(client, platform.url, args.probe_every_ms / 1000, until, latencies)]
        jobs += [stream_loop(target, spec, until, t0, streams) for _ in range(args.streams)]
        if prompt_bytes:
            jobs.append(large_sender(client, platform.url, platform.keys["big"],
                                     chat_body(prompt_bytes), args.rate, until, answers))
        await asyncio.gather(*jobs)
    return summarize_phase("baseline" if not prompt_bytes else f"{prompt_bytes:,} B",
                           latencies, streams, answers, prompt_bytes)


def summarize_phase(name: str, healthz_s: list[float], streams: list[RequestResult],
                    answers: list[dict[str, Any]], prompt_bytes: int | None) -> dict[str, Any]:
    """A phase's figures: /healthz latency, the streams' gaps, the large requests' answers."""
    gaps = [gap for r in streams for gap in r.itls_s]
    return {
        "phase": name,
        "prompt_bytes": prompt_bytes or 0,
        "healthz_ms": {**describe_ms(healthz_s), "max": max(healthz_s, default=0) * 1000,
                       "count": len(healthz_s)},
        "streams": {"requests": len(streams),
                    "completed": sum(r.status == "ok" for r in streams),
                    "tokens": sum(len(r.chunk_times_s) for r in streams),
                    "max_gap_ms": max(gaps, default=0) * 1000,
                    "itl_p99_ms": percentile([g * 1000 for g in gaps], 99)},
        "large": {"sent": len(answers),
                  "answers": dict(Counter(f"{a['status']} {a['code']}".strip()
                                          for a in answers)),
                  "latency_ms": describe_ms([a["latency_s"] for a in answers])},
    }


def verdicts(phases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each loaded phase against the targets: /healthz p99 and the largest gap's ratio."""
    baseline = phases[0]["streams"]["max_gap_ms"]
    out = []
    for phase in phases:
        ratio = phase["streams"]["max_gap_ms"] / baseline if baseline else float("nan")
        out.append({"phase": phase["phase"], "gap_ratio": ratio,
                    "healthz_ok": phase["healthz_ms"]["p99"] < HEALTHZ_TARGET_MS,
                    "gap_ok": ratio <= GAP_TARGET_RATIO})
    return out


def table_rows(phases: list[dict[str, Any]], checks: list[dict[str, Any]]) -> list[dict]:
    rows = []
    for phase, check in zip(phases, checks, strict=True):
        h, s, large = phase["healthz_ms"], phase["streams"], phase["large"]
        rows.append({"phase": phase["phase"], "healthz_p50_ms": h["median"],
                     "healthz_p99_ms": h["p99"], "healthz_max_ms": h["max"],
                     "max_gap_ms": s["max_gap_ms"], "x_baseline": check["gap_ratio"],
                     "itl_p99_ms": s["itl_p99_ms"], "stream_tokens": s["tokens"],
                     "large_sent": large["sent"],
                     "large_answers": ", ".join(f"{k}: {v}"
                                                for k, v in large["answers"].items()) or "-",
                     "large_p50_ms": large["latency_ms"]["median"]})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=HelpFormatter)
    parser.add_argument("--prompt-bytes", type=positive_int, nargs="+",
                        default=[2_400_000, 400_000],
                        help="size of the large chat prompts, one loaded phase per size")
    parser.add_argument("--rate", type=positive_float, default=0.5,
                        help="large prompts sent per second in a loaded phase")
    parser.add_argument("--duration", type=positive_float, default=20.0,
                        help="seconds per phase")
    parser.add_argument("--streams", type=positive_int, default=4,
                        help="streaming completions kept running")
    parser.add_argument("--stream-tokens", type=positive_int, default=100,
                        help="tokens per streamed answer")
    parser.add_argument("--step-delay-ms", type=positive_float, default=20.0,
                        help="the reference backend's time per forward pass (ms)")
    parser.add_argument("--warmup", type=positive_float, default=3.0,
                        help="seconds of warm-up before the baseline (not reported)")
    parser.add_argument("--probe-every-ms", type=positive_float, default=50.0,
                        help="interval between /healthz probes (ms)")
    add_out_dir_flag(parser, "the JSON file")
    args = parser.parse_args(argv)
    before = machine()
    tenants = [TenantSpec("streams"), TenantSpec("big")]
    phases = []
    with Platform(tenants, BACKEND="reference",
                  REFERENCE_STEP_DELAY_S=args.step_delay_ms / 1000) as platform:
        print(f"warm-up ({args.warmup:g} s) ...", flush=True)
        asyncio.run(run_phase(platform, args, 1000, args.warmup))
        for size in [None, *args.prompt_bytes]:
            print(f"phase {'baseline' if size is None else f'{size:,} B'} "
                  f"({args.duration:g} s) ...", flush=True)
            phases.append(asyncio.run(run_phase(platform, args, size)))
    checks = verdicts(phases)
    print_table(table_rows(phases, checks), list(table_rows(phases, checks)[0]))
    for check in checks[1:]:
        print(f"{check['phase']}: /healthz p99 under {HEALTHZ_TARGET_MS:.0f} ms: "
              f"{'yes' if check['healthz_ok'] else 'NO'}; largest gap within "
              f"{GAP_TARGET_RATIO:g}x the baseline's: {'yes' if check['gap_ok'] else 'NO'}")
    path = write_json("large_prompts", {"args": vars(args), "machine_before": before,
                                        "phases": phases, "checks": checks}, args.out_dir)
    print(f"wrote {path}")
    return exit_status([p["phase"] for p in phases if not p["streams"]["completed"]])


if __name__ == "__main__":
    raise SystemExit(main())
