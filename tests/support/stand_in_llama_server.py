"""A stand-in for llama.cpp's ``llama-server``: the same command-line flags, ``/health``, a
streamed ``/completion`` (a chunk per token with the running ``tokens_predicted``, then a final
chunk with ``stop``) and a streamed ``/v1/completions`` (a chunk per token, then the usage chunk
and ``[DONE]``), so the benchmarks' peer harness runs without the real server built.

Run as ``python stand_in_llama_server.py -m FILE --port P ...``. It writes its flags and, when
it stops, the most requests it held at once to ``$STAND_IN_LOG`` (JSON). ``$STAND_IN_MODE``:
``ok`` (default), ``merge`` (the first two tokens in one chunk, as the real server sends the two
tokens of one multi-byte character), ``short`` (stops one token early), ``exit`` (exits at once
with status 3), ``segv`` (kills itself with SIGSEGV at start unless given ``--no-repack``, as the
real server's AMX repacking did on a Sapphire Rapids Xeon), ``segv_always``, or ``add_bos``
(counts one prompt token more than it was sent).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODE = os.environ.get("STAND_IN_MODE", "ok")
LOG = os.environ.get("STAND_IN_LOG")
state = {"live": 0, "most": 0, "requests": 0}
lock = threading.Lock()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:  # quiet
        pass

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        body = b'{"status":"ok"}' if self.path == "/health" else b"{}"
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:  # noqa: N802
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with lock:
            state["live"] += 1
            state["requests"] += 1
            state["most"] = max(state["most"], state["live"])
        try:
            self.stream(request)
        finally:
            with lock:
                state["live"] -= 1

    def stream(self, request: dict) -> None:
        prompt = request["prompt"]
        n_prompt = len(prompt) if isinstance(prompt, list) else len(prompt.split())
        n_prompt += MODE == "add_bos"
        native = self.path == "/completion"
        n = request["n_predict" if native else "max_tokens"] - (MODE == "short")
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        counts = [1] * n  # tokens each chunk carries
        if MODE == "merge" and n > 1:
            counts = [2, *counts[2:]]
        done = 0
        for k in counts:
            time.sleep(0.002)
            done += k
            if native:
                self.send({"content": " tok" * k, "stop": False, "tokens_predicted": done,
                           "tokens_evaluated": n_prompt})
            else:
                self.send({"choices": [{"index": 0, "text": " tok" * k, "finish_reason": None}]})
        if native:
            self.send({"content": "", "stop": True, "tokens_predicted": n,
                       "tokens_evaluated": n_prompt})
            return
        self.send({"choices": [], "usage": {"prompt_tokens": n_prompt, "completion_tokens": n}})
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()

    def send(self, chunk: dict) -> None:
        self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        self.wfile.flush()


def main() -> None:
    parser = argparse.ArgumentParser()
    for flag in ("-m", "--host", "--port", "-t", "-tb", "-np", "-c", "-a"):
        parser.add_argument(flag)
    parser.add_argument("--no-repack", action="store_true")
    args = parser.parse_args()
    if MODE == "segv_always" or (MODE == "segv" and not args.no_repack):
        print("stand-in: crashing at start as asked", flush=True)
        os.kill(os.getpid(), signal.SIGSEGV)
    if MODE == "exit":
        print("stand-in: failing at start as asked", flush=True)
        sys.exit(3)
    server = ThreadingHTTPServer((args.host, int(args.port)), Handler)

    def stop(*_: object) -> None:
        if LOG:
            with open(LOG, "w") as f:
                json.dump({"argv": sys.argv[1:], **state}, f)
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    server.serve_forever()


if __name__ == "__main__":
    main()
