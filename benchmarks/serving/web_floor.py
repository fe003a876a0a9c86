"""What daphne itself costs per SSE write: the floor under the web tier's CPU per streamed token.

The web tier's target (0.1 ms of CPU per streamed token for daphne, Redis and Celery together at
16 streams, :mod:`benchmarks.serving.overhead`) is per token; a worker's event hold sends two
tokens a write, so the target is 0.2 ms a write. This measures what a web process on daphne costs
per write before any of the platform's work, side by side in one invocation:

* ``asgi``: a bare ASGI application streaming a fixed SSE chunk (:mod:`.web_floor_app`): daphne's
  and Twisted's write path, the event loop's timer and wake-up;
* ``django``: the same stream as Django's ``StreamingHttpResponse`` of an async generator (no
  middleware, no database): Django's streaming on top;

each on the ``asyncio`` and ``uvloop`` event loops (``--loops``; the web process's
``WEB_EVENT_LOOP``). ``--streams`` clients (httpx, in this process) each read one stream of
``--writes`` chunks written ``--gap-ms`` apart. Reported: daphne's CPU time (psutil, user +
system) per write, in microseconds, and per token at two tokens a write (ms), beside the
target's 0.2 ms a write.

Usage::

    python -m benchmarks.serving.web_floor                  # about 2 min (4 runs of 26 s)
    python -m benchmarks.serving.web_floor --writes 64 --loops uvloop --apps asgi   # a quick one
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from typing import Any

import httpx
import psutil

from benchmarks.harness.cli import HelpFormatter, add_out_dir_flag, name_list, positive_int
from benchmarks.harness.common import cpu_info, machine, print_table, write_json
from benchmarks.harness.stack import REPO, free_port

APPS = ("asgi", "django")
LOOPS = ("asyncio", "uvloop")
# The web tier's target per write: 0.1 ms a token, two tokens a write (ms).
TARGET_MS_PER_WRITE = 0.2
# daphne as `daphne` runs it, on the event loop asked for (set before daphne makes its loop).
LAUNCH = ("import asyncio, sys\n"
          "if sys.argv[1] == 'uvloop':\n"
          "    import uvloop\n"
          "    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())\n"
          "from daphne.cli import CommandLineInterface\n"
          "CommandLineInterface().run(sys.argv[2:])\n")


async def _read(client: httpx.AsyncClient, url: str) -> int:
    """One stream read to its end; returns the SSE events it held."""
    events = 0
    async with client.stream("GET", url) as response:
        response.raise_for_status()
        async for part in response.aiter_raw():
            events += part.count(b"data: ")
    return events


async def _load(url: str, streams: int) -> int:
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0),
                                 limits=httpx.Limits(max_connections=streams)) as client:
        return sum(await asyncio.gather(*(_read(client, url) for _ in range(streams))))


def run(app: str, loop: str, args: argparse.Namespace) -> dict[str, Any]:
    """One daphne process serving ``app`` on ``loop``: its CPU time over the streams."""
    port = free_port()
    env = {**os.environ, "FLOOR_APP": app, "FLOOR_WRITES": str(args.writes),
           "FLOOR_GAP_S": str(args.gap_ms / 1000)}
    target = f"benchmarks.serving.web_floor_app:{app}"
    proc = subprocess.Popen([sys.executable, "-c", LAUNCH, loop, "-b", "127.0.0.1", "-p",
                             str(port), target], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}ready", timeout=1).status_code == 204:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"daphne ({app}, {loop}) did not start: "
                                   f"{proc.stderr.read().decode()[-2000:] if proc.stderr else ''}")
            time.sleep(0.2)
        process = psutil.Process(proc.pid)
        before = process.cpu_times()
        writes = asyncio.run(_load(url, args.streams))
        after = process.cpu_times()
    finally:
        proc.kill()
        proc.wait(10)
    # (a difference of sums of floats: a run psutil counted no tick of reads a hair below 0)
    cpu_s = max(0.0, round(after.user + after.system - before.user - before.system, 6))
    return {"app": app, "loop": loop, "writes": writes, "cpu_s": cpu_s,
            "us_per_write": 1e6 * cpu_s / max(1, writes),
            "ms_per_token": 1e3 * cpu_s / max(1, writes) / 2}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=HelpFormatter)
    parser.add_argument("--apps", type=name_list(APPS, "--apps"), default=list(APPS),
                        help="the applications to serve, in turn")
    parser.add_argument("--loops", type=name_list(LOOPS, "--loops"), default=list(LOOPS),
                        help="the event loops to run daphne on, in turn")
    parser.add_argument("--streams", type=positive_int, default=16, help="streams at once")
    parser.add_argument("--writes", type=positive_int, default=256, help="writes a stream")
    parser.add_argument("--gap-ms", type=positive_int, default=100,
                        help="between a stream's writes (ms; the platform's is two ticks)")
    add_out_dir_flag(parser, "the JSON file")
    args = parser.parse_args(argv)
    before = machine()
    print(f"CPU: {cpu_info()['model']}, {os.cpu_count()} cores", flush=True)
    rows = []
    for app in args.apps:
        for loop in args.loops:
            print(f"{app} on {loop}: {args.streams} streams x {args.writes} writes ...",
                  flush=True)
            rows.append(run(app, loop, args))
    print_table([{"app": r["app"], "loop": r["loop"], "writes": r["writes"],
                  "daphne CPU us/write": r["us_per_write"],
                  "ms/token at 2 a write": r["ms_per_token"],
                  "share of the 0.2 ms/write target": r["us_per_write"] / 1000
                  / TARGET_MS_PER_WRITE} for r in rows],
                ["app", "loop", "writes", "daphne CPU us/write", "ms/token at 2 a write",
                 "share of the 0.2 ms/write target"])
    path = write_json("web_floor", {"args": vars(args), "machine_before": before, "runs": rows},
                      args.out_dir)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
