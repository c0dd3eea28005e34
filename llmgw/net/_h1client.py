"""The client's HTTP/1.1 wire format: requests written by hand, responses parsed by llhttp (``httptools``).

:func:`request_head` writes a request's head; a :class:`ResponseReader` per
exchange turns the upstream's bytes into the response head and body pieces
as they arrive. Used by :mod:`llmgw.net.client` only.
"""

from __future__ import annotations

import httptools

__all__ = ["ResponseReader", "request_head", "BrokenResponse"]


class BrokenResponse(Exception):
    """The upstream's bytes are not a valid HTTP/1.1 response."""


def request_head(method: str, target: str, headers: list[tuple[str, str]], length: int | None) -> bytes:
    """The request line and headers, ``Content-Length: length`` added unless None.

    :raises ValueError: when a header would break the message (a line break in it).
    """
    lines = [f"{method} {target} HTTP/1.1\r\n"]
    for name, value in headers:
        if "\n" in value or "\r" in value or "\n" in name or "\r" in name or ":" in name:
            raise ValueError(f"invalid request header {name!r}: {value!r}")
        lines.append(f"{name}: {value}\r\n")
    if length is not None:
        lines.append(f"content-length: {length}\r\n")
    lines.append("\r\n")
    return "".join(lines).encode("latin-1")


class ResponseReader:
    """One response, fed the connection's bytes as they come.

    :attr:`status` is set once the head is in (interim 1xx answers are
    skipped); body pieces wait in :attr:`pieces`; :attr:`complete` once the
    body ended, after which :attr:`reusable` says whether the connection may
    carry another request.
    """

    __slots__ = (
        "status",
        "reason",
        "headers",
        "pieces",
        "complete",
        "reusable",
        "_head_only",
        "_until_close",
        "_parser",
        "_in_message",
    )

    def __init__(self, method: str) -> None:
        self._parser = httptools.HttpResponseParser(self)
        self.restart(method)

    def restart(self, method: str) -> None:
        """Make ready for the next response on the same connection (after a complete, reusable one)."""
        self.status: int | None = None
        self.reason = ""
        self.headers: list[tuple[str, str]] = []
        self.pieces: list[bytes] = []
        self.complete = False
        self.reusable = False
        self._head_only = method == "HEAD"
        #: the body runs until the upstream closes (no length, not chunked)
        self._until_close = False
        self._in_message = False

    @property
    def parser_reusable(self) -> bool:
        """Whether the parser stands between two messages (not after a HEAD's head only)."""
        return self.reusable and not self._head_only

    def feed(self, data: bytes) -> None:
        """Parse ``data``; ``b""`` when the upstream closed.

        :raises BrokenResponse: when the bytes are not HTTP/1.1, or the upstream closed before the end.
        """
        if not data:
            if self._until_close and self.status is not None and not self.complete:
                self.complete = True
                self.reusable = False
                return
            if not self.complete:
                raise BrokenResponse("the connection closed")
            return
        if self.complete:
            self.reusable = False  # bytes nobody asked for: do not reuse the connection
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if not self.complete:
                raise BrokenResponse(str(exc) or type(exc).__name__) from None
            self.reusable = False  # a valid response, then something else

    # -- httptools callbacks -------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.complete:
            self.reusable = False  # a second message unasked for
        self.headers = []
        self.reason = ""
        self._in_message = True

    def on_status(self, reason: bytes) -> None:
        self.reason += reason.decode("latin-1")

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.decode("latin-1").lower(), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if status < 200 and status != 101:
            return  # an interim answer (100 Continue): the real one follows
        self.status = status
        if self._head_only:
            self._finish()
            return
        framed = any(name in ("content-length", "transfer-encoding") for name, _ in self.headers)
        self._until_close = not framed and status not in (204, 304)

    def on_body(self, body: bytes) -> None:
        if not self.complete:
            self.pieces.append(body)

    def on_message_complete(self) -> None:
        if self.status is not None and not self.complete:
            self._finish()

    def _finish(self) -> None:
        self.complete = True
        self.reusable = self._parser.should_keep_alive() and not self._until_close
