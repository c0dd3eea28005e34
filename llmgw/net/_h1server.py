"""The server's HTTP/1.1 wire format: requests parsed by llhttp (``httptools``), responses written by hand.

:class:`RequestReader` turns a connection's bytes into :class:`ParsedRequest`
records (pipelined requests queue up), enforcing the server's limits as it
goes; :func:`response_head` and :func:`chunk` write the other direction. Used
by :class:`llmgw.net.server.HttpServer` only.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import httptools

from llmgw.net._listen import reason_phrase

__all__ = [
    "BadRequest",
    "BodyBudget",
    "ParsedRequest",
    "RequestReader",
    "response_head",
    "has_body",
    "chunk",
    "CONTINUE",
]

#: the interim answer to ``Expect: 100-continue``
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_NO_BODY_STATUSES = frozenset({204, 304})


class BadRequest(Exception):
    """A request the server refuses before its handler sees it: ``status`` and a message for the client.

    ``response``, when given, is the whole answer to send instead (a
    :class:`llmgw.net.server.Response` a pre-check returned).
    """

    def __init__(self, status: int, message: str, response: object = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.response = response


class BodyBudget:
    """The request body bytes every connection of one server holds, against a cap (None: no cap)."""

    __slots__ = ("limit", "used")

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.used = 0


#: HTTP versions the server speaks
_VERSIONS = frozenset({"1.0", "1.1"})


class ParsedRequest:
    """One request as read from the wire."""

    __slots__ = (
        "method",
        "target",
        "headers",
        "body",
        "size",
        "held",
        "keep_alive",
        "http11",
        "expects_continue",
    )

    def __init__(self) -> None:
        self.method = ""
        self.target = b""
        #: (lowercase name, value) pairs
        self.headers: list[tuple[str, str]] = []
        self.body: list[bytes] = []
        self.size = 0
        #: bytes of the server's :class:`BodyBudget` this request holds
        self.held = 0
        self.keep_alive = True
        self.http11 = True
        self.expects_continue = False


class RequestReader:
    """Parses the requests arriving on one connection.

    :meth:`feed` the bytes as they come (``b""`` at end of stream); complete
    requests wait in :attr:`ready`. A request over a limit, or bytes that are
    not HTTP/1.1, raise :class:`BadRequest` (from then on the connection is
    only good for answering that error).
    """

    def __init__(
        self,
        max_header_bytes: int,
        max_body_bytes: int,
        *,
        budget: BodyBudget | None = None,
        precheck: Callable[[ParsedRequest], object] | None = None,
    ) -> None:
        self.max_header_bytes = max_header_bytes
        self.max_body_bytes = max_body_bytes
        #: shared by every connection of the server: bodies held across connections
        self.budget = budget or BodyBudget(None)
        #: called with a request with a body once its head is in; a response it returns is sent at once
        self.precheck = precheck
        #: budget bytes held by this connection's requests not yet released
        self.holding = 0
        self.ready: deque[ParsedRequest] = deque()
        #: the request being read, between its first byte and its end
        self.current: ParsedRequest | None = None
        #: the client closed its side
        self.closed = False
        #: the client asked to switch protocols: no request after the current ones is read
        self.upgraded = False
        #: a refusal found while reading ahead (pipelined), raised when that request's turn comes
        self.deferred: BadRequest | None = None
        self._in_head = False
        self._head_fed = 0
        self._head_size = 0
        self._error: BadRequest | None = None
        self._parser = httptools.HttpRequestParser(self)

    @property
    def idle(self) -> bool:
        """No request has begun, none waits."""
        return self.current is None and not self.ready

    def feed(self, data: bytes) -> None:
        """Parse ``data``; ``b""`` means the client closed its side."""
        if not data:
            self.closed = True
            return
        if self.upgraded:
            return  # what follows an Upgrade request is not HTTP/1.1: ignored, the connection closes
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.upgraded = True
        except httptools.HttpParserError as exc:
            error, self._error = self._error, None
            if error is None and "HTTP version" in str(exc):
                error = _unsupported_version(data)
            raise error or BadRequest(400, f"bad request: {exc}") from None
        if self._in_head:
            self._head_fed += len(data)
            if self._head_fed > self.max_header_bytes:
                raise BadRequest(431, "request headers too large")

    def take(self) -> ParsedRequest | None:
        """The next complete request, or None; raises a refusal read ahead when its turn has come."""
        if self.ready:
            return self.ready.popleft()
        if self.deferred is not None:
            raise self.deferred
        return None

    def release(self, request: ParsedRequest) -> None:
        """``request`` is done with: the body bytes it held go back to the budget."""
        held, request.held = request.held, 0
        self.holding -= held
        self.budget.used -= held

    def release_all(self) -> None:
        """The connection is over: every byte its requests held goes back to the budget."""
        self.budget.used -= self.holding
        self.holding = 0
        for request in (self.current, *self.ready):
            if request is not None:
                request.held = 0

    def _refuse(self, status: int, message: str, response: object = None) -> None:
        self._error = BadRequest(status, message, response)
        raise self._error

    def _hold(self, request: ParsedRequest, size: int) -> None:
        """Count ``size`` more body bytes of ``request`` against the budget, or refuse it."""
        budget = self.budget
        if budget.limit is not None and budget.used + size > budget.limit:
            if request.held + size > budget.limit:
                self._refuse(
                    413,
                    f"request body larger than the {budget.limit} bytes this server holds "
                    "for all clients together (--max-buffered-bytes)",
                )
            self._refuse(
                503,
                f"this server already holds {budget.used} bytes of request bodies, its limit "
                f"(--max-buffered-bytes {budget.limit}); retry shortly",
            )
        budget.used += size
        request.held += size
        self.holding += size

    # -- httptools callbacks -------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self.current = ParsedRequest()
        self._in_head = True
        self._head_fed = 0
        self._head_size = 0

    def on_url(self, url: bytes) -> None:
        self.current.target += url
        self._head_size += len(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_size += len(name) + len(value) + 4
        if self._head_size > self.max_header_bytes:
            self._refuse(431, "request headers too large")
        self.current.headers.append((name.decode("latin-1").lower(), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        request = self.current
        parser = self._parser
        self._in_head = False
        request.method = parser.get_method().decode("ascii")
        version = parser.get_http_version()
        if version not in _VERSIONS:
            self._refuse(505, f"HTTP/{version} is not supported: send HTTP/1.1 (or HTTP/1.0)")
        request.http11 = version == "1.1"
        length = None
        with_body = False
        for name, value in request.headers:
            if name == "content-length" and value.isdigit():
                length = int(value)
                if length > self.max_body_bytes:
                    self._refuse(413, f"request body larger than {self.max_body_bytes} bytes")
                with_body = length > 0
            elif name == "transfer-encoding":
                with_body = True
            elif name == "expect" and value.lower() == "100-continue" and request.http11:
                request.expects_continue = True
        if with_body and self.precheck is not None:
            refusal = self.precheck(request)
            if refusal is not None:
                self._refuse(getattr(refusal, "status", 400), "refused before the body", refusal)
        if length:
            self._hold(request, length)

    def on_body(self, body: bytes) -> None:
        request = self.current
        size = request.size + len(body)
        if size > self.max_body_bytes:
            self._refuse(413, f"request body larger than {self.max_body_bytes} bytes")
        if size > request.held:
            self._hold(request, size - request.held)
        request.size = size
        request.body.append(body)

    def on_message_complete(self) -> None:
        request, self.current = self.current, None
        request.keep_alive = self._parser.should_keep_alive()
        self.ready.append(request)


def _unsupported_version(data: bytes) -> BadRequest:
    """The 505 for a request line whose HTTP version llhttp does not know (``HTTP/9.9``)."""
    line = data.split(b"\r\n", 1)[0].split(b"\n", 1)[0]
    version = line.rpartition(b" ")[2].decode("latin-1", "replace")[:16]
    return BadRequest(505, f"{version or 'this HTTP version'} is not supported: send HTTP/1.1 (or HTTP/1.0)")


def response_head(
    status: int, headers: tuple[tuple[str, str], ...], *, length: int | None, chunked: bool, close: bool
) -> bytes:
    """The status line and headers of a response, ``Content-Length`` or chunked framing added.

    :raises ValueError: when a header name or value would break the message (a line break in it).
    """
    lines = [f"HTTP/1.1 {status} {reason_phrase(status)}\r\n"]
    for name, value in headers:
        if "\n" in value or "\r" in value or "\n" in name or "\r" in name or ":" in name:
            raise ValueError(f"invalid response header {name!r}: {value!r}")
        lines.append(f"{name}: {value}\r\n")
    if status >= 200 and status not in _NO_BODY_STATUSES:
        if length is not None:
            lines.append(f"content-length: {length}\r\n")
        elif chunked:
            lines.append("transfer-encoding: chunked\r\n")
    if close:
        lines.append("connection: close\r\n")
    lines.append("\r\n")
    return "".join(lines).encode("latin-1")


def has_body(method: str, status: int) -> bool:
    """Whether a response to ``method`` with ``status`` carries a body on the wire."""
    return method != "HEAD" and status >= 200 and status not in _NO_BODY_STATUSES


def chunk(data: bytes) -> bytes:
    """``data`` framed as one chunk of a chunked body."""
    return b"%x\r\n%b\r\n" % (len(data), data)
