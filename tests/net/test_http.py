"""llmgw.net.server over real sockets on 127.0.0.1."""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import pytest
import trio
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from llmgw.net.server import HttpServer, InvalidJSON, Limits, Request, Response
from llmgw.testing.gateway import EndlessStream, HeldStream, streaming

HOST = "127.0.0.1"


async def echo(request: Request) -> Response:
    """Answer with what the server understood of the request."""
    return Response.json(
        200,
        {
            "method": request.method,
            "path": request.path,
            "query": request.query,
            "body": request.body.decode(),
            "client_port": request.client[1],
            "peer_cert": request.peer_cert,
        },
    )


async def start_server(nursery: trio.Nursery, handler=echo, **kwargs) -> tuple[HttpServer, str]:
    server = HttpServer(handler, **kwargs)
    host, port = await nursery.start(server.serve, HOST, 0)
    scheme = "https" if kwargs.get("ssl_context") else "http"
    return server, f"{scheme}://{host}:{port}"


async def serve_until_shutdown(
    nursery: trio.Nursery, handler
) -> tuple[HttpServer, tuple[str, int], trio.Event]:
    """Serve ``handler`` on HOST in ``nursery`` for a test that shuts the server down.

    :returns: the server, its address, and an event set once ``serve()`` returned.
    """
    server = HttpServer(handler)
    stopped = trio.Event()

    async def run_server(task_status=trio.TASK_STATUS_IGNORED):
        await server.serve(HOST, 0, task_status=task_status)
        stopped.set()

    address = await nursery.start(run_server)
    return server, address, stopped


def never_answers() -> tuple[Callable[[Request], Awaitable[Response]], trio.Event, trio.Event]:
    """A handler that waits forever, and its two events: a request ``entered`` it, it was ``cancelled``."""
    entered, cancelled = trio.Event(), trio.Event()

    async def handler(request: Request) -> Response:
        entered.set()
        try:
            await trio.sleep_forever()
        finally:
            cancelled.set()

    return handler, entered, cancelled


async def raw_exchange(address: tuple[str, int], data: bytes) -> bytes:
    """Send ``data`` on a new connection and read until the server closes it."""
    stream = await trio.open_tcp_stream(*address)
    async with stream:
        await stream.send_all(data)
        received = b""
        with trio.fail_after(5):
            while chunk := await stream.receive_some():
                received += chunk
    return received


class TestRequest:
    """The Request record."""

    def test_header_lookup_ignores_case(self):
        """header() finds a header whatever the case of the name asked for."""
        request = Request("GET", "/", headers=[("X-Thing", "1")])
        assert request.header("x-thing") == "1"
        assert request.header("X-THING") == "1"
        assert request.header("missing") is None

    def test_bad_json_raises_invalid_json(self):
        """json() on a body that is not JSON raises InvalidJSON with a message."""
        with pytest.raises(InvalidJSON, match="not valid JSON"):
            Request("POST", "/", body=b"{nope").json()

    def test_path_and_query(self):
        """path drops the query string; query parses it."""
        request = Request("GET", "/a/b?x=1&y=2")
        assert request.path == "/a/b"
        assert request.query == {"x": "1", "y": "2"}


class TestServing:
    """Requests, keep-alive and errors over plain TCP."""

    async def test_keep_alive_reuses_one_connection(self, nursery):
        """Several requests from one client travel over one connection."""
        _, url = await start_server(nursery)
        async with httpx.AsyncClient(base_url=url) as client:
            answers = [(await client.post("/echo?x=1", content=f"body {i}")).json() for i in range(3)]
        assert {answer["client_port"] for answer in answers} == {answers[0]["client_port"]}
        assert answers[2] == {
            "method": "POST",
            "path": "/echo",
            "query": {"x": "1"},
            "body": "body 2",
            "client_port": answers[0]["client_port"],
            "peer_cert": None,
        }

    async def test_garbage_gets_400_and_close(self, nursery):
        """A request line that is not HTTP is answered 400 and the connection closed."""
        server, _ = await start_server(nursery)
        received = await raw_exchange(server.address, b"this is not http\r\n\r\n")
        assert received.startswith(b"HTTP/1.1 400 ")

    async def test_oversized_body_gets_413(self, nursery):
        """A body over the limit is refused with 413, by Content-Length or while chunked."""
        server, url = await start_server(nursery, limits=Limits(max_body_bytes=100))
        async with httpx.AsyncClient(base_url=url) as client:
            assert (await client.post("/", content=b"x" * 101)).status_code == 413
            assert (await client.post("/", content=b"x" * 100)).status_code == 200
        chunked = b"POST / HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
        chunked += b"c8\r\n" + b"x" * 200 + b"\r\n0\r\n\r\n"
        assert (await raw_exchange(server.address, chunked)).startswith(b"HTTP/1.1 413 ")

    async def test_oversized_headers_get_431(self, nursery):
        """Headers over the limit are refused with 431."""
        server, _ = await start_server(nursery, limits=Limits(max_header_bytes=1024))
        request = b"GET / HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 2048 + b"\r\n\r\n"
        assert (await raw_exchange(server.address, request)).startswith(b"HTTP/1.1 431 ")

    async def test_handler_error_gets_500_and_server_goes_on(self, nursery):
        """A handler that raises yields a 500; the next request is served."""

        async def handler(request: Request) -> Response:
            if request.path == "/boom":
                raise RuntimeError("boom")
            return Response.text(200, "fine")

        _, url = await start_server(nursery, handler)
        async with httpx.AsyncClient(base_url=url) as client:
            assert (await client.get("/boom")).status_code == 500
            assert (await client.get("/")).text == "fine"

    async def test_pipelined_requests_are_answered_in_order(self, nursery):
        """Two requests sent in one write get two responses, in order, on the same connection."""
        server, _ = await start_server(nursery)
        first = b"GET /first HTTP/1.1\r\nhost: x\r\n\r\n"
        second = b"GET /second HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
        received = await raw_exchange(server.address, first + second)
        assert received.count(b"HTTP/1.1 200 ") == 2
        assert received.index(b'"/first"') < received.index(b'"/second"')

    async def test_idle_connection_closed_after_idle_timeout(self, nursery):
        """A connection that sends nothing is closed after the idle timeout."""
        server, _ = await start_server(nursery, limits=Limits(idle_timeout=0.1))
        assert await raw_exchange(server.address, b"") == b""

    async def test_after_runs_once_response_is_sent(self, nursery):
        """Response.after is called when the exchange is over."""
        done = trio.Event()

        async def handler(request: Request) -> Response:
            return Response(200, body=b"ok", after=done.set)

        _, url = await start_server(nursery, handler)
        async with httpx.AsyncClient(base_url=url) as client:
            assert (await client.get("/")).text == "ok"
        with trio.fail_after(5):
            await done.wait()


class TestStreaming:
    """Streamed bodies and clients that go away."""

    async def test_chunks_arrive_before_stream_ends(self, nursery):
        """The first chunk reaches the client while the body is still being produced."""
        held = HeldStream(b"data: one\n\n", b"data: two\n\n")
        _, url = await start_server(nursery, streaming(held))
        received = []
        with trio.fail_after(5):
            async with httpx.AsyncClient(base_url=url) as client, client.stream("GET", "/") as response:
                assert response.headers["content-type"] == "text/event-stream"
                async for chunk in response.aiter_raw():
                    received.append(chunk)
                    held.release()
        assert b"".join(received) == b"data: one\n\ndata: two\n\n"

    async def test_client_disconnect_stops_the_body(self, nursery):
        """When the client goes away mid-stream, the body iterator is closed and stops."""
        chunks = EndlessStream(b"data: tick\n\n")
        _, url = await start_server(nursery, streaming(chunks))
        async with httpx.AsyncClient(base_url=url) as client, client.stream("GET", "/") as response:
            async for _ in response.aiter_raw():
                break
        with trio.fail_after(5):
            await chunks.stopped.wait()
        stopped_at = chunks.sent
        await trio.sleep(0.1)
        assert chunks.sent == stopped_at

    async def test_body_error_mid_stream_cuts_the_response_only(self, nursery):
        """A body iterator that raises ends that response early; the server serves the next client."""

        async def chunks():
            yield b"data: one\n\n"
            raise RuntimeError("generator broke")

        async def handler(request: Request) -> Response:
            if request.path == "/broken":
                return Response.stream(200, chunks())
            return Response.text(200, "fine")

        _, url = await start_server(nursery, handler)
        async with httpx.AsyncClient(base_url=url) as client:
            with pytest.raises(httpx.RemoteProtocolError):
                await client.get("/broken")
            assert (await client.get("/")).text == "fine"

    async def test_client_disconnect_cancels_a_waiting_handler(self, nursery):
        """A handler still computing its response is cancelled when the client leaves."""
        handler, entered, cancelled = never_answers()

        server, _ = await start_server(nursery, handler)
        stream = await trio.open_tcp_stream(*server.address)
        await stream.send_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        with trio.fail_after(5):
            await entered.wait()
            await stream.aclose()
            await cancelled.wait()


class TestShutdown:
    """Graceful shutdown."""

    async def test_in_flight_request_finishes(self, nursery):
        """Shutdown stops accepting, closes idle connections, and lets a busy one finish."""
        entered, release = trio.Event(), trio.Event()

        async def handler(request: Request) -> Response:
            if request.path == "/slow":
                entered.set()
                await release.wait()
            return Response.text(200, request.path)

        server, address, stopped = await serve_until_shutdown(nursery, handler)
        url = f"http://{address[0]}:{address[1]}"
        idle = await trio.open_tcp_stream(*address)
        await idle.send_all(b"GET /idle HTTP/1.1\r\nhost: x\r\n\r\n")
        received = b""
        while not received.endswith(b"/idle"):
            received += await idle.receive_some()
        assert received.startswith(b"HTTP/1.1 200 ")

        answers = []

        async def slow_request():
            async with httpx.AsyncClient() as client:
                answers.append(await client.get(f"{url}/slow"))

        nursery.start_soon(slow_request)
        with trio.fail_after(5):
            await entered.wait()
            assert server.in_flight == 1
            server.shutdown(grace=30)
            assert await idle.receive_some() == b""  # the idle keep-alive connection is closed
            with pytest.raises(OSError):
                await trio.open_tcp_stream(*address)
            release.set()
            await stopped.wait()
        assert answers[0].status_code == 200
        assert answers[0].headers["connection"] == "close"

    async def test_grace_period_cancels_what_remains(self, nursery):
        """A request still running when the grace period ends is cancelled and serve() returns."""
        handler, entered, cancelled = never_answers()

        server, address, stopped = await serve_until_shutdown(nursery, handler)
        stream = await trio.open_tcp_stream(*address)
        await stream.send_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        with trio.fail_after(5):
            await entered.wait()
            server.shutdown(grace=0.1)
            await cancelled.wait()
            await stopped.wait()
            assert await stream.receive_some() == b""


# --- TLS -------------------------------------------------------------------------------------


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _certificate(subject: str, key, issuer: str, issuer_key, *, ca: bool, ip: str | None = None):
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(_name(issuer))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ip:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(ip))]), critical=False
        )
    return builder.sign(issuer_key, hashes.SHA256())


def _write_pair(directory: Path, stem: str, cert, key) -> tuple[Path, Path]:
    cert_path, key_path = directory / f"{stem}.crt", directory / f"{stem}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, Path]:
    """A throwaway CA, a server certificate for 127.0.0.1, a client of that CA and a client of another."""
    paths = {}
    ca_key, rogue_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = _certificate("test-ca", ca_key, "test-ca", ca_key, ca=True)
    rogue_ca = _certificate("rogue-ca", rogue_key, "rogue-ca", rogue_key, ca=True)
    paths["ca"], _ = _write_pair(tmp_path, "ca", ca, ca_key)
    for stem, subject, issuer, issuer_key, ip in [
        ("server", "server", "test-ca", ca_key, HOST),
        ("client", "node-1", "test-ca", ca_key, None),
        ("rogue", "node-evil", "rogue-ca", rogue_key, None),
    ]:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _certificate(subject, key, issuer, issuer_key, ca=False, ip=ip)
        if stem == "rogue":
            chain = cert.public_bytes(serialization.Encoding.PEM)
            chain += rogue_ca.public_bytes(serialization.Encoding.PEM)
        paths[f"{stem}_cert"], paths[f"{stem}_key"] = _write_pair(tmp_path, stem, cert, key)
        if stem == "rogue":
            paths["rogue_cert"].write_bytes(chain)
    return paths


def _client_context(pki: dict[str, Path], who: str | None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(pki["ca"]))
    if who:
        context.load_cert_chain(pki[f"{who}_cert"], pki[f"{who}_key"])
    return context


class TestTLS:
    """Mutual TLS."""

    async def test_bad_clients_do_not_take_the_server_down(self, nursery, pki):
        """Clients without a certificate, with a foreign one, or speaking plain HTTP fail alone."""
        server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(pki["ca"]))
        server_context.verify_mode = ssl.CERT_REQUIRED
        server_context.load_cert_chain(pki["server_cert"], pki["server_key"])
        server, url = await start_server(nursery, ssl_context=server_context)

        for who in (None, "rogue"):
            with pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)):
                async with httpx.AsyncClient(verify=_client_context(pki, who)) as client:
                    await client.get(f"{url}/")
        assert await raw_exchange(server.address, b"GET / HTTP/1.1\r\nhost: x\r\n\r\n") == b""

        async with httpx.AsyncClient(verify=_client_context(pki, "client")) as client:
            answer = (await client.get(f"{url}/who")).json()
        assert dict(pair[0] for pair in answer["peer_cert"]["subject"])["commonName"] == "node-1"
