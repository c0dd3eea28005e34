"""Mid-stream migration over real HTTP: fake engines breaking, stalling or unable to continue."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

import attrs
import httpx
import trio

from llmgw.gateway import ProxySettings
from llmgw.net.server import HttpServer, Request, Response
from llmgw.testing.chat import chat_body
from llmgw.testing.gateway import serve_feed, start_gateway
from llmgw.testing.metrics import samples

WORDS = 20
BODY = chat_body("m", "hi", WORDS, stream=True, usage=True)
#: what an unbroken replica answers
REFERENCE = "".join(f" t{i}" if i else "t0" for i in range(WORDS))


@attrs.define
class FakeEngine:
    """A chat engine answering ``t0 t1 t2 ...`` (word i at position i), one event per word, continuing a
    final assistant message from its words; a fresh request's stream breaks (the connection drops) after
    ``break_after`` words, or goes silent after ``hang_after`` (and ``/health`` hangs too) until
    :attr:`released`; ``every_request`` applies that to continuations as well."""

    name: str
    break_after: int | None = None
    hang_after: int | None = None
    every_request: bool = False
    requests: list[dict] = attrs.field(factory=list)
    released: trio.Event = attrs.field(factory=trio.Event)
    #: set when a stream goes silent (``hang_after``)
    hung: trio.Event = attrs.field(factory=trio.Event)

    async def handle(self, request: Request) -> Response:
        if request.path == "/health":
            if self.hang_after is not None:
                await self.released.wait()
            return Response.json(200, {})
        body = request.json()
        self.requests.append(body)
        start = len(body["messages"][-1]["content"].split()) if body.get("continue_final_message") else 0
        return Response.stream(200, self._events(body, start))

    async def _events(self, body: dict, start: int) -> AsyncIterator[bytes]:
        fault = self.every_request or not body.get("continue_final_message")
        id_ = f"chatcmpl-{self.name}-{len(self.requests)}"

        def event(delta: dict | None, finish: str | None = None, usage: dict | None = None) -> bytes:
            choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
            payload = {"id": id_, "object": "chat.completion.chunk", "created": len(self.requests)}
            return b"data: " + json.dumps({**payload, "choices": choices, "usage": usage}).encode() + b"\n\n"

        yield event({"role": "assistant", "content": ""})
        count = body["max_tokens"]
        for i in range(start, start + count):
            if fault and i - start == self.break_after:
                raise trio.BrokenResourceError("the engine died")
            if fault and i - start == self.hang_after:
                self.hung.set()
                await self.released.wait()
            await trio.sleep(0.001)
            yield event({"content": f" t{i}" if i else "t0"})
        yield event({}, "length")
        if (body.get("stream_options") or {}).get("include_usage"):
            yield event(None, usage={"prompt_tokens": 1 + start, "completion_tokens": count})
        yield b"data: [DONE]\n\n"


async def serve_engine(nursery: trio.Nursery, engine: FakeEngine) -> str:
    host, port = await nursery.start(HttpServer(engine.handle).serve, "127.0.0.1", 0)
    return f"http://{host}:{port}"


async def gateway_over(nursery: trio.Nursery, engines: list[FakeEngine], *, continues: bool = True, **proxy):
    """A gateway whose model m is served by ``engines`` (replicas m-0, m-1, ...): (the gateway, its URL)."""
    return (await gateway_and_feed(nursery, engines, continues=continues, **proxy))[:2]


async def gateway_and_feed(
    nursery: trio.Nursery, engines: list[FakeEngine], *, continues: bool = True, **proxy
):
    """:func:`gateway_over`, and the routes feed it reads (tests change the routes)."""
    routes = [(f"m-{i}", await serve_engine(nursery, e), continues) for i, e in enumerate(engines)]
    feed = await serve_feed(nursery, m=routes)
    gateway, url = await start_gateway(nursery, feed.url, require_keys=False, proxy=ProxySettings(**proxy))
    return gateway, url, feed


async def stream(url: str, body: dict = BODY) -> list[dict | str]:
    """The events a client reads from the gateway's stream."""
    with trio.fail_after(15):
        async with httpx.AsyncClient(base_url=url) as http:
            response = await http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200
    events: list[dict | str] = []
    for block in response.content.split(b"\n\n"):
        if block.startswith(b"data: "):
            data = block[6:]
            events.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return events


def text_of(events: list) -> str:
    return "".join(
        e["choices"][0]["delta"].get("content") or ""
        for e in events
        if isinstance(e, dict) and e.get("choices")
    )


async def metric(url: str, name: str, **labels: str) -> float | None:
    """The value of the sample ``name`` with ``labels`` the gateway at ``url`` exports; None without one."""
    async with httpx.AsyncClient() as http:
        text = (await http.get(f"{url}/metrics")).text
    return next((v for found, v in samples(text, name) if labels.items() <= found.items()), None)


class TestContinued:
    """A stream whose replica breaks goes on from another, as one answer."""

    async def test_broken_stream_goes_on_as_one_answer(self, nursery, caplog):
        """The client reads the unbroken text, one id, one role, finish_reason length, usage of one answer."""
        caplog.set_level(logging.INFO, logger="llmgw.gateway.access")
        engines = [FakeEngine("a", break_after=5), FakeEngine("b", break_after=5)]
        _, url = await gateway_over(nursery, engines)
        events = await stream(url)
        assert text_of(events) == REFERENCE
        chunks = [e for e in events if isinstance(e, dict)]
        assert len({e["id"] for e in chunks}) == 1
        assert [e for e in chunks if e["choices"] and "role" in e["choices"][0]["delta"]] == chunks[:1]
        assert [e["choices"][0]["finish_reason"] for e in chunks if e["choices"]][-1] == "length"
        assert chunks[-1]["usage"] == {
            "prompt_tokens": 1,
            "completion_tokens": WORDS,
            "total_tokens": 1 + WORDS,
        }
        assert events[-1] == "[DONE]" and not any("error" in e for e in chunks)
        continuation = next(r for e in engines for r in e.requests if r.get("continue_final_message"))
        assert continuation["messages"][-1] == {"role": "assistant", "content": "t0 t1 t2 t3 t4"}
        assert continuation["add_generation_prompt"] is False and continuation["max_tokens"] == WORDS - 5
        assert await metric(url, "llmgw_gateway_stream_migrations_total", model="m", cause="closed") == 1
        assert await metric(url, "llmgw_gateway_migrated_tokens_total", model="m") == 5
        assert await metric(url, "llmgw_gateway_migration_gap_seconds_count", model="m") == 1
        line = next(r for r in caplog.records if r.name == "llmgw.gateway.access")
        assert line.migrations == 1 and "migrations=1" in line.getMessage()

    async def test_stalled_replica_stream_goes_on(self, nursery):
        """A replica that goes silent mid-stream past the stall timeout: the stream goes on elsewhere."""
        engines = [FakeEngine("a", hang_after=4), FakeEngine("b", hang_after=4)]
        _, url = await gateway_over(nursery, engines, stall_timeout=0.5)
        try:
            events = await stream(url)
        finally:
            for engine in engines:
                engine.released.set()
        assert text_of(events) == REFERENCE
        assert await metric(url, "llmgw_gateway_stream_migrations_total", model="m", cause="stalled") == 1

    async def test_replica_that_left_the_routes_and_fell_silent(self, nursery):
        """A replica that leaves the routes mid-stream and sends nothing more: the stream goes on elsewhere
        once it was silent for the stall timeout, cause ``left_routes``."""
        hung = trio.Event()
        engines = [FakeEngine("a", hang_after=4, hung=hung), FakeEngine("b", hang_after=4, hung=hung)]
        gateway, url, feed = await gateway_and_feed(nursery, engines, stall_timeout=0.5)
        try:
            async with trio.open_nursery() as clients:
                events: list = []

                async def read() -> None:
                    events.extend(await stream(url))

                clients.start_soon(read)
                with trio.fail_after(10):
                    await hung.wait()
                first = next(i for i, e in enumerate(engines) if e.requests)
                # its stream is under way and silent: the replica leaves the routes (a drain, a removal)
                routes = [(f"m-{i}", r[1], True) for i, r in enumerate(feed.routes["m"]) if i != first]
                feed.set(routes={"m": routes})
        finally:
            for engine in engines:
                engine.released.set()
        assert text_of(events) == REFERENCE
        assert await metric(url, "llmgw_gateway_stream_migrations_total", model="m", cause="left_routes") == 1


class TestNotContinued:
    """Streams that cannot go on end as before, with an error event, and the reason is counted."""

    async def test_engine_without_the_mechanism(self, nursery):
        """Replicas whose engine does not continue: the error event, reason ``engine``."""
        _, url = await gateway_over(
            nursery, [FakeEngine("a", break_after=3), FakeEngine("b", break_after=3)], continues=False
        )
        events = await stream(url)
        assert text_of(events) == REFERENCE[: len("t0 t1 t2")]
        assert "failed mid-stream" in events[-1]["error"]["message"]
        assert await metric(url, "llmgw_gateway_streams_not_continued_total", model="m", reason="engine") == 1

    async def test_the_only_replica(self, nursery):
        """One replica: nowhere to go on, reason ``no_replica`` (not ``engine``: its engine continues)."""
        _, url = await gateway_over(nursery, [FakeEngine("a", break_after=3)])
        events = await stream(url)
        assert "failed mid-stream" in events[-1]["error"]["message"]
        name = "llmgw_gateway_streams_not_continued_total"
        assert await metric(url, name, model="m", reason="no_replica") == 1

    async def test_several_choices(self, nursery):
        """``n: 2`` is not continued: reason ``choices``."""
        _, url = await gateway_over(nursery, [FakeEngine("a", break_after=3), FakeEngine("b", break_after=3)])
        events = await stream(url, {**BODY, "n": 2})
        assert "error" in events[-1]
        assert (
            await metric(url, "llmgw_gateway_streams_not_continued_total", model="m", reason="choices") == 1
        )

    async def test_migration_limit(self, nursery):
        """Every replica breaks: after --migration-limit continuations the stream ends with the error event,
        the text so far unbroken, reason ``limit``."""
        engines = [FakeEngine(name, break_after=2, every_request=True) for name in "abcd"]
        _, url = await gateway_over(nursery, engines, migration_limit=2)
        events = await stream(url)
        assert text_of(events) == REFERENCE[: len("t0 t1 t2 t3 t4 t5")]
        assert "error" in events[-1]
        assert await metric(url, "llmgw_gateway_stream_migrations_total", model="m", cause="closed") == 2
        assert await metric(url, "llmgw_gateway_streams_not_continued_total", model="m", reason="limit") == 1

    async def test_limit_zero_turns_it_off(self, nursery):
        """``--migration-limit 0``: the stream ends with the error event as before, reason ``disabled``."""
        _, url = await gateway_over(
            nursery, [FakeEngine("a", break_after=3), FakeEngine("b", break_after=3)], migration_limit=0
        )
        events = await stream(url)
        assert "error" in events[-1]
        assert (
            await metric(url, "llmgw_gateway_streams_not_continued_total", model="m", reason="disabled") == 1
        )
