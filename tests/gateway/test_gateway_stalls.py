"""Replicas that stall or leave the routes with requests on them: real sims, a real gateway, real HTTP."""

from __future__ import annotations

import signal
import time

import httpx
import pytest
import trio

from llmgw.gateway import ProxySettings
from llmgw.gateway.balancer import Breaker, Upstream
from llmgw.gateway.call import Call
from llmgw.gateway.relay import Exchange
from llmgw.net.client import HttpClientError
from llmgw.net.server import HttpServer, Request, Response
from llmgw.testing.gateway import serve_feed, sims_behind_feed, start_gateway, start_sim, wait_healthy
from llmgw.testing.processes import processes, wait_for  # noqa: F401
from llmgw.wire import Route

BODY = {"model": "m", "prompt": "hello", "max_tokens": 4}


async def serve(nursery: trio.Nursery, handler) -> str:
    """An HTTP server for ``handler`` on 127.0.0.1; its base URL."""
    host, port = await nursery.start(HttpServer(handler).serve, "127.0.0.1", 0)
    return f"http://{host}:{port}"


class TestStalls:
    """A replica that stops sending while requests wait on it is taken out and its requests go elsewhere."""

    async def test_sigstopped_sim_requests_go_elsewhere_within_the_stall_timeout(self, nursery, processes):  # noqa: F811
        """SIGSTOP one of two sims under load: every request succeeds, none waits over stall + 2 s."""
        with trio.fail_after(10):
            (a, b), feed = await sims_behind_feed(nursery, processes, "a", "b")
        stall = 3.0
        gateway, url = await start_gateway(
            nursery,
            feed.url,
            require_keys=False,
            routing="least-outstanding",
            proxy=ProxySettings(stall_timeout=stall),
        )
        results: list[tuple[int, str, float]] = []
        stopped = trio.Event()

        async def worker(http: httpx.AsyncClient) -> None:
            while len(results) < 400:
                began = time.monotonic()
                response = await http.post("/v1/completions", json=BODY)
                results.append(
                    (
                        response.status_code,
                        response.headers.get("x-llmgw-replica", ""),
                        time.monotonic() - began,
                    )
                )
                if len(results) >= 100 and not stopped.is_set():
                    stopped.set()
                    a.process.signal(signal.SIGSTOP)

        try:
            with trio.fail_after(60):
                async with (
                    httpx.AsyncClient(base_url=url, timeout=30) as http,
                    trio.open_nursery() as workers,
                ):
                    for _ in range(8):
                        workers.start_soon(worker, http)
        finally:
            a.process.signal(signal.SIGCONT)
        failed = [r for r in results if r[0] != 200]
        assert not failed, failed[:5]
        slowest = max(seconds for _, _, seconds in results)
        assert slowest <= stall + 2, f"a request waited {slowest:.1f} s (stall timeout {stall:g} s)"
        assert {replica for _, replica, _ in results[150:]} == {"b"}
        assert gateway.stalls.stalls >= 1
        with trio.fail_after(5):
            await wait_for(lambda: feed.suspects, "the gateway to report the stalled replica")
        assert feed.suspects[0]["replica"] == "a"
        assert "nothing arrived from it" in feed.suspects[0]["reason"], feed.suspects[0]

    async def test_slow_answer_is_not_a_stall(self, nursery):
        """A replica that takes longer than the stall timeout to answer but answers /health keeps serving."""

        async def slow(request: Request) -> Response:
            if request.path == "/health":
                return Response.json(200, {})
            await trio.sleep(float(request.json().get("prompt", "0")))
            return Response.json(200, {"ok": True})

        feed = await serve_feed(nursery, m=[("slow", await serve(nursery, slow))])
        gateway, url = await start_gateway(
            nursery, feed.url, require_keys=False, proxy=ProxySettings(stall_timeout=0.5)
        )
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            assert (await http.post("/v1/completions", json={"model": "m", "prompt": "0"})).status_code == 200
            response = await http.post("/v1/completions", json={"model": "m", "prompt": "2"})
        assert (response.status_code, response.headers["x-llmgw-replica"]) == (200, "slow")
        assert gateway.stalls.stalls == 0 and not feed.suspects

    async def test_client_giving_up_after_the_stall_timeout_opens_the_breaker(self, nursery):
        """Clients that give up on a replica silent past the stall timeout count as its failures."""

        async def silent(request: Request) -> Response:
            await trio.sleep_forever()

        feed = await serve_feed(nursery, m=[("silent", await serve(nursery, silent))])
        gateway, url = await start_gateway(
            nursery, feed.url, require_keys=False, breaker_failures=1, proxy=ProxySettings(stall_timeout=0.3)
        )
        async with httpx.AsyncClient(base_url=url, timeout=0.8) as http:
            try:
                await http.post("/v1/completions", json=BODY)
            except httpx.TimeoutException:
                pass
            with trio.fail_after(5):
                await wait_for(
                    lambda: gateway.balancer.replicas("m")[0].breaker.state.name == "OPEN",
                    "the breaker of the silent replica to open",
                )
            response = await http.post("/v1/completions", json=BODY)
        assert response.status_code == 503, response.text


class TestRoutesChange:
    """Requests on a replica that leaves the routes do not wait for it."""

    async def test_request_on_a_replica_that_leaves_goes_elsewhere_at_once(self, nursery, processes):  # noqa: F811
        """A request stuck on a replica that leaves the routes is answered by the one that replaces it."""
        arrived = trio.Event()

        async def stuck(request: Request) -> Response:
            arrived.set()
            await trio.sleep_forever()

        b = start_sim(processes)
        with trio.fail_after(10):
            await wait_healthy([b.url])
        feed = await serve_feed(nursery, m=[("stuck", await serve(nursery, stuck))])
        _, url = await start_gateway(nursery, feed.url, require_keys=False)
        answer: list[httpx.Response] = []

        async def client() -> None:
            async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                answer.append(await http.post("/v1/completions", json=BODY))

        with trio.fail_after(10):
            async with trio.open_nursery() as clients:
                clients.start_soon(client)
                await arrived.wait()
                left_at = trio.current_time()
                feed.set(routes={"m": [("b", b.url)]})
        assert (answer[0].status_code, answer[0].headers["x-llmgw-replica"]) == (200, "b")
        assert trio.current_time() - left_at < 3

    async def test_stream_on_a_leaving_replica_finishes_while_it_sends(self, nursery, processes):  # noqa: F811
        """A stream already going to its client goes on after its replica leaves the routes (a drain)."""
        a = start_sim(processes, "--tokens-per-second", "20")
        with trio.fail_after(10):
            await wait_healthy([a.url])
        feed = await serve_feed(nursery, m=[("a", a.url)])
        _, url = await start_gateway(
            nursery, feed.url, require_keys=False, proxy=ProxySettings(stall_timeout=2)
        )
        body = {**BODY, "max_tokens": 40, "stream": True}
        with trio.fail_after(20):
            async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                async with http.stream("POST", "/v1/completions", json=body) as response:
                    lines = []
                    async for line in response.aiter_lines():
                        if not lines:
                            feed.set(routes={"m": []})
                        lines.append(line)
        assert lines[-2:] == ["data: [DONE]", ""] or "data: [DONE]" in lines, lines[-3:]
        assert not any('"error"' in line for line in lines)

    async def test_silent_stream_on_a_leaving_replica_ends_after_the_stall_timeout(self, nursery):
        """A stream whose replica left the routes and then sends nothing ends with an error event."""

        async def one_event_then_silence(request: Request) -> Response:
            async def events():
                yield b'data: {"choices": []}\n\n'
                await trio.sleep_forever()

            return Response.stream(200, events())

        feed = await serve_feed(nursery, m=[("quiet", await serve(nursery, one_event_then_silence))])
        _, url = await start_gateway(
            nursery, feed.url, require_keys=False, proxy=ProxySettings(stall_timeout=1)
        )
        lines = []
        with trio.fail_after(10):
            async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                async with http.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as response:
                    async for line in response.aiter_lines():
                        if not lines:
                            left_at = trio.current_time()
                            feed.set(routes={"m": []})
                        lines.append(line)
        # the gateway's stall clock started at the event's last byte, a little before this client read it
        assert 0.5 <= trio.current_time() - left_at < 3
        assert "replica quiet left the routes and sent nothing" in lines[-2], lines


class _HeadThenGone:
    """A pool whose response head arrives in the same instant as a routes update that removes the replica
    (the stall watch ends the attempt before the proxy's task runs again)."""

    def __init__(self) -> None:
        self.closed = False

    async def send(self, method, url, *, headers, body, watch):
        watch.abort("replica a left the routes")
        return self

    def close(self) -> None:
        self.closed = True


async def test_an_attempt_ended_as_its_head_came_is_retried_elsewhere_not_relayed():
    """Seen in a nemesis run: a stream whose replica left the routes as its head came was relayed, then cut
    (the client saw an error mid-stream). The exchange now fails before anything reaches the client."""
    replica = Upstream(Route("a", "http://127.0.0.1:9"), Breaker())
    call = Call("m", "completions", "/v1/completions", b"{}", "req-1", None, 0.0)
    pool = _HeadThenGone()
    exchange = Exchange(replica)
    try:
        with pytest.raises(HttpClientError, match="left the routes"):
            await exchange.send(pool, call, call.body)
    finally:
        exchange.end()
    assert pool.closed and not exchange.attempt.handed_over and not replica.attempts
