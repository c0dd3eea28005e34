"""llmgw's HTTP/1.1 client over trio streams (responses parsed by llhttp, through ``httptools``), with
keep-alive connections pooled per upstream.

:class:`ConnectionPool` opens at most one connection per request in flight,
keeps up to ``max_idle_per_host`` idle connections for each upstream
(``scheme://host:port``), and hands back a :class:`ClientResponse` as soon as
the response head has arrived: its body is read chunk by chunk, as the
upstream sends it, so a proxy can pass server-sent events through without
waiting for the end.

A connection goes back to the pool only after its response was read to the
end on a connection both sides keep alive. A response closed early, a
request cancelled at any point, or an error of any kind closes the
connection instead: nothing half-read is ever reused. A plain TCP connection
idle for a second or more is checked before reuse (did the upstream close
it?), and a request whose reused connection turns out dead before any byte
of the response arrived is sent once more on a new connection.

Deadlines belong to the caller (``trio.fail_after`` around the call), except
two properties of the pool, both protocol edges: the connect timeout and the
read timeout (the longest wait for any data from the upstream: the response
head, or the next piece of the body; :class:`ReadTimeout`). ``https``
upstreams are reached over :class:`trio.SSLStream` with the pool's
``ssl_context``.

The errors and the connection itself are in :mod:`llmgw.net._connection`;
import them from here.
"""

from __future__ import annotations

import json as jsonlib
import ssl
from collections import deque
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import urlsplit

import attrs
import trio
import trio.lowlevel

from llmgw.net._connection import (
    ConnectError,
    HttpClientError,
    Origin,
    ReadTimeout,
    RemoteProtocolError,
    ResponseTooLarge,
    _Connection,
    _describe,
    _origin,
    _origin_of,
    _where,
    write_now,
)
from llmgw.net._h1client import BrokenResponse, ResponseReader, request_head

__all__ = [
    "ClientResponse",
    "ConnectionPool",
    "HttpClientError",
    "ConnectError",
    "RemoteProtocolError",
    "ReadTimeout",
    "ResponseTooLarge",
]

_RECEIVE_SIZE = 64 * 1024


class ClientResponse:
    """A response whose head has arrived; read its body, then :meth:`close` it.

    Use it as an async context manager, or call :meth:`close` in a
    ``finally``: an unfinished response closes its connection.
    """

    def __init__(self, pool: ConnectionPool, connection: _Connection, reader: ResponseReader) -> None:
        self._pool = pool
        self._connection: _Connection | None = connection
        self._reader = reader
        #: the status code
        self.status: int = reader.status
        #: the reason phrase
        self.reason: str = reader.reason
        #: (lowercase name, value) pairs in the order received
        self.headers: list[tuple[str, str]] = reader.headers
        #: the body, once :meth:`read` has returned it
        self.content: bytes | None = None
        self.complete = False

    def header(self, name: str) -> str | None:
        """The first value of header ``name`` (any case), or None if absent."""
        name = name.lower()
        return next((value for key, value in self.headers if key == name), None)

    async def receive_chunk(self) -> bytes | None:
        """The body's next bytes, as soon as some have arrived; None at its end.

        Waits only when nothing has arrived yet: pieces the upstream wrote
        separately that are already here come back as one, so a proxy makes
        fewer, larger writes without ever holding data back.

        :raises RemoteProtocolError: when the upstream closes or breaks the connection mid-body
            (:class:`ReadTimeout` when it sends nothing for the pool's read timeout).
        """
        connection = self._connection
        if connection is None:
            return None
        reader = self._reader
        try:
            while not reader.pieces and not reader.complete:
                await self._pool._receive(connection, True)
        except BrokenResponse as exc:
            self._abort()
            raise RemoteProtocolError(
                f"{_where(connection)} broke the response body: {exc}", response_started=True
            ) from None
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            self._abort()
            raise RemoteProtocolError(
                f"connection to {_where(connection)} lost mid-body: {_describe(exc)}", response_started=True
            ) from None
        except BaseException:
            self._abort()
            raise
        pieces = reader.pieces
        if reader.complete:
            self.complete = True
            self._release()
            if not pieces:
                return None
        reader.pieces = []
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while (chunk := await self.receive_chunk()) is not None:
            yield chunk

    async def read(self, limit: int | None = None) -> bytes:
        """The whole body (also kept as :attr:`content`).

        :raises ResponseTooLarge: when it is longer than ``limit`` bytes (the connection is closed).
        """
        parts = []
        size = 0
        while (chunk := await self.receive_chunk()) is not None:
            size += len(chunk)
            if limit is not None and size > limit:
                self._abort()
                raise ResponseTooLarge(f"response body longer than {limit} bytes")
            parts.append(chunk)
        self.content = b"".join(parts)
        return self.content

    def json(self) -> Any:
        """:attr:`content` parsed as JSON (call :meth:`read` first)."""
        if self.content is None:
            raise RuntimeError("read() the body before json()")
        return jsonlib.loads(self.content)

    def close(self) -> None:
        """Give the connection back when the body was read whole, otherwise close it; at once.

        Safe to call more than once, and from code that cannot wait (a cleanup callback).
        """
        if self.complete:
            self._release()
        else:
            self._abort()

    async def aclose(self) -> None:
        """:meth:`close`, as an awaitable (a checkpoint)."""
        self.close()
        await trio.lowlevel.checkpoint()

    def _release(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            self._pool._give_back(connection)

    def _abort(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.close()

    async def __aenter__(self) -> ClientResponse:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()


@attrs.define(eq=False, kw_only=True)
class ConnectionPool:
    """Keep-alive HTTP/1.1 connections to any number of upstreams.

    :param max_idle_per_host: idle connections kept per origin; more are closed when released.
    :param connect_timeout: seconds a TCP connect (and TLS handshake) may take.
    :param read_timeout: seconds to wait for any data from the upstream (None: no limit).
    :param idle_timeout: an idle connection older than this is closed rather than reused.
    :param ssl_context: for ``https://`` URLs (their host name is checked against the certificate).

    Use it as an async context manager (idle connections close on exit) or call :meth:`aclose`.
    The pool starts no tasks.
    """

    max_idle_per_host: int = 16
    connect_timeout: float = 5.0
    read_timeout: float | None = None
    idle_timeout: float = 20.0
    ssl_context: ssl.SSLContext | None = None
    _idle: dict[Origin, deque[_Connection]] = attrs.field(factory=dict, init=False)
    _targets: dict[str, tuple[Origin, str, str]] = attrs.field(factory=dict, init=False)
    _closed: bool = attrs.field(default=False, init=False)
    #: connections opened so far (for tests and metrics)
    connections_opened: int = attrs.field(default=0, init=False)

    def idle_count(self, url: str | None = None) -> int:
        """Idle connections in the pool: for ``url``'s origin, or in all."""
        if url is None:
            return sum(len(idle) for idle in self._idle.values())
        return len(self._idle.get(_origin(url), ()))

    async def send(
        self,
        method: str,
        url: str,
        *,
        headers: Iterable[tuple[str, str]] = (),
        body: bytes = b"",
        watch: Any = None,
    ) -> ClientResponse:
        """Send one request and return once the response head has arrived.

        The caller reads the body from the returned response and must
        :meth:`~ClientResponse.close` it (or use :meth:`stream`). ``body``
        goes with ``Content-Length``; ``Host`` is added unless given.

        ``watch``, when given, lets another task end the exchange without a cancel scope
        (which costs more than the rest of a proxied request): the pool sets
        ``watch.connection`` to the connection carrying the request and closes it at once
        when ``watch.why`` is set; whoever sets ``why`` closes ``watch.connection``. The
        request then fails with :class:`RemoteProtocolError` and is never sent again.

        :raises ConnectError: when no connection could be made.
        :raises RemoteProtocolError: when the upstream closed or broke the connection before answering.
        """
        if self._closed:
            raise RuntimeError("the connection pool is closed")
        parsed = self._targets.get(url)
        if parsed is None:
            parsed = self._parse(url)
        origin, target, netloc = parsed
        head_headers = list(headers)
        if not any(name.lower() == "host" for name, _ in head_headers):
            head_headers.insert(0, ("host", netloc))
        length = len(body) if body or method not in ("GET", "HEAD") else None
        request = request_head(method, target, head_headers, length)
        if body:
            request += body
        while True:
            connection = self._checkout(origin)
            if connection is None:
                connection = await self._connect(origin)
            if watch is not None:
                watch.connection = connection
                if watch.why is not None:
                    connection.close()
            try:
                return await self._exchange(connection, request, method)
            except RemoteProtocolError as exc:
                if not connection.reused or exc.response_started or isinstance(exc, ReadTimeout):
                    raise
                if watch is not None and watch.why is not None:
                    raise
                # the upstream closed this kept-alive connection before answering: try a new one

    @asynccontextmanager
    async def stream(
        self,
        method: str,
        url: str,
        *,
        headers: Iterable[tuple[str, str]] = (),
        body: bytes = b"",
    ) -> AsyncIterator[ClientResponse]:
        """:meth:`send` as an async context manager that closes the response on exit."""
        response = await self.send(method, url, headers=headers, body=body)
        try:
            yield response
        finally:
            response.close()

    async def request(
        self,
        method: str,
        url: str,
        *,
        headers: Iterable[tuple[str, str]] = (),
        body: bytes = b"",
        limit: int | None = None,
    ) -> ClientResponse:
        """Send one request and read its whole body (see :meth:`ClientResponse.read` for ``limit``)."""
        async with self.stream(method, url, headers=headers, body=body) as response:
            await response.read(limit)
        return response

    def retain_only(self, urls: Iterable[str]) -> int:
        """Close the idle connections to every origin but those of ``urls``; returns how many."""
        keep = {_origin(url) for url in urls}
        closed = 0
        for origin in [origin for origin in self._idle if origin not in keep]:
            for connection in self._idle.pop(origin):
                connection.close()
                closed += 1
        return closed

    async def aclose(self) -> None:
        """Close every idle connection; responses in progress close theirs when done."""
        self._closed = True
        idle, self._idle = self._idle, {}
        for connections in idle.values():
            for connection in connections:
                connection.close()  # nothing is in flight on them: no need to wait, even when cancelled
        await trio.lowlevel.checkpoint()

    async def __aenter__(self) -> ConnectionPool:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # -- internals -------------------------------------------------------------------------------

    def _parse(self, url: str) -> tuple[Origin, str, str]:
        parts = urlsplit(url)
        parsed = (
            _origin_of(parts, url),
            (parts.path or "/") + (f"?{parts.query}" if parts.query else ""),
            parts.netloc,
        )
        if len(self._targets) >= 4096:
            self._targets.clear()
        self._targets[url] = parsed
        return parsed

    async def _receive(self, connection: _Connection, response_started: bool) -> None:
        """Feed the next bytes from the upstream to the response's reader, within the read timeout."""
        if self.read_timeout is None:
            connection.reader.feed(await connection.stream.receive_some(_RECEIVE_SIZE))
            return
        with trio.CancelScope(deadline=trio.current_time() + self.read_timeout) as scope:
            connection.reader.feed(await connection.stream.receive_some(_RECEIVE_SIZE))
        if scope.cancelled_caught:
            raise ReadTimeout(
                f"{_where(connection)} sent nothing for {self.read_timeout:g}s",
                response_started=response_started,
            )

    def _checkout(self, origin: Origin) -> _Connection | None:
        idle = self._idle.get(origin)
        if not idle:
            return None
        now = trio.current_time()
        while idle:
            connection = idle.pop()  # the most recently used: the least likely to have timed out
            idle_for = now - connection.idle_since
            # A connection used this very second is taken as it is (a dead one is found on use and the
            # request sent again on a new one); an older one is checked first, which costs a syscall.
            if idle_for < self.idle_timeout and (idle_for < 1.0 or not connection.dead_while_idle()):
                connection.reused = True
                return connection
            connection.close()
        return None

    def _give_back(self, connection: _Connection) -> None:
        reader, connection.reader = connection.reader, None
        if self._closed or reader is None or not reader.complete or not reader.reusable:
            connection.close()
            return
        connection.spare = reader if reader.parser_reusable else None
        idle = self._idle.setdefault(connection.origin, deque())
        if len(idle) >= self.max_idle_per_host:
            connection.close()
            return
        connection.idle_since = trio.current_time()
        idle.append(connection)

    async def _connect(self, origin: Origin) -> _Connection:
        scheme, host, port = origin
        where = f"{scheme}://{host}:{port}"
        try:
            with trio.fail_after(self.connect_timeout):
                tcp = await trio.open_tcp_stream(host, port)
                if scheme != "https":
                    self.connections_opened += 1
                    return _Connection(origin, tcp, tcp.socket)
                context = self.ssl_context or ssl.create_default_context()
                stream = trio.SSLStream(tcp, context, server_hostname=host, https_compatible=True)
                try:
                    await stream.do_handshake()
                except BaseException:
                    await trio.aclose_forcefully(tcp)
                    raise
                self.connections_opened += 1
                return _Connection(origin, stream, None)
        except trio.TooSlowError:
            raise ConnectError(f"could not connect to {where} within {self.connect_timeout:g}s") from None
        except (OSError, trio.BrokenResourceError, ssl.SSLError) as exc:
            raise ConnectError(f"could not connect to {where}: {_describe(exc)}") from None

    async def _exchange(self, connection: _Connection, request: bytes, method: str) -> ClientResponse:
        reader, connection.spare = connection.spare, None
        if reader is None:
            reader = ResponseReader(method)
        else:
            reader.restart(method)
        connection.reader = reader
        try:
            data = write_now(connection.stream, request)
            if data:
                await connection.stream.send_all(data)
            while reader.status is None:
                await self._receive(connection, False)
            return ClientResponse(self, connection, reader)
        except BrokenResponse as exc:
            connection.close()
            if str(exc) == "the connection closed":
                message = f"{_where(connection)} closed the connection before answering"
            else:
                message = f"{_where(connection)} broke HTTP/1.1 before answering: {exc}"
            raise RemoteProtocolError(message, response_started=False) from None
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            connection.close()
            raise RemoteProtocolError(
                f"connection to {_where(connection)} lost before its answer: {_describe(exc)}",
                response_started=False,
            ) from None
        except BaseException:
            connection.close()
            raise
