"""One chaos run from start to end: the private Redis, the platform on it, the load, the Batch API
jobs and the faults (with a clock on the processes' logs), the batches' ends, the settling, the
checks and the report."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import redis

from benchmarks.harness.redis_server import PrivateRedis
from benchmarks.harness.servers import Platform, TenantSpec
from benchmarks.serving.chaos.batches import (
    BatchClient,
    BatchJob,
    make_jobs,
    read_batch_state,
    wait_batches,
)
from benchmarks.serving.chaos.checks import attach_log_lines, check
from benchmarks.serving.chaos.deaths import DEATH_LINE
from benchmarks.serving.chaos.expected import expected_outputs
from benchmarks.serving.chaos.faults import Chaos
from benchmarks.serving.chaos.load import Result, Steer, classify, drive_load
from benchmarks.serving.chaos.logclock import LogClock
from benchmarks.serving.chaos.report import summarize
from benchmarks.serving.chaos.settings import (
    BATCH_TENANT,
    LIMITED_CONCURRENCY,
    LIMITED_TENANT,
    PLATFORM_ENV,
    PROMPTS,
    TENANTS,
    Options,
)
from benchmarks.serving.chaos.state import (
    read_leaks,
    read_streams,
    read_usage,
    settle,
    wait_all_up,
)
from benchmarks.serving.chaos.timeline import Timeline


def run(options: Options) -> dict[str, Any]:
    """One chaos run; returns the report (``report["verdict"]`` is PASS or FAIL)."""
    started = time.monotonic()
    log_dir = Path(options.log_dir or tempfile.mkdtemp(prefix=f"chaos-{options.seed}-logs-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    answers = expected_outputs(PROMPTS, options.max_tokens[1])
    data_dir = Path(tempfile.mkdtemp(prefix="chaos-redis-"))
    private_redis = PrivateRedis(data_dir, log_dir / "redis.log", options.redis_persistence)
    private_redis.start()
    tenants = [TenantSpec(t, max_concurrent=LIMITED_CONCURRENCY if t == LIMITED_TENANT else 0)
               for t in (*TENANTS, BATCH_TENANT)]
    files_dir = Path(tempfile.mkdtemp(prefix="chaos-files-"))
    env = {**PLATFORM_ENV, "REFERENCE_STEP_DELAY_S": options.step_delay_s,
           "FILES_ROOT": str(files_dir)}
    timeline = Timeline()
    report: dict[str, Any] = {"options": dataclasses.asdict(options), "log_dir": str(log_dir)}
    try:
        with Platform(tenants, workers=options.workers, redis_url=private_redis.url, beat=True,
                      **env) as platform:
            print(f"platform up at {platform.url} on {private_redis.url} "
                  f"(logs: {log_dir}, start-up {time.monotonic() - started:.0f} s)", flush=True)
            try:
                report.update(_run_on(platform, private_redis, options, timeline, answers,
                                      log_dir))
            finally:
                for path in Path(platform.stack.log_dir).glob("*.log"):
                    shutil.copy(path, log_dir / path.name)
                wait_all_up(platform, private_redis, timeout_s=20)  # for a clean stop
    except Exception:  # noqa: BLE001 - a harness failure is reported, never a PASS
        timeline.errors.append(traceback.format_exc())
        print(f"harness error:\n{traceback.format_exc()}", file=sys.stderr)
    finally:
        if private_redis.alive():
            private_redis.kill(signal.SIGTERM)
        shutil.rmtree(data_dir, ignore_errors=True)
        shutil.rmtree(files_dir, ignore_errors=True)
    report["harness_errors"] = timeline.errors
    if timeline.errors:
        report["verdict"] = "FAIL"
    report["wall_s"] = round(time.monotonic() - started, 1)
    if options.out:
        Path(options.out).write_text(json.dumps(report, indent=1, default=str))
    return report


def _run_on(platform: Platform, private_redis: PrivateRedis, options: Options,
            timeline: Timeline, answers: list[tuple[str, int | None]],
            log_dir: Path) -> dict[str, Any]:
    """The load, the batch jobs and the chaos on a started platform, the batches' ends, the
    settling and the checks."""
    timeline.t0, timeline.t0_unix = time.monotonic(), time.time()
    results: list[Result] = []
    steer = Steer()
    log_clock = LogClock(Path(platform.stack.log_dir), timeline.now)
    log_clock.start()
    chaos = Chaos(platform, private_redis, options, timeline, options.duration_s, results,
                  steer)
    jobs: list[BatchJob] = make_jobs(options)
    batch_client = BatchClient(platform.url, platform.keys[BATCH_TENANT], jobs, timeline)
    chaos.start()
    batch_client.start()
    try:
        asyncio.run(drive_load(platform.url, platform.keys, options, options.duration_s,
                               timeline.now, results, steer))
    finally:
        chaos.stop()
        batch_client.stop()
        chaos.join(120)
        batch_client.join(180)
    load_s = timeline.now()
    for result in results:
        classify(result, timeline)
    all_up = wait_all_up(platform, private_redis)
    # Let a killed worker's heartbeat lapse, so that the live ones reclaim what it held.
    time.sleep(2 * PLATFORM_ENV["WORKER_HEARTBEAT_TTL_S"])
    batches_ended = wait_batches(platform.url, platform.keys[BATCH_TENANT], jobs,
                                 options.batch_wait_s, timeline)
    client = redis.Redis.from_url(private_redis.url)
    settled = settle(platform, client, options.settle_s)
    leaks, leak_details = read_leaks(platform, client)
    streams = read_streams(client, platform.stack.prefix)
    records = read_usage(platform)
    batch_state = read_batch_state(platform, client, BATCH_TENANT, jobs) if jobs else None
    log_clock.stop()
    log_clock.join(5)
    log_clock.sample()
    findings, info = check(results, streams, records, leaks, leak_details, answers, timeline,
                           options, timeline.now(), death_lines=log_clock.lines(DEATH_LINE),
                           batch_jobs=jobs, batch_state=batch_state)
    for path in Path(platform.stack.log_dir).glob("*.log"):
        shutil.copy(path, log_dir / path.name)
    attach_log_lines(findings, log_dir)
    return summarize(results, timeline, findings, info, settled, all_up, load_s, leak_details,
                     batches={"ended": batches_ended, "jobs": [_job_brief(j, timeline)
                                                               for j in jobs]})


def _job_brief(job: BatchJob, timeline: Timeline) -> dict[str, Any]:
    """A batch job for the report, with the faults from its creation to its end."""
    end = job.ended_s + 1.0 if job.ended_s is not None else timeline.now()  # whole seconds
    during = (timeline.kills_during(job.created_s, end)
              if job.created_s is not None else [])
    return {**job.brief(), "faults_during": during}
