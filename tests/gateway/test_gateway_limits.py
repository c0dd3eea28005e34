"""A gateway enforcing key limits from its routes feed, over real HTTP: 403 and 429 in OpenAI's shape with
Retry-After; streams under way are never cut; new limits apply without a restart."""

from __future__ import annotations

import json

import httpx
import pytest
import trio

from llmgw.net.server import HttpServer, Request, Response
from llmgw.testing.clock import FakeClock
from llmgw.testing.gateway import HeldStream, serve_feed, start_gateway
from llmgw.testing.processes import wait_for
from llmgw.wire import KeyLimits

KEYS = {"sk-alice-0123456789": "alice", "sk-bob-0123456789": "bob"}
ALICE, BOB = list(KEYS)


class Engine:
    """An engine in-process: JSON answers with 10 + 20 tokens of usage; streams held until released."""

    def __init__(self) -> None:
        self.held = HeldStream(b'data: {"choices": [{"text": "a"}]}\n\n', b"data: [DONE]\n\n")

    async def handle(self, request: Request) -> Response:
        body = json.loads(request.body)
        if body.get("stream") and body.get("events"):  # that many events at once, without usage
            return Response.stream(200, _events(body["events"]))
        if body.get("stream"):
            return Response.stream(200, self.held())
        usage = {"prompt_tokens": 10, "completion_tokens": 20, "total_tokens": 30}
        return Response.json(200, {"object": "text_completion", "choices": [{"text": "a"}], "usage": usage})


async def _events(count: int):
    for _ in range(count):
        yield b'data: {"choices": [{"text": "a"}]}\n\n'
    yield b"data: [DONE]\n\n"


@pytest.fixture
async def setup(nursery):
    """(feed, gateway, its URL, the engine): models m (one replica) and n (listed, not ready); two keys."""
    engine = Engine()
    host, port = await nursery.start(HttpServer(engine.handle).serve, "127.0.0.1", 0)
    with trio.fail_after(10):
        feed = await serve_feed(nursery, models=["n"], keys=KEYS, m=[("m-0", f"http://{host}:{port}")])
        gateway, url = await start_gateway(nursery, feed.url)
    gateway.admission.clock = FakeClock()  # moved by the test; the gateway's own timers keep trio's
    return feed, gateway, url, engine


async def set_limits(feed, gateway, **limits: KeyLimits) -> None:
    """Hand the gateway new limits and wait until it has them."""
    revision = feed.set(limits=limits)
    with trio.fail_after(10):
        await wait_for(lambda: gateway.watcher.table.revision == revision, "the gateway to read the limits")


async def complete(url: str, key: str, model: str = "m", **body) -> httpx.Response:
    async with httpx.AsyncClient(timeout=10) as client:
        return await client.post(
            f"{url}/v1/completions",
            json={"model": model, "prompt": "hi"} | body,
            headers={"authorization": f"Bearer {key}"},
        )


async def test_rpm_refuses_with_429_retry_after_and_a_readable_error(setup):
    """With rpm 2, alice's third request in a minute is a 429 naming the limit; bob is unaffected."""
    feed, gateway, url, _ = setup
    await set_limits(feed, gateway, alice=KeyLimits(rpm=2))
    assert [(await complete(url, ALICE)).status_code for _ in range(2)] == [200, 200]
    refused = await complete(url, ALICE)
    assert refused.status_code == 429
    assert refused.headers["retry-after"] == "30"
    assert refused.headers["x-request-id"]
    error = refused.json()["error"]
    assert error["type"] == "rate_limit_exceeded" and error["code"] == "rpm_limit"
    assert error["message"] == (
        "API key 'alice' is over its limit of 2 requests per minute (rpm); retry in 30 s."
    )
    assert [(await complete(url, BOB)).status_code for _ in range(5)] == [200] * 5
    gateway.admission.clock.now += 30
    assert (await complete(url, ALICE)).status_code == 200
    async with httpx.AsyncClient(timeout=10) as client:
        metrics = (await client.get(f"{url}/metrics")).text
    assert 'llmgw_gateway_key_refusals_total{key="alice",limit="rpm"} 1.0' in metrics
    assert 'llmgw_gateway_key_requests_total{key="alice",model="m",status="429"} 1.0' in metrics


async def test_a_model_not_allowed_is_403_naming_model_and_key(setup):
    """A key allowed only `m` gets 403 for `n` (even though `n` is not ready), and is served `m`."""
    feed, gateway, url, _ = setup
    await set_limits(feed, gateway, alice=KeyLimits(models=("m",)))
    refused = await complete(url, ALICE, model="n")
    assert refused.status_code == 403 and "retry-after" not in refused.headers
    error = refused.json()["error"]
    assert error["code"] == "models_limit" and error["param"] == "model"
    assert error["message"] == "API key 'alice' may not use the model `n`; ask an operator to allow it."
    assert (await complete(url, ALICE)).status_code == 200
    assert (await complete(url, BOB, model="n")).status_code == 503  # not ready, as for any key
    async with httpx.AsyncClient(timeout=10) as client:
        metrics = (await client.get(f"{url}/metrics")).text
    assert 'llmgw_gateway_key_refusals_total{key="alice",limit="models"} 1.0' in metrics


async def test_tpm_charges_usage_after_the_answer(setup):
    """tpm 40: answers of 30 tokens each; the second leaves the bucket negative and the third is refused."""
    feed, gateway, url, _ = setup
    await set_limits(feed, gateway, alice=KeyLimits(tpm=40))
    assert (await complete(url, ALICE)).status_code == 200
    assert (await complete(url, ALICE)).status_code == 200
    refused = await complete(url, ALICE)
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "tpm_limit"
    assert refused.headers["retry-after"] == "30"  # 20 tokens below zero at 40/60 a second
    assert "40 tokens per minute (tpm)" in refused.json()["error"]["message"]


async def test_a_stream_without_usage_is_charged_an_estimate(setup):
    """tpm 60: a stream of 40 events that carries no usage is charged about 40 + its prompt's tokens; a
    second such stream leaves the bucket negative and the next request is refused."""
    feed, gateway, url, _ = setup
    await set_limits(feed, gateway, alice=KeyLimits(tpm=60))
    prompt = "x" * 40  # 10 tokens at 4 characters each
    for _ in range(2):
        streamed = await complete(url, ALICE, prompt=prompt, stream=True, events=40)
        assert streamed.status_code == 200 and streamed.text.count("data:") == 41
    refused = await complete(url, ALICE)
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "tpm_limit"
    assert refused.headers["retry-after"] == "40"  # 100 charged of 60: 40 below zero at 1 a second


async def test_concurrency_and_a_running_stream_is_never_cut(setup):
    """With concurrency 1, a second request waits its turn; lowering the limits mid-stream does not cut
    the stream under way, which ends whole and frees its place."""
    feed, gateway, url, engine = setup
    await set_limits(feed, gateway, alice=KeyLimits(concurrency=1))
    async with httpx.AsyncClient(timeout=10) as client, trio.open_nursery() as nursery:
        body = {"model": "m", "prompt": "hi", "stream": True}
        headers = {"authorization": f"Bearer {ALICE}"}
        async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as stream:
            assert stream.status_code == 200
            chunks = stream.aiter_bytes()
            assert b'"text": "a"' in await chunks.__anext__()
            refused = await complete(url, ALICE)
            assert refused.status_code == 429 and refused.json()["error"]["code"] == "concurrency_limit"
            assert refused.headers["retry-after"] == "1"
            await set_limits(feed, gateway, alice=KeyLimits(concurrency=1, rpm=1, models=("n",)))
            engine.held.release()
            rest = b"".join([chunk async for chunk in chunks])
            assert rest.endswith(b"data: [DONE]\n\n") and b"error" not in rest
        nursery.cancel_scope.cancel()
    with trio.fail_after(10):
        await wait_for(lambda: gateway.admission.in_flight("alice") == 0, "the stream's place to free")
    await set_limits(feed, gateway, alice=KeyLimits(concurrency=1))
    assert (await complete(url, ALICE)).status_code == 200
