"""Hostile input at the gateway: ``llmgw gateway`` as a process, clients that send what they should not."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import trio

from llmgw.testing.gateway import FakeRoutesFeed, wait_healthy
from llmgw.testing.processes import ManagedProcess, free_port, processes, wait_for  # noqa: F401
from llmgw.testing.sockets import connections_to

KEY = "llmgw-test-key"
MIB = 1024 * 1024
#: a body just under the gateway's default --max-body-bytes (32 MiB)
BIG = 31 * MIB


def memory_kib(process: ManagedProcess, field: str) -> int:
    """``VmRSS`` or ``VmHWM`` (peak) of ``process``, in KiB, from ``/proc``."""
    for line in Path(f"/proc/{process.pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for pid {process.pid}")


async def start(nursery: trio.Nursery, processes, *args: str) -> tuple[FakeRoutesFeed, str, ManagedProcess]:  # noqa: F811
    """``llmgw gateway`` with one key (``KEY``) and model ``m`` on a replica that does not answer."""
    feed = FakeRoutesFeed()
    feed_url = await nursery.start(feed.serve)
    feed.set(routes={"m": [("m-0", f"http://127.0.0.1:{free_port()}")]}, keys={KEY: "alice"})
    port = free_port()
    argv = [sys.executable, "-m", "llmgw.gateway", "--server", feed_url, "--listen", f"127.0.0.1:{port}"]
    gateway = processes.start([*argv, *args], name="gateway")
    url = f"http://127.0.0.1:{port}"
    with trio.fail_after(15):
        await wait_healthy([url])
    return feed, url, gateway


def big_body(size: int, model: str = "m") -> bytes:
    """A JSON completion request of ``size`` bytes."""
    head = b'{"model": "%s", "prompt": "' % model.encode()
    return head + b"x" * (size - len(head) - 2) + b'"}'


async def raw_exchange(url: str, head: bytes, body: bytes = b"") -> tuple[int, dict, trio.SocketStream]:
    """Send ``head`` (and ``body``) on a new connection; the status and JSON body of the answer."""
    host, port = url.removeprefix("http://").split(":")
    stream = await trio.open_tcp_stream(host, int(port))
    await stream.send_all(head + body)
    return await read_answer(stream)


async def read_answer(stream: trio.SocketStream) -> tuple[int, dict, trio.SocketStream]:
    """The status line's code and the JSON body of one answer read from ``stream``."""
    data = b""
    while b"\r\n\r\n" not in data:
        piece = await stream.receive_some(65536)
        assert piece, f"the connection closed after {data!r}"
        data += piece
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    length = int(headers.get("content-length", "0"))
    while len(rest) < length:
        piece = await stream.receive_some(65536)
        assert piece
        rest += piece
    return int(lines[0].split()[1]), json.loads(rest[:length] or b"{}"), stream


class TestBodies:
    """Bodies are read only for clients with a key, and only so many at once."""

    async def test_anonymous_big_bodies_are_refused_unread(self, nursery, processes):  # noqa: F811
        """Eight anonymous 31 MiB bodies at once: each gets 401, and the gateway's memory stays put."""
        _, url, gateway = await start(nursery, processes)
        before = memory_kib(gateway, "VmRSS")
        answers: list[httpx.Response] = []

        async def send(key: str | None) -> None:
            headers = {"authorization": f"Bearer {key}"} if key else {}
            async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                answers.append(await http.post("/v1/completions", content=big_body(BIG), headers=headers))

        with trio.fail_after(60):
            async with trio.open_nursery() as clients:
                for number in range(8):
                    clients.start_soon(send, None if number % 2 else "not-a-key")
        assert [a.status_code for a in answers] == [401] * 8
        messages = {a.json()["error"]["message"].split(".")[0] for a in answers}
        assert messages == {"You didn't provide an API key", "Incorrect API key provided: *********"}
        grown = memory_kib(gateway, "VmHWM") - before
        print(f"gateway peak RSS grew {grown / 1024:.1f} MiB for 8 x 31 MiB anonymous bodies")
        assert grown < 32 * 1024, f"the gateway's peak RSS grew {grown / 1024:.0f} MiB"

    async def test_bodies_held_at_once_are_capped(self, nursery, processes):  # noqa: F811
        """With --max-buffered-bytes 64 MiB, eight 31 MiB bodies at once: the third and later get 503."""
        _, url, gateway = await start(nursery, processes, "--max-buffered-bytes", str(64 * MIB))
        before = memory_kib(gateway, "VmRSS")
        body = big_body(BIG, model="absent")
        head = (
            f"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {KEY}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
        ).encode()
        host, port = url.removeprefix("http://").split(":")
        answers: list[tuple[int, dict]] = []
        with trio.fail_after(60):
            streams = [await trio.open_tcp_stream(host, int(port)) for _ in range(8)]
            for stream in streams:  # every head first: the gateway reserves what each announces
                await stream.send_all(head)

            ends = {"{}:{}".format(*s.socket.getsockname()) for s in streams}

            def heads_read() -> bool:  # a head refused at once is answered and its connection closed
                return not any(c.unread for c in connections_to(int(port)) if c.client in ends)

            await wait_for(heads_read, "the gateway to read every head", gateway)

            async def finish(stream: trio.SocketStream) -> None:
                try:
                    await stream.send_all(body)
                except trio.BrokenResourceError:
                    pass  # refused at its head: the gateway stopped reading after a while
                status, answer, _ = await read_answer(stream)
                answers.append((status, answer))
                await stream.aclose()

            async with trio.open_nursery() as clients:
                for stream in streams:
                    clients.start_soon(finish, stream)
        statuses = sorted(status for status, _ in answers)
        assert statuses == [404, 404] + [503] * 6, statuses
        refusal = next(answer for status, answer in answers if status == 503)["error"]["message"]
        assert "--max-buffered-bytes" in refusal and "retry" in refusal, refusal
        grown = memory_kib(gateway, "VmHWM") - before
        print(f"gateway peak RSS grew {grown / 1024:.1f} MiB for 2 admitted x 31 MiB bodies")
        assert grown < 256 * 1024, f"the gateway's peak RSS grew {grown / 1024:.0f} MiB"

    async def test_a_body_over_the_cap_alone_is_413(self, nursery, processes):  # noqa: F811
        """A body larger than --max-buffered-bytes can never be held: 413 naming the flag."""
        _, url, _ = await start(nursery, processes, "--max-buffered-bytes", str(MIB))
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            response = await http.post(
                "/v1/completions", content=big_body(2 * MIB), headers={"authorization": f"Bearer {KEY}"}
            )
        assert response.status_code == 413
        assert "--max-buffered-bytes" in response.json()["error"]["message"]


class TestMalformed:
    """Bodies and requests that break a bound get a 4xx (or 505) that says which."""

    async def test_deep_json_long_numbers_and_nan_get_400(self, nursery, processes):  # noqa: F811
        """JSON nested 10,000 deep, a 5,000-digit number, NaN: each a 400 naming what is wrong."""
        _, url, _ = await start(nursery, processes)
        cases = {
            b'{"model": "m", "prompt": ' + b"[" * 10_000 + b"]" * 10_000 + b"}": "deeper than 64 levels",
            b'{"model": "m", "prompt": ' + b"[" * 65 + b"]" * 65 + b"}": "deeper than 64 levels",
            b'{"model": "m", "max_tokens": ' + b"9" * 5000 + b"}": "a number of 5000 characters",
            b'{"model": "m", "temperature": NaN}': "NaN",
        }
        async with httpx.AsyncClient(base_url=url, headers={"authorization": f"Bearer {KEY}"}) as http:
            for body, expected in cases.items():
                response = await http.post("/v1/completions", content=body)
                assert response.status_code == 400, (expected, response.text)
                assert expected in response.json()["error"]["message"], response.text

    async def test_only_http_1_is_spoken(self, nursery, processes):  # noqa: F811
        """HTTP/9.9 and HTTP/2.0 request lines get 505 naming the version; HTTP/1.0 is served."""
        _, url, _ = await start(nursery, processes)
        for version in ("HTTP/9.9", "HTTP/2.0"):
            head = f"GET /health {version}\r\nhost: x\r\n\r\n".encode()
            status, answer, stream = await raw_exchange(url, head)
            await stream.aclose()
            assert status == 505, (version, answer)
            assert version in answer["error"]["message"] and "HTTP/1.1" in answer["error"]["message"]
        status, _, stream = await raw_exchange(url, b"GET /health HTTP/1.0\r\n\r\n")
        await stream.aclose()
        assert status == 200

    async def test_5xx_names_replicas_by_id_only(self, nursery, processes):  # noqa: F811
        """A 502 from a replica that does not answer names it by id, never by address."""
        feed, url, _ = await start(nursery, processes)
        address = feed.routes["m"][0][1].removeprefix("http://")
        async with httpx.AsyncClient(base_url=url, headers={"authorization": f"Bearer {KEY}"}) as http:
            response = await http.post("/v1/completions", json={"model": "m", "prompt": "x"})
        assert response.status_code == 502, response.text
        message = response.json()["error"]["message"]
        assert "m-0" in message and address not in message and "127.0.0.1" not in message, message
