"""llmgw.net.client against llmgw.net.server servers (and raw sockets where a server must misbehave)."""

from __future__ import annotations

import functools

import pytest
import trio
import trio.lowlevel
import trio.testing

from llmgw.net.client import ConnectError, ConnectionPool, ReadTimeout, RemoteProtocolError, ResponseTooLarge
from llmgw.net.server import HttpServer, Request, Response
from llmgw.pki import server_ssl_context
from llmgw.testing.gateway import EndlessStream, HeldStream, streaming
from llmgw.testing.processes import free_port

HOST = "127.0.0.1"


async def start(nursery: trio.Nursery, handler, **kwargs) -> str:
    server = HttpServer(handler, **kwargs)
    host, port = await nursery.start(server.serve, HOST, 0)
    scheme = "https" if kwargs.get("ssl_context") else "http"
    return f"{scheme}://{host}:{port}"


async def echo(request: Request) -> Response:
    """Answer with the request as the server saw it, and the client's port (one per connection)."""
    return Response.json(
        200,
        {
            "method": request.method,
            "target": request.target,
            "body": request.body.decode(),
            "port": request.client[1],
            "host": request.header("host"),
        },
    )


async def raw_server(nursery: trio.Nursery, serve_connection) -> tuple[str, list[trio.SocketStream]]:
    """A TCP server calling ``serve_connection(stream, index)`` for each connection; returns its URL."""
    accepted: list[trio.SocketStream] = []

    async def handler(stream: trio.SocketStream) -> None:
        accepted.append(stream)
        await serve_connection(stream, len(accepted) - 1)

    listeners = await nursery.start(functools.partial(trio.serve_tcp, handler, 0, host=HOST))
    port = listeners[0].socket.getsockname()[1]
    return f"http://{HOST}:{port}", accepted


async def read_request(stream: trio.SocketStream) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = await stream.receive_some()
        if not chunk:
            return data
        data += chunk
    return data


OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"


class TestRequests:
    """Requests and keep-alive."""

    async def test_request_reads_status_headers_and_body(self, nursery):
        """A POST carries its body with Content-Length and a Host header; the answer is read whole."""
        url = await start(nursery, echo)
        async with ConnectionPool() as pool:
            response = await pool.request("POST", f"{url}/v1/x?y=1", body=b"hello", headers=[("x-a", "b")])
        answer = response.json()
        assert response.status == 200
        assert response.header("Content-Type") == "application/json"
        assert answer["method"] == "POST"
        assert answer["target"] == "/v1/x?y=1"
        assert answer["body"] == "hello"
        assert answer["host"] == url.removeprefix("http://")

    async def test_keep_alive_reuses_one_connection(self, nursery):
        """Sequential requests to one upstream travel over one connection."""
        url = await start(nursery, echo)
        async with ConnectionPool() as pool:
            ports = {(await pool.request("GET", f"{url}/")).json()["port"] for _ in range(5)}
            assert len(ports) == 1
            assert pool.connections_opened == 1
            assert pool.idle_count(url) == 1

    async def test_idle_connections_are_capped_per_host(self, nursery):
        """Concurrent requests open a connection each; only max_idle_per_host stay idle afterwards."""
        release = trio.Event()
        arrived = 0

        async def slow(request: Request) -> Response:
            nonlocal arrived
            arrived += 1
            await release.wait()
            return Response.text(200, "ok")

        url = await start(nursery, slow)
        pool = ConnectionPool(max_idle_per_host=2)
        async with trio.open_nursery() as inner:
            for _ in range(4):
                inner.start_soon(pool.request, "GET", url)
            await trio.testing.wait_all_tasks_blocked()
            assert arrived == 4
            release.set()
        assert pool.connections_opened == 4
        assert pool.idle_count(url) == 2
        await pool.aclose()
        assert pool.idle_count() == 0

    async def test_retain_only_closes_idle_connections_elsewhere(self, nursery):
        """retain_only keeps the idle connections of the given upstreams and closes the others'."""
        first, second = await start(nursery, echo), await start(nursery, echo)
        async with ConnectionPool() as pool:
            await pool.request("GET", first)
            await pool.request("GET", second)
            assert pool.retain_only([first]) == 1
            assert (pool.idle_count(first), pool.idle_count(second)) == (1, 0)

    async def test_large_chunked_body(self, nursery):
        """A chunked response of several megabytes arrives intact."""
        blob = bytes(range(256)) * 4096 * 4  # 4 MiB

        async def chunks():
            for i in range(0, len(blob), 100_000):
                yield blob[i : i + 100_000]

        async def handler(request: Request) -> Response:
            return Response.stream(200, chunks(), content_type="application/octet-stream")

        url = await start(nursery, handler)
        async with ConnectionPool() as pool:
            response = await pool.request("GET", url)
        assert response.content == blob

    async def test_read_limit(self, nursery):
        """read(limit) refuses a longer body and closes the connection it was still arriving on."""

        async def endless():
            while True:
                yield b"x" * 1000
                await trio.lowlevel.checkpoint()

        url = await start(nursery, streaming(endless))
        async with ConnectionPool() as pool:
            response = await pool.send("GET", url)
            with pytest.raises(ResponseTooLarge):
                await response.read(limit=100_000)
            await response.aclose()
            assert pool.idle_count(url) == 0


class TestStreaming:
    """Bodies arrive as the upstream sends them."""

    async def test_chunks_arrive_before_the_body_ends(self, nursery):
        """The first chunk is readable while the server still holds back the rest."""
        held = HeldStream(b"data: first\n\n", b"data: second\n\n")
        url = await start(nursery, streaming(held))
        async with ConnectionPool() as pool, pool.stream("GET", url) as response:
            with trio.fail_after(5):
                assert await response.receive_chunk() == b"data: first\n\n"
            held.release()
            rest = [chunk async for chunk in response]
            assert rest == [b"data: second\n\n"]
            assert response.complete

    async def test_cancelled_stream_closes_its_connection(self, nursery):
        """Cancelling a request mid-body closes the connection: the server sees the client leave."""
        chunks = EndlessStream()
        url = await start(nursery, streaming(chunks))
        async with ConnectionPool() as pool:
            with trio.move_on_after(5) as scope:
                async with pool.stream("GET", url) as response:
                    await response.receive_chunk()
                    scope.cancel()
                    await trio.sleep_forever()
            assert scope.cancelled_caught
            with trio.fail_after(5):
                await chunks.stopped.wait()
            assert pool.idle_count(url) == 0
            assert pool.connections_opened == 1

    async def test_response_closed_early_is_not_reused(self, nursery):
        """A response closed before its end is not given back to the pool."""

        async def chunks():
            for _ in range(100):
                yield b"x" * 1000
                await trio.lowlevel.checkpoint()

        url = await start(nursery, streaming(chunks))
        async with ConnectionPool() as pool:
            async with pool.stream("GET", url) as response:
                await response.receive_chunk()
            assert pool.idle_count(url) == 0
            async with pool.stream("GET", url) as response:
                await response.read()
            assert pool.idle_count(url) == 1
            assert pool.connections_opened == 2

    async def test_truncated_body_raises(self, nursery):
        """An upstream that closes mid-body raises RemoteProtocolError with response_started set."""

        async def serve(stream, index):
            await read_request(stream)
            await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly ten..")
            await stream.aclose()

        url, _ = await raw_server(nursery, serve)
        async with ConnectionPool() as pool:
            response = await pool.send("GET", url)
            with pytest.raises(RemoteProtocolError) as caught:
                await response.read()
            assert caught.value.response_started
            assert pool.idle_count(url) == 0


class TestFailures:
    """Connections that cannot be made or that the upstream drops."""

    async def test_refused_connection_raises_connect_error(self):
        """Nothing listening: ConnectError naming the address."""
        port = free_port()
        async with ConnectionPool() as pool:
            with pytest.raises(ConnectError, match=f"127.0.0.1:{port}"):
                await pool.request("GET", f"http://127.0.0.1:{port}/")

    async def test_close_before_answer_on_new_connection_raises(self, nursery):
        """A fresh connection closed before any answer raises RemoteProtocolError (not retried)."""

        async def serve(stream, index):
            await read_request(stream)
            await stream.aclose()

        url, accepted = await raw_server(nursery, serve)
        async with ConnectionPool() as pool:
            with pytest.raises(RemoteProtocolError) as caught:
                await pool.request("POST", url, body=b"{}")
        assert not caught.value.response_started
        assert len(accepted) == 1

    async def test_stale_kept_alive_connection_is_replaced(self, nursery):
        """An idle connection the upstream closed is noticed, and the request goes on a new one."""
        closed = trio.Event()

        async def serve(stream, index):
            await read_request(stream)
            await stream.send_all(OK)
            await stream.aclose()
            closed.set()

        url, accepted = await raw_server(nursery, serve)
        async with ConnectionPool() as pool:
            assert (await pool.request("GET", url)).content == b"ok"
            assert pool.idle_count(url) == 1
            with trio.fail_after(5):
                await closed.wait()
            assert (await pool.request("GET", url)).content == b"ok"
        assert len(accepted) == 2

    async def test_reused_connection_dropped_before_answer_is_retried_once(self, nursery):
        """A kept-alive connection dropped after the request was sent: the request is sent again, once."""

        async def serve(stream, index):
            await read_request(stream)
            await stream.send_all(OK)
            if index == 0:
                await read_request(stream)  # the second request on this connection: drop it unanswered
                await stream.aclose()

        url, accepted = await raw_server(nursery, serve)
        async with ConnectionPool() as pool:
            assert (await pool.request("GET", url)).content == b"ok"
            assert (await pool.request("GET", url)).content == b"ok"
        assert len(accepted) == 2

    async def test_read_timeout(self, nursery):
        """An upstream silent for read_timeout raises ReadTimeout, before the head and mid-body."""
        hold = trio.Event()

        async def silent(request: Request) -> Response:
            await hold.wait()
            return Response.text(200, "late")

        async def stalls():
            yield b"data: 1\n\n"
            await hold.wait()

        head_url = await start(nursery, silent)
        body_url = await start(nursery, streaming(stalls))
        async with ConnectionPool(read_timeout=0.05) as pool:
            with pytest.raises(ReadTimeout) as before_head:
                await pool.request("POST", head_url, body=b"{}")
            assert not before_head.value.response_started
            response = await pool.send("GET", body_url)
            assert await response.receive_chunk() == b"data: 1\n\n"
            with pytest.raises(ReadTimeout, match="sent nothing for 0.05s") as mid_body:
                await response.receive_chunk()
            assert mid_body.value.response_started
            assert pool.idle_count() == 0

    async def test_connect_timeout(self, nursery, monkeypatch):
        """A connect that takes longer than connect_timeout raises ConnectError saying so."""

        async def never(*args, **kwargs):
            await trio.sleep_forever()

        monkeypatch.setattr(trio, "open_tcp_stream", never)
        async with ConnectionPool(connect_timeout=0.05) as pool:
            with pytest.raises(ConnectError, match="within 0.05s"):
                await pool.request("GET", "http://127.0.0.1:9/")


class TestTls:
    """https upstreams."""

    async def test_https_with_client_certificate(self, nursery, test_pki):
        """An https request verifies the server and presents the client certificate."""
        server_context = server_ssl_context(
            test_pki.server.cert_path, test_pki.server.key_path, test_pki.ca.cert_path
        )

        async def who(request: Request) -> Response:
            return Response.json(200, {"subject": request.peer_cert["subject"]})

        url = await start(nursery, who, ssl_context=server_context)
        async with ConnectionPool(ssl_context=test_pki.context("gateway", "gw-1")) as pool:
            first = await pool.request("GET", url)
            second = await pool.request("GET", url)
            assert "gw-1" in str(first.json()["subject"])
            assert second.status == 200
            assert pool.connections_opened == 1

    async def test_untrusted_server_is_a_connect_error(self, nursery, test_pki, tmp_path):
        """A server whose certificate the client's CA did not sign fails as ConnectError."""
        from llmgw import pki

        other = pki.init_ca(tmp_path / "other-ca")
        server_context = server_ssl_context(
            test_pki.server.cert_path, test_pki.server.key_path, test_pki.ca.cert_path
        )
        url = await start(nursery, echo, ssl_context=server_context)
        admin = test_pki.client("admin", "ops")
        context = pki.client_ssl_context(admin.cert_path, admin.key_path, other.cert_path)
        async with ConnectionPool(ssl_context=context) as pool:
            with pytest.raises(ConnectError):
                await pool.request("GET", url)
