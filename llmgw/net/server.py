"""llmgw's HTTP/1.1 server over trio streams (requests parsed by llhttp, through ``httptools``).

A handler is ``async (Request) -> Response``. The server reads each request
whole (within :class:`Limits`), calls the handler, and writes the response:
a ``bytes`` body with ``Content-Length``, or an async iterator of ``bytes``
with chunked encoding. While a request is handled, the server watches the
client: if it goes away, the handler (or the streamed body) is cancelled and
the body iterator closed, so nothing keeps generating for nobody.

With an ``ssl_context`` every connection is wrapped in :class:`trio.SSLStream`;
a client that fails the handshake is logged and dropped, never taken for a
server error, and the peer's certificate reaches the handler as
:attr:`Request.peer_cert`.
"""

from __future__ import annotations

import json as jsonlib
import logging
import ssl
from collections.abc import Awaitable, Callable

import attrs
import trio
import trio.lowlevel

from llmgw.net._connection import write_now
from llmgw.net._h1server import (
    CONTINUE,
    BadRequest,
    BodyBudget,
    ParsedRequest,
    RequestReader,
    chunk,
    has_body,
    response_head,
)
from llmgw.net._listen import open_shared_listeners, parse_listen
from llmgw.net._memory import CONNECTION_BYTES, LARGE_BODY, MemoryReturn
from llmgw.net._records import InvalidJSON, Request, Response

__all__ = [
    "Request",
    "Response",
    "Limits",
    "HttpServer",
    "InvalidJSON",
    "ParsedRequest",
    "Precheck",
    "parse_listen",
    "serve",
]

log = logging.getLogger("llmgw.net.server")

Handler = Callable[["Request"], Awaitable["Response"]]
#: called with a request's head (no body yet): a :class:`Response` to refuse it at once, or None
Precheck = Callable[[ParsedRequest], "Response | None"]

_RECEIVE_SIZE = 64 * 1024
#: requests read ahead on a connection (pipelined) before the server stops reading it
_MAX_PIPELINED = 16
#: after refusing a request before its body: how long, and how many bytes, the body is read and dropped
_LINGER_SECONDS = 2.0
_LINGER_BYTES = 64 * 1024 * 1024


@attrs.frozen
class Limits:
    """What the server tolerates from a client. Times are in seconds."""

    #: request line plus headers
    max_header_bytes: int = 16 * 1024
    #: a larger body is answered 413
    max_body_bytes: int = 16 * 1024 * 1024
    #: request body bytes held at once across every connection (None: no cap); past it, 503
    max_buffered_bytes: int | None = None
    #: from a request's first byte until its body has arrived whole
    request_timeout: float = 30.0
    #: how long a keep-alive connection may wait for its next request
    idle_timeout: float = 30.0
    #: how long a TLS handshake may take
    handshake_timeout: float = 10.0
    #: how long one write may wait for a client that does not read
    write_timeout: float = 60.0


class _Closed(Exception):
    """The connection is over: the client left or broke the protocol."""


@attrs.define(eq=False)
class _ConnectionState:
    idle_scope: trio.CancelScope | None = None
    busy: bool = False


class _Link:
    """Between a connection's reading task and the task serving its requests."""

    __slots__ = ("reader", "arrived", "room", "gone", "handler_scope")

    def __init__(self, reader: RequestReader) -> None:
        self.reader = reader
        #: woken when bytes arrived (or the client left)
        self.arrived = trio.lowlevel.ParkingLot()
        #: woken when a read-ahead request was taken
        self.room = trio.lowlevel.ParkingLot()
        #: the client closed or broke its side
        self.gone = False
        #: the scope of the request being handled, cancelled when the client leaves
        self.handler_scope: trio.CancelScope | None = None


class HttpServer:
    """An HTTP/1.1 server for one handler; run it with :meth:`serve`."""

    def __init__(
        self,
        handler: Handler,
        *,
        ssl_context: ssl.SSLContext | None = None,
        limits: Limits = Limits(),
        reuse_port: bool = False,
        precheck: Precheck | None = None,
    ) -> None:
        #: before a request's body is read: refuse it without reading the body (see :data:`Precheck`)
        self.precheck = precheck
        #: request body bytes held across every connection, against ``limits.max_buffered_bytes``
        self.buffered = BodyBudget(limits.max_buffered_bytes)
        #: share the port with other processes (``SO_REUSEPORT``): the kernel spreads connections
        self.reuse_port = reuse_port
        self._handler = handler
        self._ssl_context = ssl_context
        self.limits = limits
        self._accepting = trio.CancelScope()
        self._connections: set[_ConnectionState] = set()
        self._closing = False
        self._nursery: trio.Nursery | None = None
        self._grace_deadline: float | None = None
        #: the (host, port) bound, once :meth:`serve` has started
        self.address: tuple[str, int] | None = None
        #: large bodies and closed connections, given back to the system a moment after a burst
        self.memory = MemoryReturn()

    @property
    def in_flight(self) -> int:
        """How many requests are being handled right now."""
        return sum(1 for state in self._connections if state.busy)

    async def serve(
        self,
        host: str,
        port: int,
        *,
        task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Bind ``host:port`` and serve until :meth:`shutdown` has run its course.

        Calls ``task_status.started((host, port))`` with the bound address once
        listening, so ``port=0`` works with ``nursery.start``. Returns when the
        server was shut down and every connection has closed.
        """
        if self.reuse_port:
            listeners = await open_shared_listeners(host, port)
        else:
            listeners = await trio.open_tcp_listeners(port, host=host)
        self.address = tuple(listeners[0].socket.getsockname()[:2])
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            if self._grace_deadline is not None:
                nursery.cancel_scope.deadline = self._grace_deadline
            nursery.start_soon(self._accept, listeners, nursery)
            task_status.started(self.address)

    def shutdown(self, grace: float) -> None:
        """Stop accepting connections and let in-flight requests finish.

        Idle keep-alive connections close at once; busy ones close after their
        current response. Whatever is still running ``grace`` seconds later is
        cancelled. Returns immediately; :meth:`serve` returns when all is done.
        """
        if self._closing:
            return
        self._closing = True
        self._accepting.cancel()
        for state in self._connections:
            if state.idle_scope is not None:
                state.idle_scope.cancel()
        self._grace_deadline = trio.current_time() + grace
        if self._nursery is not None:
            self._nursery.cancel_scope.deadline = self._grace_deadline

    async def _accept(self, listeners: list[trio.SocketListener], nursery: trio.Nursery) -> None:
        with self._accepting:
            async with trio.open_nursery() as own:
                own.start_soon(self.memory.run)
                await trio.serve_listeners(self._connection, listeners, handler_nursery=nursery)

    async def _connection(self, stream: trio.SocketStream) -> None:
        try:
            client = tuple(stream.socket.getpeername()[:2])
        except OSError:
            return
        state = _ConnectionState()
        self._connections.add(state)
        try:
            peer_cert: tuple[dict | None, bytes | None] = (None, None)
            if self._ssl_context is not None:
                stream, peer_cert = await self._handshake(stream, client)
            await self._serve_connection(stream, state, client, peer_cert)
        except (_Closed, trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        except Exception:
            log.exception("connection from %s:%s failed", *client)
        finally:
            self._connections.discard(state)
            await trio.aclose_forcefully(stream)
            self.memory.note(CONNECTION_BYTES)

    async def _handshake(self, stream: trio.SocketStream, client: tuple) -> tuple:
        ssl_stream = trio.SSLStream(stream, self._ssl_context, server_side=True, https_compatible=True)
        try:
            with trio.fail_after(self.limits.handshake_timeout):
                await ssl_stream.do_handshake()
        except (trio.BrokenResourceError, trio.TooSlowError, ssl.SSLError, OSError) as exc:
            reason = exc.__cause__ or exc
            log.info("TLS handshake with %s:%s failed: %s", *client, str(reason) or type(reason).__name__)
            raise _Closed from None
        return ssl_stream, (ssl_stream.getpeercert() or None, ssl_stream.getpeercert(binary_form=True))

    async def _serve_connection(
        self, stream: trio.abc.Stream, state: _ConnectionState, client: tuple, peer_cert: tuple
    ) -> None:
        limits = self.limits
        reader = RequestReader(
            limits.max_header_bytes, limits.max_body_bytes, budget=self.buffered, precheck=self.precheck
        )
        link = _Link(reader)
        failure: Exception | None = None
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._read, stream, link)
                try:
                    await self._serve_requests(stream, state, link, client, peer_cert)
                except (_Closed, trio.BrokenResourceError, trio.ClosedResourceError):
                    pass
                except Exception as exc:  # raised outside the nursery: no exception group
                    failure = exc
                finally:
                    nursery.cancel_scope.cancel()
        finally:
            reader.release_all()
        if failure is not None:
            raise failure

    async def _read(self, stream: trio.abc.Stream, link: _Link) -> None:
        """The connection's one reader: parses what the client sends, notices when it leaves."""
        reader = link.reader
        try:
            while True:
                while len(reader.ready) >= _MAX_PIPELINED:
                    await link.room.park()  # stop reading: the kernel applies backpressure
                data = await stream.receive_some(_RECEIVE_SIZE)
                try:
                    reader.feed(data)
                except BadRequest as exc:
                    reader.deferred = exc  # answered when the requests before it are done
                    return
                if not data or reader.upgraded:
                    break
                link.arrived.unpark_all()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            reader.closed = True
        finally:
            link.gone = reader.closed
            if link.gone and link.handler_scope is not None:
                link.handler_scope.cancel()  # the client left: stop working for it
            link.arrived.unpark_all()

    async def _serve_requests(
        self, stream: trio.abc.Stream, state: _ConnectionState, link: _Link, client: tuple, peer_cert: tuple
    ) -> None:
        reader = link.reader
        while not self._closing:
            parsed = await self._next_request(stream, state, link)
            if parsed is None:
                return
            request = Request(
                method=parsed.method,
                target=parsed.target.decode("latin-1"),
                headers=parsed.headers,
                body=parsed.body[0] if len(parsed.body) == 1 else b"".join(parsed.body),
                peer_cert=peer_cert[0],
                peer_cert_der=peer_cert[1],
                client=client,
            )
            if len(parsed.body) > 1:
                parsed.body = []  # joined into the request's body: the pieces need not stay for the exchange
            state.busy = True
            try:
                keep_alive = await self._exchange(stream, request, parsed, link)
            finally:
                state.busy = False
                if parsed.size >= LARGE_BODY:
                    self.memory.note(parsed.size)
                reader.release(parsed)
            if not keep_alive or not parsed.keep_alive or reader.upgraded:
                return

    async def _next_request(
        self, stream: trio.abc.Stream, state: _ConnectionState, link: _Link
    ) -> ParsedRequest | None:
        """The next request, read whole; None when the connection should close quietly."""
        reader = link.reader
        deadline = None
        continued = False
        try:
            while True:
                parsed = reader.take()
                if parsed is not None:
                    link.room.unpark_all()
                    return parsed
                if link.gone or reader.upgraded:
                    return None
                if reader.idle:
                    with trio.CancelScope() as idle:
                        state.idle_scope = idle
                        idle.deadline = trio.current_time() + self.limits.idle_timeout
                        await link.arrived.park()
                    state.idle_scope = None
                    if idle.cancelled_caught:
                        return None  # idle for too long, or the server is shutting down
                    continue
                if deadline is None:
                    deadline = trio.current_time() + self.limits.request_timeout
                current = reader.current
                if current is not None and current.expects_continue and not continued:
                    continued = True
                    await self._send_all(stream, CONTINUE)
                with trio.move_on_at(deadline) as waited:
                    await link.arrived.park()
                if waited.cancelled_caught and not reader.ready and not link.gone:
                    raise trio.TooSlowError
        except trio.TooSlowError:
            await self._send_raw_error(stream, 408, "request not received in time")
            raise _Closed from None
        except BadRequest as exc:
            if exc.response is not None:
                await self._send_refusal(stream, exc.response)
            else:
                await self._send_raw_error(stream, exc.status, exc.message)
            await _linger(stream)
            raise _Closed from None

    async def _exchange(
        self, stream: trio.abc.Stream, request: Request, parsed: ParsedRequest, link: _Link
    ) -> bool:
        """Handle one request, cancelled if the client leaves; True to keep the connection."""
        outcome = {"client_gone": False, "started": False, "failed": False, "complete": False}
        response: Response | None = None
        try:
            with trio.CancelScope() as scope:
                link.handler_scope = scope
                if link.gone:
                    scope.cancel()
                try:
                    response = await self._handler(request)
                    await self._send_response(stream, request, parsed, response, outcome)
                except (_Closed, trio.BrokenResourceError, trio.ClosedResourceError):
                    outcome["client_gone"] = True
                except Exception:
                    log.exception("handling %s %s failed", request.method, request.path)
                    outcome["failed"] = True
            link.handler_scope = None
            if scope.cancelled_caught:
                outcome["client_gone"] = True
        finally:
            link.handler_scope = None
            if response is not None and response.after is not None:
                try:
                    response.after()
                except Exception:
                    log.exception("after-response callback failed on %s", request.path)
        if outcome["failed"] and not outcome["started"]:
            await self._send_raw_error(stream, 500, "internal server error")
        return outcome["complete"] and not (outcome["client_gone"] or outcome["failed"])

    async def _send_response(
        self,
        stream: trio.abc.Stream,
        request: Request,
        parsed: ParsedRequest,
        response: Response,
        outcome: dict,
    ) -> None:
        body = response.body
        status = response.status
        with_body = has_body(request.method, status)
        close = self._closing or not parsed.keep_alive
        if isinstance(body, bytes | bytearray):
            head = response_head(status, response.headers, length=len(body), chunked=False, close=close)
            outcome["started"] = True
            # One write for head and body: one system call, no trip through the scheduler when it fits.
            await self._send_all(stream, head + body if body and with_body else head)
            outcome["complete"] = True
            return
        chunked = parsed.http11  # an HTTP/1.0 client reads the body until the connection closes
        head = response_head(
            status, response.headers, length=None, chunked=chunked, close=close or not chunked
        )
        await self._send_all(stream, head)
        outcome["started"] = True
        try:
            async for piece in body:
                if piece and with_body:
                    await self._send_all(stream, chunk(piece) if chunked else piece)
        finally:
            aclose = getattr(body, "aclose", None)
            if aclose is not None:
                await aclose()
        if chunked and with_body:
            await self._send_all(stream, b"0\r\n\r\n")
        outcome["complete"] = chunked

    async def _send_all(self, stream: trio.abc.Stream, data: bytes) -> None:
        data = write_now(stream, data)
        if data:
            with trio.move_on_after(self.limits.write_timeout) as timeout:
                await stream.send_all(data)
            if timeout.cancelled_caught:
                raise _Closed(f"client read nothing for {self.limits.write_timeout:g}s")

    async def _send_refusal(self, stream: trio.abc.Stream, response: Response) -> None:
        """Send a pre-check's refusal (a bytes body), then its ``after``; the connection closes: its body
        was never read."""
        body = response.body if isinstance(response.body, bytes) else b""
        head = response_head(response.status, response.headers, length=len(body), chunked=False, close=True)
        with trio.move_on_after(self.limits.write_timeout):
            try:
                await stream.send_all(head + body)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
        if response.after is not None:
            response.after()

    async def _send_raw_error(self, stream: trio.abc.Stream, status: int, message: str) -> None:
        """Answer a request refused before its handler (a 503 asks to retry in a second); then close."""
        kind = "server_error" if status >= 500 else "invalid_request_error"
        error = {"message": message, "type": kind, "param": None, "code": None}
        headers = [("content-type", "application/json")]
        if status == 503:
            headers.append(("retry-after", "1"))
        await self._send_refusal(stream, Response(status, headers, jsonlib.dumps({"error": error}).encode()))


async def _linger(stream: trio.abc.Stream) -> None:
    """After refusing a request whose body was not read: read and drop what the client still sends, a while.

    Closing at once, with unread bytes in the socket, would reset the connection, and many
    clients would then report the reset instead of the answer they were sent.
    """
    with trio.move_on_after(_LINGER_SECONDS):
        try:
            if hasattr(stream, "send_eof"):
                await stream.send_eof()
            dropped = 0
            while dropped < _LINGER_BYTES:
                data = await stream.receive_some(_RECEIVE_SIZE)
                if not data:
                    return
                dropped += len(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass


async def serve(
    handler: Handler,
    host: str,
    port: int,
    *,
    ssl_context: ssl.SSLContext | None = None,
    limits: Limits = Limits(),
    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``handler`` on ``host:port`` until cancelled.

    A shorthand for ``HttpServer(handler, ...).serve(host, port)``; build an
    :class:`HttpServer` yourself to shut it down gracefully.
    """
    server = HttpServer(handler, ssl_context=ssl_context, limits=limits)
    await server.serve(host, port, task_status=task_status)
