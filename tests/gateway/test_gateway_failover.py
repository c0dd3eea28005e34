"""The gateway when replicas fail, clients leave, and routes change: real processes, real HTTP."""

from __future__ import annotations

import logging
from pathlib import Path

import httpx
import openai
import pytest
import trio

from llmgw.gateway import ProxySettings
from llmgw.net.server import HttpServer, Request, Response
from llmgw.testing.gateway import (
    EndlessStream,
    FakeRoutesFeed,
    HeldStream,
    Sim,
    serve_feed,
    serve_stream,
    sims_behind_feed,
    start_gateway,
    start_sim,
    wait_healthy,
)
from llmgw.testing.processes import free_port, processes, wait_for  # noqa: F401

MESSAGES = [{"role": "user", "content": "hello"}]
BODY = {"model": "m", "messages": MESSAGES, "max_tokens": 4}


async def sim_behind_gateway(nursery: trio.Nursery, processes, *sim_args: str) -> tuple[Sim, str]:  # noqa: F811
    """One sim started with ``sim_args`` as replica m-0 of model m, behind a gateway needing no key.

    :returns: the sim, once healthy, and the gateway's base URL.
    """
    with trio.fail_after(10):
        [sim], feed = await sims_behind_feed(nursery, processes, "m-0", sim_args=sim_args)
    _, url = await start_gateway(nursery, feed.url, require_keys=False)
    return sim, url


def connections_to(port: int) -> list[str]:
    """TCP states (hex, /proc/net/tcp) of the sockets whose local port is ``port``: the server's side."""
    states = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].rsplit(":", 1)[1], 16) == port:
            states.append(fields[3])
    return states


ESTABLISHED, CLOSE_WAIT = "01", "08"


async def metrics(url: str) -> str:
    async with httpx.AsyncClient() as http:
        return (await http.get(f"{url}/metrics")).text


def sample(text: str, name: str, **labels: str) -> float | None:
    """The value of one sample in a Prometheus exposition, or None."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return None


class TestRetries:
    """Failures before any byte went out are retried on another replica."""

    async def test_killed_replica_requests_go_elsewhere(self, nursery, processes):  # noqa: F811
        """Killing one of two replicas under load: every request still succeeds, on the other one."""
        with trio.fail_after(10):
            (a, b), feed = await sims_behind_feed(nursery, processes, "a", "b")
        _, url = await start_gateway(nursery, feed.url, require_keys=False)
        results: list[tuple[int, str]] = []
        killed = trio.Event()

        async def worker(http: httpx.AsyncClient) -> None:
            while len(results) < 300:
                response = await http.post("/v1/chat/completions", json=BODY)
                results.append((response.status_code, response.headers.get("x-llmgw-replica", "")))
                if len(results) >= 100 and not killed.is_set():
                    killed.set()
                    a.process.kill_group()

        with trio.fail_after(30):
            async with httpx.AsyncClient(base_url=url, timeout=10) as http, trio.open_nursery() as workers:
                for _ in range(8):
                    workers.start_soon(worker, http)
        statuses = [status for status, _ in results]
        assert statuses.count(200) == len(results), [r for r in results if r[0] != 200][:5]
        assert {replica for _, replica in results[:100]} == {"a", "b"}
        assert {replica for _, replica in results[120:]} == {"b"}
        text = await metrics(url)
        assert sample(text, "llmgw_gateway_retries_total", model="m") >= 1
        assert sample(text, "llmgw_gateway_breaker_state", replica="a") != 0  # open (or half-open, probing)

    async def test_503_before_first_byte_is_retried(self, nursery):
        """A replica answering 503 is skipped for the request: the client gets the other replica's answer."""

        async def overloaded(request: Request) -> Response:
            return Response.json(503, {"error": {"message": "busy"}})

        async def fine(request: Request) -> Response:
            return Response.json(200, {"ok": True})

        urls = []
        for handler in (overloaded, fine):
            host, port = await nursery.start(HttpServer(handler).serve, "127.0.0.1", 0)
            urls.append(f"http://{host}:{port}")
        feed = await serve_feed(nursery, m=[("busy", urls[0]), ("fine", urls[1])])
        _, url = await start_gateway(nursery, feed.url, require_keys=False)
        async with httpx.AsyncClient(base_url=url) as http:
            for _ in range(10):
                response = await http.post("/v1/completions", json={"model": "m", "prompt": "x"})
                assert (response.status_code, response.json()) == (200, {"ok": True})

    async def test_every_replica_failing_gives_a_clean_error(self, nursery):
        """No replica reachable: a 502 naming the attempts, then a 503 once the breakers are open."""
        dead = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
        feed = await serve_feed(nursery, m=[("d0", dead[0]), ("d1", dead[1])])
        _, url = await start_gateway(nursery, feed.url, require_keys=False, breaker_failures=2)
        async with httpx.AsyncClient(base_url=url) as http:
            first = await http.post("/v1/completions", json={"model": "m", "prompt": "x"})
            assert first.status_code == 502
            assert "d0" in first.json()["error"]["message"] and "d1" in first.json()["error"]["message"]
            await http.post("/v1/completions", json={"model": "m", "prompt": "x"})
            third = await http.post("/v1/completions", json={"model": "m", "prompt": "x"})
        assert third.status_code == 503
        assert third.json()["error"]["code"] == "model_unavailable"
        assert int(third.headers["retry-after"]) >= 1


class TestBreaker:
    """A replica failing repeatedly is taken out, then probed back."""

    async def test_breaker_opens_and_closes(self, nursery, processes):  # noqa: F811
        """A dead replica's breaker opens (no more attempts on it), and closes once it answers a probe."""
        good = start_sim(processes)
        dead_port = free_port()
        dead_url = f"http://127.0.0.1:{dead_port}"
        with trio.fail_after(10):
            await wait_healthy([good.url])
        feed = await serve_feed(nursery, m=[("dead", dead_url), ("good", good.url)])
        _, url = await start_gateway(
            nursery, feed.url, require_keys=False, breaker_failures=3, breaker_open_for=1.5
        )
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            sent = 0

            async def request() -> str:
                nonlocal sent
                sent += 1  # prompts of their own: prefix routing spreads them over both replicas
                body = {**BODY, "messages": [{"role": "user", "content": f"request {sent}"}]}
                response = await http.post("/v1/chat/completions", json=body)
                assert response.status_code == 200, response.text
                return response.headers["x-llmgw-replica"]

            async def state() -> float:
                return sample(await metrics(url), "llmgw_gateway_breaker_state", replica="dead")

            async def opened() -> bool:
                await request()
                return await state() == 2

            with trio.fail_after(10):
                await wait_for(opened, "the dead replica's breaker to open")
            errors = sample(
                await metrics(url), "llmgw_gateway_upstream_errors_total", replica="dead", kind="connect"
            )
            assert errors == 3
            assert {await request() for _ in range(5)} == {"good"}
            start_sim(processes, port=dead_port)
            with trio.fail_after(10):
                await wait_healthy([dead_url])

            async def closed() -> bool:
                await request()
                return await state() == 0

            with trio.fail_after(10):
                await wait_for(closed, "the revived replica's breaker to close")
            assert "dead" in {await request() for _ in range(20)}


class TestStreams:
    """Streams pass through as they come, end cleanly when a replica dies, and stop when the client leaves."""

    async def test_chunks_pass_before_the_stream_ends(self, nursery):
        """The client reads the first event while the engine still holds back the second."""
        held = HeldStream(b'data: {"n": 1}\n\n', b'data: {"n": 2}\n\ndata: [DONE]\n\n')
        feed = await serve_feed(nursery, m=[("m-0", await serve_stream(nursery, held))])
        _, url = await start_gateway(nursery, feed.url, require_keys=False)
        async with httpx.AsyncClient(base_url=url) as http:
            async with http.stream("POST", "/v1/chat/completions", json={**BODY, "stream": True}) as response:
                assert response.headers["content-type"] == "text/event-stream"
                chunks = response.aiter_bytes()
                with trio.fail_after(5):
                    assert await chunks.__anext__() == b'data: {"n": 1}\n\n'
                held.release()
                rest = b"".join([chunk async for chunk in chunks])
        assert rest == b'data: {"n": 2}\n\ndata: [DONE]\n\n'

    async def test_stalled_stream_times_out_with_an_error_event(self, nursery):
        """An engine that stops sending mid-stream for the upstream timeout: the stream ends with an error."""
        silent = HeldStream(b'data: {"n": 1}\n\n')
        feed = await serve_feed(nursery, m=[("m-0", await serve_stream(nursery, silent))])
        _, url = await start_gateway(
            nursery, feed.url, require_keys=False, proxy=ProxySettings(read_timeout=0.2)
        )
        with trio.fail_after(5):
            async with httpx.AsyncClient(base_url=url) as http:
                response = await http.post("/v1/chat/completions", json={**BODY, "stream": True})
        events_received = response.content.strip().split(b"\n\n")
        assert events_received[0] == b'data: {"n": 1}'
        assert b"sent nothing for 0.2s" in events_received[-1]
        silent.release()

    async def test_client_leaving_stops_generation(self, nursery):
        """A client that disconnects mid-stream makes the gateway close the upstream: the engine stops."""
        events = EndlessStream(b'data: {"token": "x"}\n\n')
        feed = await serve_feed(nursery, m=[("m-0", await serve_stream(nursery, events))])
        gateway, url = await start_gateway(nursery, feed.url, require_keys=False)
        async with httpx.AsyncClient(base_url=url) as http:
            async with http.stream("POST", "/v1/chat/completions", json={**BODY, "stream": True}) as response:
                await response.aiter_bytes().__anext__()
        with trio.fail_after(5):
            await events.stopped.wait()
        with trio.fail_after(5):
            await wait_for(lambda: gateway.balancer.replicas("m")[0].in_flight == 0, "in-flight to drop")
        assert gateway.upstreams.idle_count() == 0

    async def test_client_leaving_closes_the_sim_connection(self, nursery, processes):  # noqa: F811
        """With a real engine: after the client leaves, no connection to the engine stays open."""
        sim, url = await sim_behind_gateway(nursery, processes, "--tokens-per-second", "20")
        long = {**BODY, "max_tokens": 2000, "stream": True}
        async with httpx.AsyncClient(base_url=url) as http:
            async with http.stream("POST", "/v1/chat/completions", json=long) as response:
                await response.aiter_bytes().__anext__()
                assert ESTABLISHED in connections_to(sim.port)
        with trio.fail_after(5):
            await wait_for(
                lambda: not {ESTABLISHED, CLOSE_WAIT} & set(connections_to(sim.port)),
                "the engine's side of the connection to close",
                sim.process,
            )

    async def test_stream_on_a_dying_replica_ends_with_an_error_event(self, nursery, processes):  # noqa: F811
        """Killing the engine mid-stream ends the client's stream with an OpenAI error event, not a hang."""
        sim, url = await sim_behind_gateway(nursery, processes, "--tokens-per-second", "50")
        long = {**BODY, "max_tokens": 2000, "stream": True}
        with trio.fail_after(10):
            async with httpx.AsyncClient(base_url=url) as http:
                async with http.stream("POST", "/v1/chat/completions", json=long) as response:
                    chunks = response.aiter_bytes()
                    await chunks.__anext__()
                    sim.process.kill_group()
                    rest = b"".join([chunk async for chunk in chunks])  # a broken body would raise here
        last = rest.strip().split(b"\n\n")[-1]
        assert last.startswith(b'data: {"error": ')
        assert b"m-0 failed mid-stream" in last

    async def test_openai_client_raises_on_a_dying_replica(self, nursery, processes, caplog):  # noqa: F811
        """The openai client sees an APIError when the engine under its stream dies."""
        caplog.set_level(logging.INFO, logger="llmgw.gateway")
        sim, url = await sim_behind_gateway(nursery, processes, "--tokens-per-second", "50")

        def use() -> list[str]:
            api = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=10)
            received = []
            with pytest.raises(openai.APIError, match="failed mid-stream"):
                for chunk in api.chat.completions.create(
                    model="m", messages=MESSAGES, max_tokens=2000, stream=True
                ):
                    received.append(chunk)
                    if len(received) == 3:
                        sim.process.kill_group()
            return received

        with trio.fail_after(15):
            received = await trio.to_thread.run_sync(use)
        assert len(received) >= 3
        assert any("broke its response mid-way" in r.getMessage() for r in caplog.records)


class TestRouteChanges:
    """The gateway follows the routes feed."""

    async def test_replicas_appear_and_leave_within_a_second(self, nursery, processes):  # noqa: F811
        """A replica added to the feed serves; removed from it, its model answers 503."""
        sim = start_sim(processes, model="late")
        with trio.fail_after(10):
            await wait_healthy([sim.url])
        feed = await serve_feed(nursery)
        feed.set(models=["late"])
        _, url = await start_gateway(nursery, feed.url, require_keys=False)
        body = {"model": "late", "prompt": "x", "max_tokens": 1}
        async with httpx.AsyncClient(base_url=url) as http:
            assert (await http.post("/v1/completions", json=body)).status_code == 503
            feed.set(routes={"late": [("late-0", sim.url)]})
            with trio.fail_after(5.0):
                await wait_for(
                    lambda: _status(http, "/v1/completions", body, 200), "the new replica to serve"
                )
            feed.set(routes={})
            with trio.fail_after(5.0):
                await wait_for(lambda: _status(http, "/v1/completions", body, 503), "the replica to go")
            listed = (await http.get("/v1/models")).json()["data"]
        assert listed == []

    async def test_feed_outage_keeps_the_last_routes(self, nursery, processes, caplog):  # noqa: F811
        """While the feed is down the gateway serves from its last routes, logs it once, and reports it."""
        caplog.set_level(logging.INFO, logger="llmgw.gateway")
        a, b = start_sim(processes), start_sim(processes)
        with trio.fail_after(10):
            await wait_healthy([a.url, b.url])
        feed = FakeRoutesFeed()
        port = free_port()
        feed_url = f"http://127.0.0.1:{port}"
        feed.set(routes={"m": [("a", a.url)]})
        feed_scope = trio.CancelScope()

        async def run_feed(*, task_status=trio.TASK_STATUS_IGNORED) -> None:
            with feed_scope:
                await feed.serve("127.0.0.1", port, task_status=task_status)

        await nursery.start(run_feed)
        gateway, url = await start_gateway(nursery, feed_url, require_keys=False, routes_retry_interval=0.1)
        feed_scope.cancel()
        async with httpx.AsyncClient(base_url=url) as http:
            with trio.fail_after(5):
                await wait_for(lambda: not gateway.watcher.up, "the gateway to notice the outage")
            with trio.fail_after(5):
                await wait_for(lambda: gateway.watcher.age() > 0.5, "some time without the feed")
            for _ in range(5):
                assert (await http.post("/v1/chat/completions", json=BODY)).status_code == 200
            text = await metrics(url)
            assert sample(text, "llmgw_gateway_routes_feed_up") == 0
            assert sample(text, "llmgw_gateway_routes_age_seconds") > 0.5
            outage_logs = [r for r in caplog.records if "cannot read routes" in r.getMessage()]
            assert len(outage_logs) == 1 and "serving from the last routes" in outage_logs[0].getMessage()
            feed.set(routes={"m": [("a", a.url), ("b", b.url)]})
            await nursery.start(feed.serve, "127.0.0.1", port)
            with trio.fail_after(5.0):
                await wait_for(
                    lambda: len(gateway.balancer.replicas("m")) == 2, "the new replica after the outage"
                )
        assert any("answers again" in r.getMessage() for r in caplog.records)


async def _status(http: httpx.AsyncClient, path: str, body: dict, status: int) -> bool:
    return (await http.post(path, json=body)).status_code == status
