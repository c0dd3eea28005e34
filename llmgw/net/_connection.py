"""The HTTP client's errors and one pooled connection, for :mod:`llmgw.net.client`.

:class:`HttpClientError` and its kinds are what a request can fail with below
HTTP; :class:`_Connection` is one keep-alive HTTP/1.1 connection to one origin
(``scheme``, ``host``, ``port``), with the helpers that name it in messages.
Import the errors from :mod:`llmgw.net.client`.
"""

from __future__ import annotations

import os
import select
from typing import Any
from urllib.parse import urlsplit

import trio
import trio.lowlevel

__all__ = [
    "ConnectError",
    "HttpClientError",
    "Origin",
    "ReadTimeout",
    "RemoteProtocolError",
    "ResponseTooLarge",
]

Origin = tuple[str, str, int]


class HttpClientError(Exception):
    """A request failed below HTTP: the upstream could not be reached or broke the exchange."""


class ConnectError(HttpClientError):
    """No connection could be opened (refused, unreachable, too slow, TLS failed); nothing was sent."""


class RemoteProtocolError(HttpClientError):
    """The upstream closed the connection or broke HTTP/1.1 during the exchange.

    ``response_started`` says whether the response head had already arrived.
    """

    def __init__(self, message: str, *, response_started: bool) -> None:
        super().__init__(message)
        self.response_started = response_started


class ReadTimeout(RemoteProtocolError):
    """The upstream sent nothing for the pool's ``read_timeout`` (the connection is closed)."""


class ResponseTooLarge(HttpClientError):
    """A body read with :meth:`ClientResponse.read` went over its ``limit``."""


class _Connection:
    """One HTTP/1.1 connection to one origin; used by one request at a time."""

    __slots__ = ("origin", "stream", "reader", "spare", "idle_since", "sock", "reused")

    def __init__(self, origin: Origin, stream: trio.abc.Stream, sock: Any) -> None:
        self.origin = origin
        self.stream = stream
        #: the response being read on it (:class:`llmgw.net._h1client.ResponseReader`), if any
        self.reader: Any = None
        #: the last response's reader, kept to parse the next one
        self.spare: Any = None
        self.idle_since = 0.0
        #: the plain socket, to check an idle TCP connection; None on TLS, where a session ticket
        #: arriving after the handshake would look like the upstream talking
        self.sock = sock
        self.reused = False

    def dead_while_idle(self) -> bool:
        """Whether the upstream closed (or wrote to) this idle connection: it cannot carry a request."""
        if self.sock is None:
            return False
        try:
            poller = select.poll()
            poller.register(self.sock.fileno(), select.POLLIN)
            return bool(poller.poll(0))
        except (OSError, ValueError):
            return True

    def close(self) -> None:
        """Close at once (no TLS goodbye): nothing more is read or written on it."""
        sock = self.sock
        if sock is None:
            sock = getattr(getattr(self.stream, "transport_stream", None), "socket", None)
        if sock is not None:
            sock.close()  # trio's socket close wakes any task waiting on it


_DEFAULT_PORTS = {"http": 80, "https": 443}


def _origin_of(parts: Any, url: str) -> Origin:
    scheme = parts.scheme
    if scheme not in _DEFAULT_PORTS or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    return scheme, parts.hostname, parts.port or _DEFAULT_PORTS[scheme]


def _origin(url: str) -> Origin:
    return _origin_of(urlsplit(url), url)


def _where(connection: _Connection) -> str:
    scheme, host, port = connection.origin
    return f"{scheme}://{host}:{port}"


def _describe(exc: BaseException) -> str:
    cause = exc.__cause__ or exc.__context__
    if isinstance(exc, trio.BrokenResourceError) and cause is not None:
        exc = cause
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__


def write_now(stream: trio.abc.Stream, data: bytes) -> bytes | memoryview:
    """Write what the kernel takes at once to a plain TCP ``stream``; returns what is left to send.

    The common case, a socket with room in its buffer, costs one system call and no trip through
    trio's scheduler. A TLS stream, a full buffer or an error returns ``data`` (or its rest) for
    ``stream.send_all``, which then waits or raises as usual.
    """
    sock = getattr(stream, "socket", None)
    if sock is None:
        return data
    try:
        sent = os.write(sock.fileno(), data)
    except OSError:
        return data
    return memoryview(data)[sent:] if sent < len(data) else b""
