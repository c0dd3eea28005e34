"""Models at zero replicas: the gateway holds their requests, tells the server at once, sends them on wake."""

from __future__ import annotations

from functools import partial

import httpx
import pytest
import trio

from llmgw.gateway import ProxySettings
from llmgw.net.server import HttpServer, Request, Response
from llmgw.testing.gateway import serve_feed, start_gateway

BODY = {"model": "m", "prompt": "hello", "max_tokens": 4}


async def serve_answers(nursery: trio.Nursery) -> str:
    """An upstream that answers every completion at once; its base URL."""

    async def handler(request: Request) -> Response:
        if request.path == "/health":
            return Response.json(200, {})
        return Response.json(
            200, {"choices": [{"text": "hi"}], "usage": {"prompt_tokens": 1, "total_tokens": 2}}
        )

    host, port = await nursery.start(HttpServer(handler).serve, "127.0.0.1", 0)
    return f"http://{host}:{port}"


async def next_activity(feed) -> dict:
    """The next activity report the gateway posts (every 5 s: 10 s at most)."""
    with trio.fail_after(10):
        await feed.activity_posted.wait()
    return feed.activity[-1]


class TestHold:
    """A request for a model at zero replicas waits for the first replica the routes bring."""

    async def test_held_request_is_reported_at_once_and_answered_on_wake(self, nursery):
        """The server hears of the held request at once; the request goes to the replica that
        comes, with 200; the gateway then reports the model as used, nothing held."""
        feed = await serve_feed(nursery, models=["m"])
        feed.set(wake_on_demand=["m"])
        gateway, url = await start_gateway(nursery, feed.url, require_keys=False)
        answers: list[httpx.Response] = []
        answered = trio.Event()

        async def ask() -> None:
            async with httpx.AsyncClient(base_url=url, timeout=20) as http:
                answers.append(await http.post("/v1/completions", json=BODY))
            answered.set()

        nursery.start_soon(ask)
        with trio.fail_after(4):  # before the first periodic report (every 5 s): at once
            while not feed.activity or not feed.activity[-1]["models"][0]["held"]:
                await feed.activity_posted.wait()
        assert feed.activity[-1]["models"] == [
            {"model": "m", "idle": 0.0, "held": 1, "ttft_p95": None, "streams": 0}
        ]
        assert not answers, "held until a replica is ready"
        async with httpx.AsyncClient(base_url=url, timeout=5) as http:
            scraped = (await http.get("/metrics")).text
        assert 'llmgw_gateway_held_requests{model="m"} 1.0' in scraped
        feed.set(routes={"m": [("m-0", await serve_answers(nursery))]})
        with trio.fail_after(5):
            await answered.wait()
        assert answers[0].status_code == 200, answers[0].text
        assert answers[0].headers["x-llmgw-replica"] == "m-0"
        report = await next_activity(feed)
        assert report["models"][0]["held"] == 0 and report["models"][0]["idle"] >= 0
        assert gateway.app.proxy.demand.in_flight["m"] == 0

    async def test_past_the_hold_timeout_503_with_retry_after_naming_the_model(self, nursery):
        """No replica within --hold-timeout: 503, Retry-After, a message naming the model and the flag."""
        feed = await serve_feed(nursery, models=["m"])
        feed.set(wake_on_demand=["m"])
        _, url = await start_gateway(
            nursery, feed.url, require_keys=False, proxy=ProxySettings(hold_timeout=0.3)
        )
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            response = await http.post("/v1/completions", json=BODY)
        assert response.status_code == 503
        assert int(response.headers["retry-after"]) >= 1
        error = response.json()["error"]
        assert error["code"] == "model_waking"
        assert "model `m` is at zero replicas" in error["message"] and "--hold-timeout" in error["message"]

    async def test_a_full_hold_queue_answers_503_at_once(self, nursery):
        """With --hold-queue 1, a second request while one is held is refused at once, naming the flag."""
        feed = await serve_feed(nursery, models=["m"])
        feed.set(wake_on_demand=["m"])
        gateway, url = await start_gateway(
            nursery, feed.url, require_keys=False, proxy=ProxySettings(hold_timeout=30, hold_queue=1)
        )

        async def first() -> None:
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                await http.post("/v1/completions", json=BODY)

        nursery.start_soon(first)
        with trio.fail_after(2):
            while not feed.activity or not feed.activity[-1]["models"][0]["held"]:
                await feed.activity_posted.wait()
        assert gateway.app.proxy.demand.held["m"] == 1
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            with trio.fail_after(2):
                response = await http.post("/v1/completions", json=BODY)
        assert response.status_code == 503
        assert "--hold-queue 1" in response.json()["error"]["message"]

    async def test_a_model_that_does_not_wake_on_demand_is_not_held(self, nursery):
        """Without wake_on_demand, a model with no replica is answered 503 at once, as before, and
        left out of /v1/models; one that wakes on demand stays listed at zero replicas."""
        feed = await serve_feed(nursery, models=["m"])
        _, url = await start_gateway(
            nursery, feed.url, require_keys=False, proxy=ProxySettings(hold_timeout=30)
        )
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            with trio.fail_after(2):
                response = await http.post("/v1/completions", json=BODY)
            assert response.status_code == 503
            assert response.json()["error"]["code"] == "model_not_ready"
            assert (await http.get("/v1/models")).json()["data"] == []
            feed.set(wake_on_demand=["m"])
            listed: list = []
            with trio.fail_after(5):
                while not listed:  # the gateway takes the new table
                    await trio.sleep(0.05)
                    listed = (await http.get("/v1/models")).json()["data"]
            assert (await http.get("/v1/models/m")).status_code == 200


@pytest.mark.parametrize("in_flight", [True, False])
def test_activity_says_idle_seconds_and_zero_while_in_flight(in_flight):
    """The report's idle is 0 while a request is in flight, else the seconds since the last one ended."""
    from llmgw.gateway.demand import Demand
    from llmgw.wire import RouteTable

    async def main() -> dict:
        demand = Demand()
        demand.routes_changed(RouteTable(1, models=["m", "n"], wake_on_demand=["m"]))
        demand.began("m")
        if not in_flight:
            demand.ended("m")
        await trio.sleep(7)
        return {a.model: a.idle for a in demand.activity(trio.current_time()).models}

    assert trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0)) == {
        "m": 0.0 if in_flight else 7.0
    }


def test_activity_reports_the_window_s_time_to_first_token_p95():
    """Streams of any model: a report carries the 95th percentile of their first tokens; then a new window."""
    from llmgw.gateway.demand import Demand

    demand = Demand()
    for ms in range(1, 101):
        demand.first_token("chat", ms / 1000)
    [chat] = demand.activity(0).models
    assert (chat.model, chat.ttft_p95, chat.streams, chat.idle) == ("chat", 0.096, 100, None)
    assert demand.activity(1).models == ()


def test_held_requests_leave_in_the_order_they_came():
    """Twelve requests held for a sleeping model go on, once a route comes, in the order they arrived (a
    batch larger than the replica's seats serves its first request first); one that gave up is skipped."""
    from llmgw.gateway.demand import Demand
    from llmgw.wire import RouteTable

    async def main() -> list[int]:
        demand = Demand(hold_timeout=60)
        demand.routes_changed(RouteTable(1, models=["m"], wake_on_demand=["m"]))
        routed = False
        order: list[int] = []

        async def request(index: int, give_up: bool) -> None:
            with trio.move_on_after(1 if give_up else 100):
                assert await demand.hold("m", lambda: routed) is None
                order.append(index)

        async with trio.open_nursery() as nursery:
            for index in range(12):
                nursery.start_soon(request, index, index == 3)
                await trio.sleep(0.01)
            await trio.sleep(5)
            routed = True
            demand.routes_changed(RouteTable(2, models=["m"], wake_on_demand=["m"]))
        return order

    for _ in range(5):  # trio runs a batch of woken tasks in one order or its reverse, at random
        assert trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0)) == [
            i for i in range(12) if i != 3
        ]


def test_the_first_request_after_a_quiet_spell_is_reported_at_once():
    """A model that wakes on demand gets a request after 60 quiet seconds: the server hears of it at once,
    not at the next periodic report (it may be deciding to put the model to sleep)."""
    from llmgw.gateway.demand import Demand
    from llmgw.wire import RouteTable

    async def main() -> list[tuple[float, float | None]]:
        demand = Demand()
        demand.routes_changed(RouteTable(1, models=["m"], wake_on_demand=["m"]))
        posted: list[tuple[float, float | None]] = []

        async def post(activity) -> None:
            posted.extend((trio.current_time(), a.idle) for a in activity.models)

        async with trio.open_nursery() as nursery:
            await nursery.start(partial(demand.run, post, interval=1000))
            demand.began("m")
            demand.ended("m")
            await trio.sleep(60)
            began_at = trio.current_time()
            demand.began("m")
            await trio.sleep(0.5)
            nursery.cancel_scope.cancel()
        return [(at - began_at, idle) for at, idle in posted]

    reports = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert reports[-1] == (0.0, 0.0), reports
