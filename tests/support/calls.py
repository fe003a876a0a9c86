"""A client of a running platform's completions API, on a thread of its own: what it was answered
(status, error, tokens received, how it ended), for tests that fault the platform meanwhile."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field

import httpx
from django.db import OperationalError


@dataclass
class Call:
    """One ``POST /v1/completions`` (``stream`` or not), read on a thread (:meth:`start`).

    Attributes, once :attr:`ended_at` is set: ``status`` (the HTTP status), ``error`` (the error
    body's ``error`` object, or the error event's in a stream), ``tokens`` (the tokens received:
    one character a token on the reference backend), ``done`` (a stream's ``[DONE]`` came),
    ``headers`` (the response's, lower-case names), ``text`` (the text received),
    ``request_id`` (known from a stream's chunks or a complete answer), ``failure`` (a transport
    error's text), ``completion_tokens`` (a complete answer's usage).
    """

    url: str
    key: str
    max_tokens: int
    stream: bool
    prompt: str = "once upon a time"
    status: int | None = None
    text: str = ""
    tokens: int = 0
    done: bool = False
    error: dict = field(default_factory=dict)
    request_id: str = ""
    completion_tokens: int | None = None
    headers: dict = field(default_factory=dict)
    failure: str = ""
    ended_at: float | None = None

    def start(self) -> Call:
        threading.Thread(target=self._run, daemon=True).start()
        return self

    @property
    def code(self) -> str:
        """The error's code ("" for none)."""
        return str(self.error.get("code") or "")

    @property
    def retryable(self) -> bool:
        """Whether the error says a retry can help: in a stream's error event, ``retryable``;
        in an error response, a ``Retry-After`` header and no ``x-should-retry: false``."""
        if "retryable" in self.error:
            return self.error["retryable"] is True
        return ("retry-after" in self.headers
                and self.headers.get("x-should-retry") != "false")

    def _run(self) -> None:
        body = {"model": "SmolLM2-135M-Instruct", "prompt": self.prompt,
                "max_tokens": self.max_tokens, "stream": self.stream, "temperature": 0}
        headers = {"Authorization": f"Bearer {self.key}"}
        try:
            if self.stream:
                with httpx.stream("POST", f"{self.url}/v1/completions", json=body,
                                  headers=headers, timeout=180) as response:
                    self.status = response.status_code
                    self.headers = {k.lower(): v for k, v in response.headers.items()}
                    if response.status_code != 200:
                        response.read()
                        self.error = response.json().get("error", {})
                    else:
                        self._read_stream(response)
            else:
                response = httpx.post(f"{self.url}/v1/completions", json=body, headers=headers,
                                      timeout=180)
                self.status = response.status_code
                self.headers = {k.lower(): v for k, v in response.headers.items()}
                reply = response.json()
                if response.status_code == 200:
                    self.request_id = reply["id"].removeprefix("cmpl-")
                    self.text = reply["choices"][0]["text"]
                    self.tokens = len(self.text)
                    self.completion_tokens = reply["usage"]["completion_tokens"]
                else:
                    self.error = reply.get("error", {})
        except httpx.HTTPError as exc:
            self.failure = repr(exc)
        self.ended_at = time.monotonic()

    def _read_stream(self, response: httpx.Response) -> None:
        for line in response.iter_lines():
            if line == "data: [DONE]":
                self.done = True
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                if "error" in data:
                    self.error = data["error"]
                else:
                    self.request_id = data["id"].removeprefix("cmpl-")
                    chunk = "".join(c["text"] for c in data["choices"])
                    self.text += chunk
                    self.tokens += len(chunk)


def new_tenant(make_tenant) -> tuple:
    """``(tenant, raw key)`` from the ``make_tenant`` fixture; made again while SQLite is busy
    with the writers of a running platform ("database is locked")."""
    for _ in range(50):
        try:
            tenant, _, raw = make_tenant()
            return tenant, raw
        except OperationalError:
            time.sleep(0.1)
    raise AssertionError("the test database stayed locked")
