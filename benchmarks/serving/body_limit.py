"""Large request bodies without a key: what they cost the web process, with its body limit and
without it.

One web process on its own SQLite database (no worker: nothing here reaches one), started as

* ``platform``: ``python -m llm_platform.serve``, as the run command starts it: its HTTP layer
  (:mod:`llm_platform.http_guard`) refuses a body over ``MAX_BODY_BYTES`` (2.5 MiB) from its
  ``Content-Length``, before reading it;
* ``daphne``: plain ``daphne`` on the same application, without that layer: the body is read
  whole (twisted, then daphne's queue, then Django) before the view answers 401.

``--concurrency`` clients each send a ``--body-mib`` MiB ``POST /v1/chat/completions`` with no
``Authorization`` at once (raw sockets: each writes its whole body while reading the answer),
``--rounds`` times. Reported per server: the answers' statuses, the time from a request's first
byte to its answer's first byte (p50 and max, ms), the time to write the whole body, and the web
process's resident memory (psutil RSS, MiB) before, at its peak while the bodies arrive (sampled
every 20 ms), and ``--settle-s`` seconds after the last answer.

Usage::

    python -m benchmarks.serving.body_limit                        # about 1 min on 2 cores
    python -m benchmarks.serving.body_limit --servers platform --body-mib 300 --concurrency 4
    python -m benchmarks.serving.body_limit --body-mib 8 --concurrency 2 --rounds 1 --settle-s 0.5
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import psutil

from benchmarks.harness.cli import (
    HelpFormatter,
    add_out_dir_flag,
    name_list,
    non_negative_float,
    positive_int,
)
from benchmarks.harness.common import machine, print_table, write_json
from benchmarks.harness.stack import BIN, REPO, free_port

SERVERS = ("platform", "daphne")
MIB = 2**20
# How often the web process's memory is sampled while the bodies arrive (seconds).
SAMPLE_EVERY_S = 0.02


class WebProcess:
    """One web process (``server``: ``platform`` or ``daphne``) on a free port, on the SQLite
    database at ``db_url``; its output in ``log``."""

    def __init__(self, server: str, db_url: str, log: Path):
        self.port = free_port()
        command = ([sys.executable, "-m", "llm_platform.serve"] if server == "platform"
                   else [str(BIN / "daphne")])
        env = {**os.environ, "DATABASE_URL": db_url,
               "REDIS_PREFIX": f"bench-{uuid.uuid4().hex[:8]}",
               "DJANGO_SETTINGS_MODULE": "llm_platform.settings"}
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [*command, "-b", "127.0.0.1", "-p", str(self.port),
                 "llm_platform.asgi:application"],
                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        self.memory = psutil.Process(self.proc.pid)

    def wait_up(self, timeout_s: float = 90) -> WebProcess:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/healthz", timeout=2).is_success:
                    return self
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        raise RuntimeError("the web process did not start")

    def rss_mib(self) -> float:
        return self.memory.memory_info().rss / MIB

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


def send_body(port: int, body_mib: int) -> dict[str, Any]:
    """One ``POST /v1/chat/completions`` of ``body_mib`` MiB without a key, its body written
    while its answer is read: the answer's status (0: none), the seconds to its first byte and
    to the body's last byte written."""
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % (body_mib * MIB))
    chunk = b"x" * MIB
    answer: dict[str, Any] = {"status": 0, "first_byte_s": None, "written_s": None}
    conn = socket.create_connection(("127.0.0.1", port), timeout=120)
    start = time.perf_counter()

    def read() -> None:
        data = b""
        try:
            while b"\r\n" not in data:
                part = conn.recv(65536)
                if not part:
                    break
                if not data:
                    answer["first_byte_s"] = time.perf_counter() - start
                data += part
        except OSError:
            pass
        status = data.split(b" ", 2)[1] if data.startswith(b"HTTP/") else b"0"
        answer["status"] = int(status) if status.isdigit() else 0

    reader = threading.Thread(target=read)
    reader.start()
    try:
        conn.sendall(head)
        for _ in range(body_mib):
            conn.sendall(chunk)
        answer["written_s"] = time.perf_counter() - start
    except OSError:
        pass  # the server closed the connection: the answer was read meanwhile
    reader.join(120)
    conn.close()
    return answer


def run_server(server: str, db_url: str, folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    web = WebProcess(server, db_url, folder / f"{server}.log").wait_up()
    try:
        time.sleep(1.0)
        before = web.rss_mib()
        peak = [before]
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                peak.append(web.rss_mib())
                time.sleep(SAMPLE_EVERY_S)

        sampler = threading.Thread(target=sample)
        sampler.start()
        answers: list[dict[str, Any]] = []
        lock = threading.Lock()

        def client() -> None:
            answer = send_body(web.port, args.body_mib)
            with lock:
                answers.append(answer)

        started = time.perf_counter()
        for _ in range(args.rounds):
            clients = [threading.Thread(target=client) for _ in range(args.concurrency)]
            for thread in clients:
                thread.start()
            for thread in clients:
                thread.join()
        elapsed = time.perf_counter() - started
        done.set()
        sampler.join()
        time.sleep(args.settle_s)
        after = web.rss_mib()
    finally:
        web.stop()
    firsts = [a["first_byte_s"] * 1000 for a in answers if a["first_byte_s"] is not None]
    written = [a["written_s"] for a in answers if a["written_s"] is not None]
    statuses: dict[str, int] = {}
    for answer in answers:
        statuses[str(answer["status"])] = statuses.get(str(answer["status"]), 0) + 1
    return {"server": server, "requests": len(answers), "statuses": statuses,
            "answer_ms_p50": statistics.median(firsts) if firsts else None,
            "answer_ms_max": max(firsts) if firsts else None,
            "written_s_max": max(written) if written else None, "elapsed_s": elapsed,
            "rss_before_mib": before, "rss_peak_mib": max(peak), "rss_after_mib": after}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=HelpFormatter)
    parser.add_argument("--servers", type=name_list(SERVERS, "--servers"),
                        default=list(SERVERS), help="the web processes to measure, in turn")
    parser.add_argument("--body-mib", type=positive_int, default=300,
                        help="each request's body (MiB)")
    parser.add_argument("--concurrency", type=positive_int, default=4,
                        help="requests sent at once")
    parser.add_argument("--rounds", type=positive_int, default=2,
                        help="times the concurrent requests are sent, one round after another")
    parser.add_argument("--settle-s", type=non_negative_float, default=3.0,
                        help="seconds after the last answer before the memory is read again")
    add_out_dir_flag(parser, "the JSON file")
    args = parser.parse_args(argv)
    before = machine()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-body-limit-") as tmp:
        folder = Path(tmp)
        db_url = f"sqlite:///{folder / 'db.sqlite3'}"
        subprocess.run([sys.executable, "manage.py", "migrate", "--noinput"], cwd=REPO, check=True,
                       capture_output=True, env={**os.environ, "DATABASE_URL": db_url,
                                                 "DJANGO_SETTINGS_MODULE": "llm_platform.settings"})
        for server in args.servers:
            print(f"{server}: {args.rounds} x {args.concurrency} bodies of {args.body_mib} MiB "
                  "...", flush=True)
            rows.append(run_server(server, db_url, folder, args))
    table = [{"server": r["server"],
              "statuses": " ".join(f"{k}x{v}" for k, v in sorted(r["statuses"].items())),
              "answer ms p50": r["answer_ms_p50"], "answer ms max": r["answer_ms_max"],
              "body written s max": r["written_s_max"], "RSS before MiB": r["rss_before_mib"],
              "RSS peak MiB": r["rss_peak_mib"], "RSS after MiB": r["rss_after_mib"]}
             for r in rows]
    print_table(table, list(table[0]))
    path = write_json("body_limit", {"args": vars(args), "machine_before": before,
                                     "servers": rows}, args.out_dir)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
