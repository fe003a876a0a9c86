"""The web process's HTTP layer, below the ASGI application: the request body limit, request
targets, and the platform's JSON error for whatever this layer refuses.

Twisted parses a request and reads its whole body (into memory, or a temporary file) before
daphne hands the request to the application, which then gets all of it queued at once; Django
reads it all again before any view runs. An ASGI middleware, or a view, only ever sees a body
that was read already; so the limit acts here, on the headers, in :class:`PlatformChannel`
(twisted's ``HTTPChannel``) and :class:`PlatformRequest` (daphne's ``WebRequest``), which
``llm_platform.serve`` puts in place of daphne's own:

- **Body limit.** A body whose ``Content-Length`` is over its path's limit (:class:`BodyLimits`:
  ``MAX_BODY_BYTES``, or the longest matching prefix of ``MAX_BODY_BYTES_BY_PATH``) is refused
  413 :func:`~gateway.errors.request_too_large` as soon as the headers are in, nothing of it
  read; a chunked body as soon as what it sent passes the limit. Neither is kept anywhere.
- **Large bodies only with a key.** On a path whose limit is above ``MAX_BODY_BYTES``, a body that
  may be larger than ``MAX_BODY_BYTES`` (its ``Content-Length`` says so, or it is chunked) is read
  only once the request's API key, from its headers, was found valid
  (:func:`gateway.credentials.authenticate_headers`); until then the connection is not read. A
  missing or wrong key gets the API's 401, a database that cannot answer its 503, the body
  unread. An upload (``/v1/files``, ``/v1/adapters``) there also takes one of its tenant's
  upload leases first (``FILES_MAX_CONCURRENT_UPLOADS``,
  :func:`api.file_views.take_upload_lease`: 429 when none is free, the body unread), held
  while the body arrives and the view stores it, ended with the request.
- **Chunked bodies.** A body sent chunked reaches the application with a ``Content-Length`` of
  what it held, and without its ``Transfer-Encoding`` (Django reads a form up to the length: a
  chunked upload to ``/v1/files`` or ``/v1/adapters`` is read as one with a length).
- **Request targets.** An absolute-form target (``GET http://host/v1/models``, RFC 9112 3.2.2) is
  served as its path, with its host in place of the ``Host`` header; a target that is neither a
  path nor such a URL (``*``, ``host:443``, ``v1/models``), or holds bytes that are not ASCII,
  is refused 400.
- **JSON errors.** What twisted refuses (a malformed request line, header or chunked framing:
  400; a request line over 16 KiB: 414; headers over 16 KiB: 431) and daphne's own errors (a
  header it rejects, an application that failed before answering) get the platform's error
  body (:class:`gateway.errors.APIError`) instead of an empty or an HTML body, with the headers
  every other response carries (``nosniff``, the Content-Security-Policy, ``X-Frame-Options``:
  :func:`security_headers`).

After a refusal the connection is closed: the answer is written, then the write side is closed,
and whatever the client still sends is read and dropped (never kept) for up to
:data:`LINGER_S`, so that a client that writes its whole body before reading (most do) reads the
answer instead of a reset connection.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from asgiref.sync import ThreadSensitiveContext, sync_to_async
from daphne.http_protocol import HTTPFactory, WebRequest
from django.core.exceptions import ImproperlyConfigured
from django.db import close_old_connections
from twisted.web import http

from api import file_views
from gateway.conf import platform_settings
from gateway.credentials import authenticate_headers
from gateway.errors import APIError, request_too_large, unexpected_error

# Uploads (the Files API, LoRA adapters): a large body there is read only once it holds one of
# its tenant's upload leases, which it keeps until its request ends; the view learns of it from
# this header (one a client sent is dropped).
UPLOAD_PATHS = ("/v1/files", "/v1/adapters")
UPLOAD_LEASE_HEADER = file_views.UPLOAD_LEASE_HEADER.encode()
# After a refusal, how long what the client still sends is read and dropped before the
# connection is closed (seconds).
LINGER_S = 5.0
# An absolute-form request target: scheme, authority, then the path and query.
ABSOLUTE_FORM = re.compile(rb"(?i)https?://(?P<authority>[^/?#]*)(?P<rest>[/?][^#]*)?")


@dataclass(frozen=True)
class Target:
    """A request target as the application gets it: ``path``, in origin-form (the path and the
    query, bytes as sent), and ``authority``, the host of an absolute-form target (else None)."""

    path: bytes
    authority: bytes | None = None

    @property
    def route(self) -> str:
        """The path without its query, percent-decoded, as Django routes it."""
        return unquote(self.path.split(b"?", 1)[0].decode("ascii"))


def parse_target(raw: bytes) -> Target:
    """The :class:`Target` of a request line's target.

    Raises:
        ValueError: a target that is not ASCII, or neither a path (``/...``) nor an absolute
            ``http(s)://host/...`` URL; its message says so to the client.
    """
    if not raw.isascii():
        raise ValueError("The request target holds bytes that are not ASCII; percent-encode "
                         "them.")
    if raw.startswith(b"/"):
        return Target(raw)
    match = ABSOLUTE_FORM.fullmatch(raw)
    if match is None:
        raise ValueError("The request target must be a path ('/v1/...') or an absolute URL "
                         "('http://host/v1/...').")
    authority, rest = match["authority"], match["rest"] or b"/"
    if not authority or b"@" in authority:
        raise ValueError("The request target's URL must name a host, and no user.")
    return Target(rest if rest.startswith(b"/") else b"/" + rest, authority)


@dataclass(frozen=True)
class BodyLimits:
    """The largest body each path takes (bytes): ``default`` (``MAX_BODY_BYTES``) and, longest
    prefix first, ``by_path`` (``MAX_BODY_BYTES_BY_PATH``: a prefix covers itself and the paths
    below it, ``/v1/files`` covering ``/v1/files/abc``)."""

    default: int
    by_path: tuple[tuple[str, int], ...] = ()

    @classmethod
    def from_settings(cls) -> BodyLimits:
        """The limits of the platform's settings.

        Raises:
            ImproperlyConfigured: a negative limit, or a path that does not start with ``/``.
        """
        conf = platform_settings()
        default, by_path = conf["MAX_BODY_BYTES"], conf["MAX_BODY_BYTES_BY_PATH"]
        if default < 0:
            raise ImproperlyConfigured(f"MAX_BODY_BYTES must be at least 0, not {default}.")
        for path, limit in by_path.items():
            if not path.startswith("/") or limit < 0:
                raise ImproperlyConfigured(
                    f"MAX_BODY_BYTES_BY_PATH: {path}={limit}: each entry is PATH=BYTES, the "
                    "path starting with '/', the bytes at least 0.")
        ordered = sorted(((path.rstrip("/"), limit) for path, limit in by_path.items()),
                         key=lambda entry: -len(entry[0]))
        return cls(default, tuple(ordered))

    def for_path(self, path: str) -> int:
        """The limit of the request path ``path`` (percent-decoded, without the query)."""
        for prefix, limit in self.by_path:
            if path == prefix or path.startswith(prefix + "/"):
                return limit
        return self.default

    def needs_key(self, path: str, length: int | None) -> bool:
        """Whether a body of ``length`` bytes (None: chunked, length unknown) to ``path`` is
        read only after the request's API key was checked: the path takes more than the default
        and the body may be larger than the default."""
        return self.for_path(path) > self.default and (length is None or length > self.default)


def bad_request(message: str) -> APIError:
    """400 ``bad_request``: a request this layer cannot parse."""
    return APIError(400, message, code="bad_request")


def server_error(status: int, detail: str) -> APIError:
    """The error of one of daphne's own answers (``WebRequest.basic_error``: ``status`` and its
    text ``detail``)."""
    if status == 500:
        return APIError(500, "The server had an error while processing your request.",
                        code="internal_error")
    if status == 503:
        return APIError(503, "The server did not answer in time; retry shortly.",
                        code="service_unavailable", retry_after_s=1)
    if status == 400:
        return bad_request(f"Bad request: {detail.rstrip('.').lower()}.")
    return APIError(status, f"{detail.rstrip('.')}.", code=http.RESPONSES.get(
        status, b"error").decode("ascii").lower().replace(" ", "_"))


@functools.cache
def security_headers() -> dict[str, str]:
    """The headers Django's middlewares give every response (``nosniff``, ``Referrer-Policy``,
    ``Cross-Origin-Opener-Policy``, ``X-Frame-Options``, the Content-Security-Policy), from the
    same settings, for the answers this layer writes itself."""
    from csp.utils import build_policy
    from django.conf import settings

    headers = {"Content-Security-Policy": build_policy()}
    if settings.SECURE_CONTENT_TYPE_NOSNIFF:
        headers["X-Content-Type-Options"] = "nosniff"
    if settings.SECURE_REFERRER_POLICY:
        headers["Referrer-Policy"] = settings.SECURE_REFERRER_POLICY
    if settings.SECURE_CROSS_ORIGIN_OPENER_POLICY:
        headers["Cross-Origin-Opener-Policy"] = settings.SECURE_CROSS_ORIGIN_OPENER_POLICY
    headers["X-Frame-Options"] = getattr(settings, "X_FRAME_OPTIONS", "DENY").upper()
    return headers


def raw_response(error: APIError, *, head: bool = False) -> bytes:
    """A whole HTTP/1.1 response of ``error``, for a connection that closes after it (without the
    body for a ``HEAD`` request, whose ``Content-Length`` still counts it), with the headers
    every response of the platform carries (:func:`security_headers`)."""
    body = json.dumps(error.body()).encode()
    headers = {"Content-Type": "application/json", "Content-Length": str(len(body)),
               "Connection": "close", **security_headers(), **error.headers()}
    lines = b"".join(f"{name}: {value}\r\n".encode("latin-1") for name, value in headers.items())
    reason = http.RESPONSES.get(error.status, b"Error")
    return b"HTTP/1.1 %d %s\r\n%s\r\n%s" % (error.status, reason, lines, b"" if head else body)


@dataclass(frozen=True)
class UploadLease:
    """One of a tenant's upload leases (:func:`api.file_views.take_upload_lease`)."""

    tenant_id: int
    lease_id: str


async def key_refusal(headers: Mapping[str, str], route: str = ""
                      ) -> tuple[APIError | None, UploadLease | None]:
    """What a request with ``headers`` to ``route`` is refused for, checked as the API checks
    its key (:func:`gateway.credentials.authenticate_headers`): None for a valid key, else its
    401, or the 503 of a database that cannot answer; on :data:`UPLOAD_PATHS`, a valid key also
    takes one of its tenant's upload leases (the 429 when none is free), returned with it. The
    database connection is closed after, as at the end of a request."""
    async with ThreadSensitiveContext():
        try:
            key = await authenticate_headers(headers)
            if route not in UPLOAD_PATHS:
                return None, None
            return None, UploadLease(key.tenant_id,
                                     await file_views.take_upload_lease(key.tenant_id))
        except APIError as exc:
            return exc, None
        except Exception as exc:  # noqa: BLE001 - the request's answer (unexpected_error logs)
            return unexpected_error(exc), None
        finally:
            await sync_to_async(close_old_connections)()


def end_upload_lease(lease: UploadLease | None) -> None:
    if lease is not None:
        asyncio.ensure_future(file_views.end_upload_lease(lease.tenant_id, lease.lease_id))


class PlatformChannel(http.HTTPChannel):
    """Twisted's HTTP/1.1 channel with the checks of this module (see its docstring): the request
    target, the body limit and the key check before a large body, and :meth:`refuse` in place of
    twisted's bare 400 and its dropped connections."""

    _refused = False
    _lost = False
    # What arrived while a large body's API key is being checked (not None: being checked).
    _held: list[bytes] | None = None
    _lingering: Any = None
    # The method of the request line being read, as sent (a refusal to HEAD has no body).
    _method = b""

    # -- what arrives -------------------------------------------------------------------------

    def dataReceived(self, data: bytes) -> None:
        if self._refused:
            return  # refused: dropped while the connection lingers
        super().dataReceived(data)

    def lineReceived(self, line: bytes) -> None:
        if self._refused:
            return
        # The request line (no request is being read) must be ASCII.
        if not hasattr(self, "_command") and line:
            self._method = line.split(b" ", 1)[0]
        if not hasattr(self, "_command") and not line.isascii():
            self.refuse(bad_request("The request line holds bytes that are not ASCII; "
                                    "percent-encode them in the path and the query."))
            return
        if self._receivedHeaderSize + len(line) > self.totalHeadersSize:
            self.refuse(self._too_long())
            return
        super().lineReceived(line)

    def lineLengthExceeded(self, line: bytes) -> None:
        # Twisted drops the connection without an answer.
        if not hasattr(self, "_command"):
            self._method = line.split(b" ", 1)[0]
        self.refuse(self._too_long())

    def _too_long(self) -> APIError:
        if not hasattr(self, "_command"):
            return APIError(414, f"The request line is longer than {self.MAX_LENGTH} bytes.",
                            code="uri_too_long", type="invalid_request_error")
        return APIError(431, f"The request's headers are larger than {self.totalHeadersSize} "
                        "bytes.", code="request_header_fields_too_large",
                        type="invalid_request_error")

    def allHeadersReceived(self) -> None:
        request = self.requests[-1]
        try:
            request.target = parse_target(self._path)
        except ValueError as exc:
            self.refuse(bad_request(str(exc)))
            return
        limits: BodyLimits = self.factory.limits
        route = request.target.route
        request.body_limit = limits.for_path(route)
        if self.length is not None and self.length > request.body_limit:
            self.refuse(request_too_large(request.body_limit))
            return
        if limits.needs_key(route, self.length):
            self._check_key(request)
            return  # nothing is read (no 100 Continue either) until the key is valid
        super().allHeadersReceived()

    def rawDataReceived(self, data: bytes) -> None:
        if self._refused:
            return
        if self._held is not None:
            self._held.append(data)
            self._networkProducer.pauseProducing()
            return
        super().rawDataReceived(data)

    def allContentReceived(self) -> None:
        if self._refused:
            return
        super().allContentReceived()

    def _respondToBadRequestAndDisconnect(self) -> None:
        # Twisted's answer to what it cannot parse: a bare 400 without a body.
        self.refuse(bad_request("The request is not valid HTTP/1.1 (its request line, a header, "
                                "or the chunked body's framing)."))

    # -- the key check before a large body ----------------------------------------------------

    def _check_key(self, request: PlatformRequest) -> None:
        self._held = []
        self._networkProducer.pauseProducing()
        values = request.requestHeaders.getRawHeaders(b"authorization") or []
        headers = {"Authorization": b",".join(values).decode("latin-1")} if values else {}
        check = asyncio.ensure_future(key_refusal(headers, request.target.route))
        check.add_done_callback(functools.partial(self._key_checked, request))

    def _key_checked(self, request: PlatformRequest,
                     check: asyncio.Future[tuple[APIError | None, UploadLease | None]]) -> None:
        if check.cancelled():
            return
        refusal, lease = check.result()
        if self._lost or self._refused:
            end_upload_lease(lease)
            return
        if refusal is not None:
            self.refuse(refusal)
            return
        request.upload_lease = lease
        held, self._held = b"".join(self._held or ()), None
        super().allHeadersReceived()  # the body's file, and 100 Continue when asked for
        if held:
            self.rawDataReceived(held)
        if not self._refused:
            self._networkProducer.resumeProducing()

    # -- refusing -----------------------------------------------------------------------------

    def refuse(self, error: APIError) -> None:
        """Answer ``error`` (:func:`raw_response`) and close the connection: its write side at
        once, the whole of it once the client closes its side or after :data:`LINGER_S`, what
        it sends meanwhile dropped."""
        if self._refused or self._lost:
            return
        self._refused = True
        self._held = None
        self.setTimeout(None)
        response = raw_response(error, head=self._method == b"HEAD")
        self.transport.write(response)
        self._log_refusal(error.status, len(response))
        self._networkProducer.resumeProducing()
        try:
            self.transport.loseWriteConnection()
        except (AttributeError, NotImplementedError):
            self.transport.loseConnection()
            return
        self._lingering = self.callLater(LINGER_S, self._stop_lingering)

    def _log_refusal(self, status: int, size: int) -> None:
        """One line in daphne's access log, as for any answer."""
        peer = self.transport.getPeer()
        target = getattr(self, "_path", b"-")[:200]
        details = {"client": f"{getattr(peer, 'host', '-')}:{getattr(peer, 'port', '-')}",
                   "method": self._method.decode("ascii", "replace") or "-",
                   "path": target.decode("ascii", "backslashreplace"), "status": status,
                   "size": size, "time_taken": 0.0}
        self.factory.server.log_action("http", "complete", details)

    def _stop_lingering(self) -> None:
        self._lingering = None
        self.transport.abortConnection()

    def connectionLost(self, reason: Any) -> None:
        self._lost = True
        if self._lingering is not None and self._lingering.active():
            self._lingering.cancel()
        self._lingering = None
        super().connectionLost(reason)


class PlatformRequest(WebRequest):
    """Daphne's request, with the body counted against its limit, the absolute-form target
    served as its path, and daphne's own errors in the platform's JSON shape.

    Twisted's parsing of form bodies into ``args`` (read whole into memory; daphne never uses
    it) is off.
    """

    target: Target | None = None
    body_limit: int | None = None
    upload_lease: UploadLease | None = None

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._parsePOSTFormSubmission = False
        self.body_received = 0

    def handleContentChunk(self, data: bytes) -> None:
        channel = self.channel
        if channel is None or channel._refused:
            return
        self.body_received += len(data)
        if self.body_limit is not None and self.body_received > self.body_limit:
            channel.refuse(request_too_large(self.body_limit))
            return
        super().handleContentChunk(data)

    def requestReceived(self, command: bytes, path: bytes, version: bytes) -> None:
        self.requestHeaders.removeHeader(UPLOAD_LEASE_HEADER)  # only this layer sets it
        if self.upload_lease is not None:
            self.requestHeaders.setRawHeaders(UPLOAD_LEASE_HEADER,
                                              [self.upload_lease.lease_id.encode()])
        if self.target is not None:
            path = self.target.path
            if self.target.authority is not None:
                # RFC 9112 3.2.2: the target's host, not the Host header.
                self.requestHeaders.setRawHeaders(b"Host", [self.target.authority])
        super().requestReceived(command, path, version)

    def process(self) -> None:
        # The body is whole by now. A chunked one is handed on with its length instead of its
        # framing (as a proxy may, RFC 9112 6.1): Django parses a form only up to the request's
        # Content-Length, so a chunked upload would otherwise reach the view without any field.
        headers = self.requestHeaders
        if headers.hasHeader(b"transfer-encoding") and not headers.hasHeader(b"content-length"):
            headers.removeHeader(b"transfer-encoding")
            headers.setRawHeaders(b"content-length", [str(self.body_received).encode()])
        super().process()

    def finish(self) -> None:
        super().finish()
        self._end_upload_lease()

    def connectionLost(self, reason: Any) -> None:
        super().connectionLost(reason)
        self._end_upload_lease()

    def _end_upload_lease(self) -> None:
        lease, self.upload_lease = self.upload_lease, None
        end_upload_lease(lease)

    def basic_error(self, status: int, status_text: bytes, body: str) -> None:
        if self._response_started:  # too late for another answer: daphne's own handling
            super().basic_error(status, status_text, body)
            return
        error = server_error(status, body)
        headers = [(b"Content-Type", b"application/json"),
                   *((name.encode("latin-1"), value.encode("latin-1"))
                     for name, value in {**security_headers(), **error.headers()}.items())]
        self.handle_reply({"type": "http.response.start", "status": status, "headers": headers})
        self.handle_reply({"type": "http.response.body",
                           "body": json.dumps(error.body()).encode()})


class PlatformHTTPFactory(HTTPFactory):
    """Daphne's HTTP factory, building :class:`PlatformChannel` and :class:`PlatformRequest`;
    ``limits`` are the settings' :class:`BodyLimits`, read (and checked) when it is made."""

    def __init__(self, server: Any):
        super().__init__(server)
        self.limits = BodyLimits.from_settings()

    def protocol(self) -> Any:  # twisted's factory calls it for each connection
        return http._GenericHTTPChannelProtocol(PlatformChannel())

    def buildProtocol(self, addr: Any) -> Any:
        protocol = super().buildProtocol(addr)
        protocol.requestFactory = PlatformRequest
        return protocol
