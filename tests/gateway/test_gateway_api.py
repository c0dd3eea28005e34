"""The gateway's OpenAI-compatible API over real HTTP, with simulated engines as real processes behind it.

Routes come from a fake feed served in-process (tests/test_gateway_server.py uses the real server).
"""

from __future__ import annotations

import functools
import signal
import sys

import httpx
import openai
import pytest
import trio
import trio.testing
from prometheus_client.parser import text_string_to_metric_families

from llmgw.net.server import HttpServer, Limits, Request, Response
from llmgw.testing.gateway import (
    HeldStream,
    serve_feed,
    serve_stream,
    start_gateway,
    start_sim,
    wait_healthy,
)
from llmgw.testing.processes import ProcessSet, free_port, processes, wait_for  # noqa: F401

KEY = "sk-llmgw-test-0123456789abcdef"
MESSAGES = [{"role": "user", "content": "tell me about gateways"}]


@pytest.fixture(scope="module")
def sims(tmp_path_factory):
    """Two simulated replicas of model "m" (no delays), shared by this module's tests."""
    process_set = ProcessSet(tmp_path_factory.mktemp("sims"))
    try:
        yield {"m-0": start_sim(process_set), "m-1": start_sim(process_set)}
    finally:
        process_set.kill_all()


@pytest.fixture
async def feed(nursery, sims):
    """A routes feed with both sims ready for "m", model "cold" with no ready replica, and one key."""
    with trio.fail_after(10):
        await wait_healthy(sim.url for sim in sims.values())
    routes = [(name, sim.url) for name, sim in sims.items()]
    return await serve_feed(nursery, models=["cold"], keys={KEY: "alice"}, m=routes)


@pytest.fixture
async def gateway_url(nursery, feed):
    """A gateway (keys required, 64 KiB body limit) reading that feed; its base URL."""
    with trio.fail_after(10):
        _, url = await start_gateway(nursery, feed.url, limits=Limits(max_body_bytes=64 * 1024))
    return url


def client(url: str, key: str | None = KEY) -> httpx.AsyncClient:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.AsyncClient(base_url=url, headers=headers, timeout=10)


class TestOpenAIClient:
    """The official openai client, given only base_url and api_key."""

    async def test_sync_client(self, gateway_url):
        """Chat, completions, embeddings and the model list work through the gateway with the sync client."""

        def use() -> dict:
            api = openai.OpenAI(base_url=f"{gateway_url}/v1", api_key=KEY)
            chat = api.chat.completions.create(model="m", messages=MESSAGES, max_tokens=8)
            completion = api.completions.create(model="m", prompt="once upon", max_tokens=4)
            embedding = api.embeddings.create(model="m", input=["a", "b"])
            return {
                "chat": chat.choices[0].message.content,
                "usage": chat.usage.completion_tokens,
                "completion": completion.choices[0].text,
                "embeddings": [len(e.embedding) for e in embedding.data],
                "models": [model.id for model in api.models.list()],
            }

        got = await trio.to_thread.run_sync(use)
        assert got["chat"] and got["usage"] == 8
        assert got["completion"]
        assert got["embeddings"] == [64, 64]
        assert got["models"] == ["m"]  # "cold" has no ready replica

    async def test_sync_streaming(self, gateway_url):
        """A streamed chat gives the non-streamed text, chunk by chunk, then a finish reason."""

        def use() -> tuple[str, list[str], str | None]:
            api = openai.OpenAI(base_url=f"{gateway_url}/v1", api_key=KEY)
            whole = api.chat.completions.create(model="m", messages=MESSAGES, max_tokens=12, seed=3)
            pieces, finish = [], None
            for chunk in api.chat.completions.create(
                model="m", messages=MESSAGES, max_tokens=12, seed=3, stream=True
            ):
                if chunk.choices:
                    pieces.append(chunk.choices[0].delta.content or "")
                    finish = chunk.choices[0].finish_reason or finish
            return whole.choices[0].message.content, pieces, finish

        whole, pieces, finish = await trio.to_thread.run_sync(use)
        assert len([p for p in pieces if p]) == 12
        assert "".join(pieces) == whole
        assert finish == "length"

    async def test_async_streaming(self, gateway_url):
        """AsyncOpenAI streams completions through the gateway (on trio)."""
        api = openai.AsyncOpenAI(base_url=f"{gateway_url}/v1", api_key=KEY)
        stream = await api.completions.create(model="m", prompt="hello", max_tokens=5, stream=True)
        texts = [chunk.choices[0].text async for chunk in stream if chunk.choices]
        assert len([t for t in texts if t]) == 5

    async def test_errors_raise_the_right_exceptions(self, gateway_url):
        """An unknown model raises NotFoundError and a bad key AuthenticationError, with OpenAI's codes."""

        def use() -> tuple[openai.APIStatusError, openai.APIStatusError]:
            api = openai.OpenAI(base_url=f"{gateway_url}/v1", api_key=KEY)
            with pytest.raises(openai.NotFoundError) as missing:
                api.chat.completions.create(model="nope", messages=MESSAGES)
            bad = openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="sk-wrong-key-123456")
            with pytest.raises(openai.AuthenticationError) as refused:
                bad.models.list()
            return missing.value, refused.value

        missing, refused = await trio.to_thread.run_sync(use)
        assert missing.code == "model_not_found" and missing.param == "model"
        assert refused.code == "invalid_api_key"


BIG = b'{"model": "m", "prompt": "' + b"x" * (65 * 1024) + b'"}'


class TestErrors:
    """Every refusal is a specific OpenAI-shaped error."""

    @pytest.mark.parametrize(
        ("key", "method", "path", "body", "status", "code", "param"),
        [
            (None, "POST", "/v1/chat/completions", b'{"model": "m"}', 401, None, None),
            (
                "sk-not-a-key-0000",
                "POST",
                "/v1/chat/completions",
                b'{"model": "m"}',
                401,
                "invalid_api_key",
                None,
            ),
            (None, "GET", "/v1/models", b"", 401, None, None),
            (
                KEY,
                "POST",
                "/v1/chat/completions",
                b'{"model": "gpt-9", "messages": []}',
                404,
                "model_not_found",
                "model",
            ),
            (
                KEY,
                "POST",
                "/v1/embeddings",
                b'{"model": "cold", "input": "x"}',
                503,
                "model_not_ready",
                "model",
            ),
            (KEY, "POST", "/v1/chat/completions", b'{"model": "m",', 400, "invalid_json", None),
            (KEY, "POST", "/v1/completions", b'{"prompt": "x"}', 400, None, "model"),
            (KEY, "POST", "/v1/completions", b"[1, 2]", 400, None, None),
            (KEY, "POST", "/v1/completions", BIG, 413, None, None),
            (KEY, "GET", "/v1/models/gpt-9", b"", 404, "model_not_found", "model"),
            (KEY, "GET", "/v1/chat/completions", b"", 405, None, None),
            (KEY, "POST", "/v1/images/generations", b"{}", 404, None, None),
        ],
        ids=[
            "no-key",
            "bad-key",
            "models-no-key",
            "unknown-model",
            "not-ready",
            "malformed-json",
            "no-model",
            "not-an-object",
            "oversized",
            "retrieve-unknown",
            "wrong-method",
            "unknown-path",
        ],
    )
    async def test_error_shape(self, gateway_url, key, method, path, body, status, code, param):
        """Status, code and param are specific; the body has exactly OpenAI's error keys."""
        async with client(gateway_url, key) as http:
            response = await http.request(method, path, content=body)
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["message"]
        assert error["type"] == ("server_error" if status >= 500 else "invalid_request_error")
        assert (error["code"], error["param"]) == (code, param)
        if status == 503:
            assert int(response.headers["retry-after"]) > 0

    async def test_no_keys_created_yet(self, nursery, sims):
        """A feed without "keys" (none created yet) means every key is refused, and the message says why."""
        feed = await serve_feed(nursery, m=[("m-0", sims["m-0"].url)])
        _, gateway = await start_gateway(nursery, feed.url)
        async with client(gateway) as http:
            response = await http.get("/v1/models")
        assert response.status_code == 401
        assert "none has been created yet" in response.json()["error"]["message"]

    async def test_every_key_revoked_says_so(self, nursery, feed):
        """Once the only key is revoked, the 401 says every key was revoked and how to create one."""
        _, gateway = await start_gateway(nursery, feed.url)
        async with client(gateway) as http:
            assert (await http.get("/v1/models")).status_code == 200
            feed.set(keys={})

            async def refused():
                response = await http.get("/v1/models")
                return response if response.status_code == 401 else None

            with trio.fail_after(10):
                response = await wait_for(refused, "the gateway refusing keys once none is in force")
        message = response.json()["error"]["message"]
        assert "every one has been revoked" in message and "none has been created" not in message
        assert "llmgw ctl keys create NAME" in message

    async def test_without_keys_anyone_is_served(self, nursery, feed, caplog):
        """A gateway started without keys serves requests with no Authorization, and warns that it does."""
        _, url = await start_gateway(nursery, feed.url, require_keys=False)
        async with client(url, key=None) as http:
            response = await http.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES})
        assert response.status_code == 200
        assert any("WITHOUT API keys" in r.getMessage() for r in caplog.records if r.levelname == "WARNING")


class TestRouting:
    """Which replica answers."""

    async def test_session_affinity(self, gateway_url):
        """One X-Session-Id goes to one replica, many sessions use both; X-Request-Id comes back."""
        body = {"model": "m", "messages": MESSAGES, "max_tokens": 1}
        async with client(gateway_url) as http:
            one = set()
            for i in range(8):
                response = await http.post(
                    "/v1/chat/completions",
                    json=body,
                    headers={"x-session-id": "conversation-42", "x-request-id": f"mine-{i}"},
                )
                assert response.headers["x-request-id"] == f"mine-{i}"
                one.add(response.headers["x-llmgw-replica"])
            many = set()
            for i in range(24):
                response = await http.post(
                    "/v1/chat/completions", json=body, headers={"x-session-id": f"s{i}"}
                )
                many.add(response.headers["x-llmgw-replica"])
        assert len(one) == 1
        assert many == {"m-0", "m-1"}

    async def test_least_outstanding_requests(self, nursery):
        """While one replica holds a request, the next request goes to the other."""
        release = trio.Event()
        arrivals: list[str] = []

        def upstream(name: str):
            async def handle(request: Request) -> Response:
                arrivals.append(name)
                await release.wait()
                return Response.json(200, {"replica": name})

            return handle

        urls = {}
        for name in ("busy", "idle"):
            host, port = await nursery.start(HttpServer(upstream(name)).serve, "127.0.0.1", 0)
            urls[name] = f"http://{host}:{port}"
        feed = await serve_feed(nursery, m=[("a", urls["busy"]), ("b", urls["idle"])])
        _, gateway = await start_gateway(nursery, feed.url, require_keys=False, routing="least-outstanding")
        async with client(gateway, key=None) as http, trio.open_nursery() as requests:
            body = {"model": "m", "prompt": "x"}
            for _ in range(4):
                requests.start_soon(functools.partial(http.post, "/v1/completions", json=body))
                await trio.testing.wait_all_tasks_blocked()
            assert sorted(arrivals) == ["busy", "busy", "idle", "idle"]
            assert arrivals[0] != arrivals[1] and arrivals[2] != arrivals[3]
            release.set()

    async def test_prefix_routing_keeps_a_prompt_prefix_on_one_replica(self, gateway_url):
        """By default the turns of a conversation (same beginning) go to one replica; other prompts spread."""
        system = {"role": "system", "content": "You are a patient assistant. " * 40}
        turns = [system]
        async with client(gateway_url) as http:
            replicas = set()
            for i in range(6):
                turns.append({"role": "user", "content": f"question {i}"})
                body = {"model": "m", "messages": turns, "max_tokens": 1}
                response = await http.post("/v1/chat/completions", json=body)
                assert response.status_code == 200
                replicas.add(response.headers["x-llmgw-replica"])
                turns.append(response.json()["choices"][0]["message"])
            assert len(replicas) == 1
            spread = set()
            for i in range(24):
                body = {"model": "m", "messages": [{"role": "user", "content": f"tenant {i} " * 100}]}
                response = await http.post("/v1/chat/completions", json=body)
                spread.add(response.headers["x-llmgw-replica"])
            assert spread == {"m-0", "m-1"}


def metric_values(text: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} from a Prometheus exposition."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


class TestMetrics:
    """GET /metrics."""

    async def test_exposition(self, gateway_url):
        """Requests, latency, time to first token, in-flight, breakers, replicas, route age: exported."""
        body = {"model": "m", "messages": MESSAGES, "max_tokens": 3}
        async with client(gateway_url) as http:
            assert (await http.post("/v1/chat/completions", json=body)).status_code == 200
            async with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as streamed:
                await streamed.aread()
            assert (
                await http.post("/v1/chat/completions", json={**body, "model": "nope"})
            ).status_code == 404
            exposition = await http.get("/metrics", headers={"authorization": ""})
        assert exposition.status_code == 200
        assert exposition.headers["content-type"].startswith("text/plain")
        values = metric_values(exposition.text)
        chat = (("endpoint", "chat/completions"), ("model", "m"), ("status", "200"))
        assert values[("llmgw_gateway_requests_total", chat)] == 2
        unknown = (("endpoint", "chat/completions"), ("model", "(unknown)"), ("status", "404"))
        assert values[("llmgw_gateway_requests_total", unknown)] == 1
        duration = (("endpoint", "chat/completions"), ("model", "m"))
        assert values[("llmgw_gateway_request_duration_seconds_count", duration)] == 2
        assert values[("llmgw_gateway_time_to_first_token_seconds_count", (("model", "m"),))] == 1
        for replica in ("m-0", "m-1"):
            labels = (("model", "m"), ("replica", replica))
            assert values[("llmgw_gateway_in_flight_requests", labels)] == 0
            assert values[("llmgw_gateway_breaker_state", labels)] == 0
        assert values[("llmgw_gateway_ready_replicas", (("model", "m"),))] == 2
        assert values[("llmgw_gateway_ready_replicas", (("model", "cold"),))] == 0
        assert values[("llmgw_gateway_routes_feed_up", ())] == 1
        assert 0 <= values[("llmgw_gateway_routes_age_seconds", ())] < 10


class TestLifecycle:
    """Starting and stopping."""

    async def test_shutdown_lets_a_stream_finish_then_serve_returns(self, nursery):
        """shutdown(grace) refuses new clients, lets a stream in flight finish, and serve() returns."""
        from llmgw.gateway import Gateway, GatewayConfig

        held = HeldStream(b'data: {"n": 1}\n\n', b"data: [DONE]\n\n")
        engine_url = await serve_stream(nursery, held)
        feed = await serve_feed(nursery, m=[("m-0", engine_url)])
        gateway = Gateway(GatewayConfig(server=feed.url, host="127.0.0.1", port=0, require_keys=False))
        returned = trio.Event()

        async def serve(*, task_status=trio.TASK_STATUS_IGNORED) -> None:
            await gateway.serve(task_status=task_status)
            returned.set()

        host, port = await nursery.start(serve)
        url = f"http://{host}:{port}"
        with trio.fail_after(10):
            await wait_healthy([url])
            async with client(url, key=None) as http:
                body = {"model": "m", "messages": MESSAGES, "stream": True}
                async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                    chunks = response.aiter_bytes()
                    assert await chunks.__anext__() == b'data: {"n": 1}\n\n'
                    gateway.shutdown(5)
                    assert not returned.is_set()
                    held.release()
                    assert b"".join([chunk async for chunk in chunks]) == b"data: [DONE]\n\n"
                await returned.wait()
                with pytest.raises(httpx.ConnectError):
                    await http.get("/health")
        assert gateway.upstreams.idle_count() == 0


class TestCommand:
    """``llmgw gateway`` as a process."""

    async def test_runs_warns_without_keys_and_stops_on_sigterm(self, nursery, sims, processes):  # noqa: F811
        """The command serves requests, logs the no-keys warning, and exits 0 on SIGTERM."""
        feed = await serve_feed(nursery, m=[("m-0", sims["m-0"].url)])
        port = free_port()
        gateway = processes.start(
            [
                sys.executable,
                "-m",
                "llmgw.gateway",
                "--server",
                feed.url,
                "--listen",
                f"127.0.0.1:{port}",
                "--no-keys",
            ],
            name="gateway",
        )
        with trio.fail_after(15):
            line = await gateway.wait_for_stderr_trio("WITHOUT API keys")
        assert f"127.0.0.1:{port}" in line
        with trio.fail_after(10):
            await wait_healthy([f"http://127.0.0.1:{port}"])
        async with client(f"http://127.0.0.1:{port}", key=None) as http:
            response = await http.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES})
        assert response.status_code == 200
        gateway.signal(signal.SIGTERM)
        with trio.fail_after(10):
            assert await gateway.wait_exit_trio() == 0
