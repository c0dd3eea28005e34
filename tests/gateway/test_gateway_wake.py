"""Models at zero replicas: the gateway holds their requests, tells the server at once, sends them on wake."""

from __future__ import annotations

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
    """The next activity report the gateway posts (5 s at most)."""
    with trio.fail_after(5):
        await feed.activity_posted.wait()
    return feed.activity[-1]


class TestHold:
    """A request for a model at zero replicas waits for the first replica the routes bring."""

    async def test_held_request_is_reported_at_once_and_answered_on_wake(self, nursery):
        """The server hears of the held request within a second; the request goes to the replica that
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
        with trio.fail_after(1):
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
