"""One Redis connection that sends a round trip of commands and reads their replies with
hiredis's parser, and nothing else: the event reader's (:mod:`gateway.event_reader`).

A web process reads every streamed token's event with one round trip of the loop's reader; a
lone stream makes one round trip a token. redis-py's pipeline builds each round trip through its
command, retry, connection-pool and reply-callback layers: about 0.1 ms of CPU a round trip on top
of what the socket and the parser cost (an ``XREAD`` of two streams on a 2-core AMD EPYC Zen 4 on
uvloop: 170-180 us through a pipeline, 47-53 us here). This connection packs the commands itself
(RESP2 arrays of bulk strings), writes them at once and hands back the raw replies in order.

- The URL is read as redis-py reads it (``redis://``, ``rediss://``, ``unix://``; user, password,
  database, ``socket_timeout`` and ``socket_connect_timeout``); the connection sends ``AUTH``,
  ``SELECT`` and ``CLIENT SETNAME`` once connected. A ``rediss://`` connection's TLS settings are
  redis-py's for the same URL (the server's certificate required and its host name checked
  unless the URL's ``ssl_cert_reqs``/``ssl_check_hostname`` say otherwise).
- A connection that is lost while established (the server closed it, ``CLIENT KILL``) is made
  again and the round trip sent once more, as redis-py's retries would; the reader's commands are
  idempotent (``XREAD`` and the delivered checkpoints' ``HSET``/``HDEL``/``EXPIRE``). A second
  failure, or one while connecting, raises.
- Without ``socket_timeout`` a round trip waits for its replies as long as it takes (a stopped
  Redis): the reader's callers bound their own patience (:meth:`Subscription.read`).
- A round trip cancelled or failed half-way closes the connection (a late reply must not answer
  the next one); the next round trip connects again.
"""

from __future__ import annotations

import asyncio
from typing import Any

import hiredis
import redis.exceptions
from redis.asyncio.connection import SSLConnection, parse_url

Command = tuple[Any, ...]


def pack(commands: list[Command]) -> bytes:
    """``commands`` as RESP2 arrays of bulk strings (``bytes`` as they are, ``str`` in UTF-8,
    numbers in decimal)."""
    out: list[bytes] = []
    for command in commands:
        out.append(b"*%d\r\n" % len(command))
        for arg in command:
            if isinstance(arg, bytes):
                data = arg
            elif isinstance(arg, str):
                data = arg.encode()
            elif isinstance(arg, int | float) and not isinstance(arg, bool):
                data = repr(arg).encode()
            else:
                raise TypeError(f"a Redis command argument must be bytes, str or a number, not "
                                f"{type(arg).__name__}")
            out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


class _Protocol(asyncio.Protocol):
    """The replies of the round trip in flight, as hiredis parses them."""

    def __init__(self) -> None:
        self.parser = hiredis.Reader(protocolError=redis.exceptions.InvalidResponse,
                                     replyError=redis.exceptions.ResponseError)
        self.transport: asyncio.Transport | None = None
        self.lost: redis.exceptions.ConnectionError | None = None
        self._waiter: asyncio.Future[list[Any]] | None = None
        self._expected = 0
        self._replies: list[Any] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = redis.exceptions.ConnectionError(
            f"Connection to Redis lost: {exc}" if exc else "Connection closed by the server.")
        self._settle(error=self.lost)

    def data_received(self, data: bytes) -> None:
        self.parser.feed(data)
        if self._waiter is None:
            return
        try:
            while len(self._replies) < self._expected:
                reply = self.parser.gets()
                if reply is False:
                    return
                self._replies.append(reply)
        except redis.exceptions.InvalidResponse as exc:
            self._settle(error=redis.exceptions.ConnectionError(f"Protocol error: {exc}"))
            return
        self._settle()

    def expect(self, n: int) -> asyncio.Future[list[Any]]:
        """A future of the next ``n`` replies."""
        assert self._waiter is None, "one round trip at a time"
        self._waiter = asyncio.get_running_loop().create_future()
        self._expected, self._replies = n, []
        return self._waiter

    def _settle(self, error: BaseException | None = None) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is None or waiter.done():
            return
        if error is not None:
            waiter.set_exception(error)
        else:
            waiter.set_result(self._replies)


class WireConnection:
    """One connection to the Redis at ``url`` (see the module docstring), named ``client_name``
    in ``CLIENT LIST``. One round trip at a time; not shared between event loops."""

    def __init__(self, url: str, client_name: str) -> None:
        options = parse_url(url)
        self._options = options
        self._client_name = client_name
        self._timeout: float | None = options.get("socket_timeout")
        self._connect_timeout: float | None = options.get("socket_connect_timeout",
                                                          self._timeout)
        self._protocol: _Protocol | None = None

    @property
    def where(self) -> str:
        """The server's address, for messages."""
        o = self._options
        return o["path"] if "path" in o else f"{o.get('host', 'localhost')}:{o.get('port', 6379)}"

    async def round_trip(self, commands: list[Command]) -> list[Any]:
        """Send ``commands`` in one write and return their replies in order (hiredis's: bulk
        strings as ``bytes``, arrays as lists, a nil as ``None``).

        Raises:
            redis.ConnectionError: Redis cannot be reached, or the connection was lost again
                after being made anew.
            redis.TimeoutError: no reply within the URL's ``socket_timeout``.
            redis.ResponseError: a command's error reply (the first, after every reply was read).
        """
        for attempt in (1, 2):
            fresh = self._protocol is None
            if fresh:
                await self._connect()
            try:
                replies = await self._exchange(commands)
            except redis.exceptions.ConnectionError:
                self.close()
                if fresh or attempt == 2:
                    raise
                continue
            except BaseException:
                self.close()
                raise
            for reply in replies:
                if isinstance(reply, redis.exceptions.ResponseError):
                    raise reply
            return replies
        raise AssertionError("unreachable")

    def close(self) -> None:
        """Close the connection (idempotent); the next round trip connects again."""
        protocol, self._protocol = self._protocol, None
        if protocol is not None and protocol.transport is not None:
            protocol.transport.close()

    async def _exchange(self, commands: list[Command]) -> list[Any]:
        protocol = self._protocol
        assert protocol is not None and protocol.transport is not None
        if protocol.lost is not None or protocol.transport.is_closing():
            raise protocol.lost or redis.exceptions.ConnectionError("Connection closed.")
        waiter = protocol.expect(len(commands))
        try:
            protocol.transport.write(pack(commands))
        except RuntimeError as exc:  # uvloop's transport, closed before connection_lost ran
            raise redis.exceptions.ConnectionError(f"Connection closed: {exc}") from exc
        if self._timeout is None:  # the event reader's URL: no timeout set (the usual)
            return await waiter
        try:
            async with asyncio.timeout(self._timeout):
                return await waiter
        except TimeoutError as exc:
            raise redis.exceptions.TimeoutError(
                f"No reply from Redis at {self.where} within {self._timeout} s") from exc

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        o = self._options
        try:
            async with asyncio.timeout(self._connect_timeout):
                if "path" in o:
                    _, protocol = await loop.create_unix_connection(_Protocol, o["path"])
                else:
                    ssl = None
                    if o.get("connection_class") is SSLConnection:
                        # redis-py's own context for the URL: a certificate required and the
                        # host name checked unless the URL's ssl_* options say otherwise.
                        ssl = SSLConnection(**{k: v for k, v in o.items()
                                               if k != "connection_class"}).ssl_context.get()
                    _, protocol = await loop.create_connection(
                        _Protocol, o.get("host", "localhost"), o.get("port", 6379), ssl=ssl)
        except TimeoutError as exc:
            raise redis.exceptions.TimeoutError(f"Timeout connecting to Redis at {self.where}"
                                                ) from exc
        except OSError as exc:
            raise redis.exceptions.ConnectionError(
                f"Error connecting to Redis at {self.where}: {exc}") from exc
        self._protocol = protocol
        hello: list[Command] = []
        if o.get("password") is not None:
            hello.append(("AUTH", *([o["username"]] if o.get("username") else []),
                          o["password"]))
        if o.get("db"):
            hello.append(("SELECT", int(o["db"])))
        hello.append(("CLIENT", "SETNAME", self._client_name))
        try:
            replies = await self._exchange(hello)
        except BaseException:
            self.close()
            raise
        for command, reply in zip(hello, replies, strict=True):
            if isinstance(reply, redis.exceptions.ResponseError):
                self.close()
                error = (redis.exceptions.AuthenticationError if command[0] == "AUTH"
                         else redis.exceptions.ConnectionError)
                raise error(f"Redis at {self.where} refused {command[0]}: {reply}")
