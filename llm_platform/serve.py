"""The web process: daphne, with a drain on SIGTERM. ``python -m llm_platform.serve [daphne's
arguments]`` takes daphne's own command line (``-b``, ``-p``, the application, ...).

Plain daphne stops at once on SIGTERM: every response in flight is cut (its generation is aborted,
so nothing runs for nobody, but the client loses the answer). This one drains first: it stops
accepting connections, answers 503 to new requests on connections already open (and ``/readyz``
with 503), lets the responses in flight finish for up to ``WEB_DRAIN_S`` seconds (default 10),
then stops the generations still running (their clients get a retryable ``interrupted`` error)
and stops as daphne does (a chat's websocket is closed). A second SIGTERM or SIGINT stops it at
once.

Its HTTP layer is :mod:`llm_platform.http_guard`'s: a body over ``MAX_BODY_BYTES`` (or its path's
limit) is refused before it is read, a large one is read only with a valid API key, and what
twisted and daphne refuse gets the platform's JSON error.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from http import HTTPStatus
from typing import Any


def use_event_loop(choice: str) -> str:
    """Make ``choice`` (``WEB_EVENT_LOOP``: ``uvloop``, ``asyncio``, or ``auto``: uvloop when it
    is installed; empty is ``auto``, case is ignored) the event loop daphne's reactor runs on;
    returns the one chosen. Called before daphne's server module is imported: it makes its loop
    at import.

    Raises:
        SystemExit: an unknown choice, or ``uvloop`` when it is not installed.
    """
    choice = choice.strip().lower() or "auto"
    if choice not in ("auto", "uvloop", "asyncio"):
        raise SystemExit(f"WEB_EVENT_LOOP must be auto, uvloop or asyncio, not {choice!r}")
    if choice == "asyncio":
        return choice
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise SystemExit("WEB_EVENT_LOOP is uvloop, which is not installed") from None
        return "asyncio"
    # libuv's loop under Twisted's asyncio reactor: the same reactor, cheaper timers, futures and
    # Redis connections (docs/benchmarks.md, section 6).
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return "uvloop"


# Run as the web process (not imported, as the tests do): the loop is chosen before daphne's
# server module makes its own.
EVENT_LOOP = (use_event_loop(os.environ.get("WEB_EVENT_LOOP", "auto")) if __name__ == "__main__"
              else "asyncio")

from daphne.access import AccessLogGenerator  # noqa: E402
from daphne.cli import CommandLineInterface  # noqa: E402
from daphne.server import Server  # noqa: E402
from twisted.internet import reactor  # noqa: E402
from twisted.web import http  # noqa: E402

from chat.frames import MAX_FRAME_CHARS  # noqa: E402
from llm_platform.log_redaction import RedactingAccessLog  # noqa: E402

log = logging.getLogger("llm_platform.serve")

# How often the drain looks at the responses still open (seconds).
DRAIN_POLL_S = 0.2
# After the grace, how long the interrupted responses get to send their error (seconds).
INTERRUPT_GRACE_S = 3.0


class DrainingServer(Server):
    """daphne's server, with :meth:`drain` on SIGTERM and SIGINT instead of an immediate stop."""

    drain_s = float(os.environ.get("WEB_DRAIN_S", "10"))

    def __init__(self, *args: Any, **kwargs: Any):
        kwargs["signal_handlers"] = False  # ours, installed in run()
        # The access log with any key a client put in a URL cut to its visible prefix.
        access_log = kwargs.get("action_logger")
        if isinstance(access_log, AccessLogGenerator):
            kwargs["action_logger"] = RedactingAccessLog(access_log.stream)
        # Every frame the chat's consumer reads to the end of (MAX_FRAME_CHARS characters, up
        # to 4 bytes each in UTF-8) reaches it, so that a longer one gets the consumer's error
        # frame; daphne's default of 1 MiB dropped the connection of some instead.
        least = 4 * MAX_FRAME_CHARS + 1024
        for name in ("websocket_max_message_size", "websocket_max_frame_size"):
            kwargs[name] = max(int(kwargs.get(name) or 0), least)
        super().__init__(*args, **kwargs)
        self._ports: list[Any] = []
        self._draining_since: float | None = None
        self._interrupted = False

    @property
    def http_factory(self) -> Any:
        return self._http_factory

    @http_factory.setter
    def http_factory(self, factory: Any) -> None:
        # daphne's run() makes its own HTTPFactory; this one (its subclass) takes its place. Set
        # in run(), once Django is set up (the application was imported): the module reads the
        # settings and the API's key check.
        from llm_platform.http_guard import PlatformHTTPFactory

        self._http_factory = (factory if isinstance(factory, PlatformHTTPFactory)
                              else PlatformHTTPFactory(self))

    def run(self) -> None:
        log.info("event loop: %s", EVENT_LOOP)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        reactor.callWhenRunning(self._start_monitor)
        super().run()

    @staticmethod
    def _start_monitor() -> None:
        """Start the web monitor (:mod:`gateway.monitor`) as the process starts serving, not at
        its first request: its heartbeat is published from the start, and its sight of Redis
        is continuous by the time a worker dies, so that death is declared one heartbeat TTL
        after the worker's last beat (a monitor started later must wait two TTLs)."""
        from gateway import monitor  # loads Django's models: daphne set Django up by now

        asyncio.ensure_future(monitor.ensure_started())

    def listen_success(self, port: Any) -> None:
        self._ports.append(port)
        super().listen_success(port)

    def _on_signal(self, signum: int, _frame: Any) -> None:
        if self._draining_since is not None:
            log.warning("%s again: stopping now", signal.Signals(signum).name)
            reactor.callFromThread(self.stop)
            return
        log.info("%s: draining (no new connections; up to %g s for the responses in flight)",
                 signal.Signals(signum).name, self.drain_s)
        reactor.callFromThread(self.drain)

    def drain(self) -> None:
        """Stop accepting, answer not ready, and stop once nothing is in flight (or at the
        grace period's end)."""
        # The web tier's modules load Django's models: imported once daphne set Django up.
        from gateway import monitor

        self._draining_since = time.monotonic()
        monitor.DRAINING.set()
        for port in self._ports:
            port.stopListening()
        self._stop_when_drained()

    def in_flight(self) -> int:
        """Connections whose application is still running (a response not yet ended)."""
        return sum(1 for details in self.connections.values()
                   if (app := details.get("application_instance")) is not None
                   and not app.done())

    def _stop_when_drained(self) -> None:
        assert self._draining_since is not None
        open_now = self.in_flight()
        waited = time.monotonic() - self._draining_since
        if open_now == 0:
            log.info("drained after %.1f s", waited)
            self.stop()
            return
        if waited >= self.drain_s and not self._interrupted:
            # The grace is over: stop the generations still running, so that each response
            # ends with an `interrupted` error its client can see, then stop.
            self._interrupted = True
            log.info("%d response(s) still open after %.1f s: interrupting them", open_now,
                     waited)
            from gateway.lifecycle import interrupt_all  # after Django's set-up, as in drain()

            asyncio.ensure_future(interrupt_all())
        if waited >= self.drain_s + INTERRUPT_GRACE_S:
            log.info("stopping with %d response(s) still open", open_now)
            self.stop()
            return
        reactor.callLater(DRAIN_POLL_S, self._stop_when_drained)


def add_reason_phrases() -> None:
    """Give every standard status twisted has no reason phrase for its phrase (RFC 9110 and
    those after it, as Python's ``http.HTTPStatus`` names them): daphne writes the status line
    from twisted's table, where 429, 422, 431 and a few more read "Unknown Status"."""
    for status in HTTPStatus:
        http.RESPONSES.setdefault(status.value, status.phrase.encode("ascii"))


class DrainingCommandLine(CommandLineInterface):
    server_class = DrainingServer


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llm_platform.settings")
    add_reason_phrases()
    DrainingCommandLine().run(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()
