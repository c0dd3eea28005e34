"""A stand-in for the server's routes feed, for tests and the gateway benchmark.

:class:`FakeRoutesFeed` serves ``GET /v1/routes`` over plain HTTP with the
server's long-poll semantics (answer at once when the revision differs from
the one asked about, else when it changes or after ``poll_timeout``), from
routes a test sets with :meth:`FakeRoutesFeed.set`; it keeps the gateway's
stall reports (``POST /v1/gateway/suspect``) in :attr:`FakeRoutesFeed.suspects` and its
activity reports (``POST /v1/gateway/activity``) in :attr:`FakeRoutesFeed.activity`::

    feed = FakeRoutesFeed(models=["m"])
    url = await nursery.start(feed.serve)
    feed.set(routes={"m": [("m-0", sim_url)]}, keys={"secret": "alice"})
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import attrs
import trio

from llmgw.dev.cluster import program
from llmgw.gateway.main import Gateway, GatewayConfig
from llmgw.net.client import ConnectionPool, HttpClientError
from llmgw.net.server import HttpServer, Request, Response
from llmgw.wire import KeyLimits, Route, RouteTable, to_json

if TYPE_CHECKING:
    from llmgw.testing.processes import ManagedProcess, ProcessSet

__all__ = [
    "EndlessStream", "FakeRoutesFeed", "HeldStream", "Sim", "serve_feed", "serve_stream", "sim_program",
    "sim_argv", "sims_behind_feed", "start_sim", "start_gateway", "streaming", "wait_healthy",
]  # fmt: skip


def sim_program() -> str:
    """The ``llmgw-sim`` console script next to this interpreter (or on ``PATH``)."""
    return program("llmgw-sim")


def sim_argv(port: int, *args: str, host: str = "127.0.0.1", model: str = "m") -> list[str]:
    """The command of a simulated engine serving ``model`` on ``host:port``, quiet per request."""
    return [
        sim_program(),
        "--model",
        f"test/{model}",
        "--served-model-name",
        model,
        "--host",
        host,
        "--port",
        str(port),
        "--disable-log-requests",
        *args,
    ]


@attrs.frozen
class Sim:
    """A simulated engine process and its base URL."""

    process: ManagedProcess
    port: int
    url: str


def start_sim(
    processes: ProcessSet, *args: str, model: str = "m", host: str = "127.0.0.1", port: int = 0
) -> Sim:
    """Start ``llmgw-sim`` for ``model`` on a free port (or ``port``) in ``processes``.

    It serves once :func:`wait_healthy` returns for its URL.
    """
    from llmgw.testing.processes import free_port

    port = port or free_port(host)
    process = processes.start(sim_argv(port, *args, host=host, model=model), name=f"sim-{model}")
    return Sim(process, port, f"http://{host}:{port}")


async def wait_healthy(urls: Iterable[str], *, path: str = "/health") -> None:
    """Return once ``GET url + path`` answers 200 for every URL (callers own the deadline)."""
    pending = [url.rstrip("/") for url in urls]
    async with ConnectionPool(connect_timeout=1.0) as pool:
        while pending:
            still = []
            for url in pending:
                try:
                    ok = (await pool.request("GET", url + path)).status == 200
                except HttpClientError:
                    ok = False
                if not ok:
                    still.append(url)
            pending = still
            if pending:
                await trio.sleep(0.02)


async def start_gateway(nursery: trio.Nursery, feed: str, **config: object) -> tuple[Gateway, str]:
    """Serve a gateway on 127.0.0.1 (port 0) reading routes from ``feed``; return after its first routes.

    ``config`` overrides :class:`GatewayConfig` fields. Returns the gateway and its base URL.
    """
    gateway = Gateway(GatewayConfig(server=feed, **{"host": "127.0.0.1", "port": 0, **config}))
    host, port = await nursery.start(gateway.serve)
    url = f"http://{host}:{port}"
    await wait_healthy([url])
    return gateway, url


@attrs.define
class HeldStream:
    """A streamed body that sends ``first``, then holds ``rest`` back until :meth:`release`.

    Called (``held()``) as the ``chunks`` of :func:`streaming`, by tests that check a chunk arrives before the
    body ends, or what happens to a stream that goes silent (``rest`` empty: it ends only when released).
    """

    first: bytes
    rest: bytes = b""
    released: trio.Event = attrs.field(factory=trio.Event)

    async def __call__(self) -> AsyncIterator[bytes]:
        yield self.first
        await self.released.wait()
        if self.rest:
            yield self.rest

    def release(self) -> None:
        """Let the rest of the body go."""
        self.released.set()


@attrs.define
class EndlessStream:
    """A streamed body that sends ``chunk`` every ``interval`` seconds until its reader leaves.

    Called (``endless()``) as the ``chunks`` of :func:`streaming`, by tests that check a client leaving
    mid-stream ends the body: :attr:`stopped` is set once it is closed, :attr:`sent` counts the chunks.
    """

    chunk: bytes = b"data: token\n\n"
    interval: float = 0.01
    sent: int = 0
    stopped: trio.Event = attrs.field(factory=trio.Event)

    async def __call__(self) -> AsyncIterator[bytes]:
        try:
            while True:
                self.sent += 1
                yield self.chunk
                await trio.sleep(self.interval)
        finally:
            self.stopped.set()


def streaming(chunks: Callable[[], AsyncIterator[bytes]]) -> Callable[[Request], Awaitable[Response]]:
    """A handler answering every request with a stream (``text/event-stream``) of what ``chunks()`` yields.

    Called by tests that stand in for an engine's streamed answer; :returns: the handler for an HttpServer.
    """

    async def handler(request: Request) -> Response:
        return Response.stream(200, chunks())

    return handler


async def serve_stream(nursery: trio.Nursery, chunks: Callable[[], AsyncIterator[bytes]]) -> str:
    """Serve :func:`streaming` of ``chunks`` on 127.0.0.1 (port 0) in ``nursery``: an engine whose answers a
    test paces. :returns: its base URL."""
    host, port = await nursery.start(HttpServer(streaming(chunks)).serve, "127.0.0.1", 0)
    return f"http://{host}:{port}"


class FakeRoutesFeed:
    """``GET /v1/routes`` from routes held in memory; each :meth:`set` moves the revision."""

    def __init__(self, *, models: Iterable[str] = (), poll_timeout: float = 5.0) -> None:
        self.models: list[str] = sorted(models)
        self.routes: dict[str, list[tuple]] = {}
        #: plain API key -> name; None leaves "keys" out of the document
        self.keys: dict[str, str] | None = None
        #: API key name -> its limits (keys not named are unlimited)
        self.limits: dict[str, KeyLimits] = {}
        self.revision = 1
        self.poll_timeout = poll_timeout
        #: polls answered so far
        self.polls = 0
        #: the gateway's reports (``POST /v1/gateway/suspect`` bodies), oldest first
        self.suspects: list[dict] = []
        #: models named as waking on demand (the feed's ``wake_on_demand``)
        self.wake_on_demand: list[str] = []
        #: the gateway's activity reports (``POST /v1/gateway/activity`` bodies), oldest first
        self.activity: list[dict] = []
        #: set (and replaced) at every activity report
        self.activity_posted = trio.Event()
        self._changed = trio.Event()
        self.server: HttpServer | None = None
        #: the base URL it serves on, once :func:`serve_feed` started it
        self.url: str | None = None

    def set(
        self,
        *,
        routes: Mapping[str, Sequence[tuple]] | None = None,
        models: Iterable[str] | None = None,
        keys: Mapping[str, str] | None = None,
        wake_on_demand: Iterable[str] | None = None,
        limits: Mapping[str, KeyLimits] | None = None,
    ) -> int:
        """Replace what is given (routes as model -> [(replica id, url)], or [(replica id, url, whether it
        continues a final assistant message)]; keys as secret -> name; the
        models that wake on demand; limits as key name -> :class:`~llmgw.wire.KeyLimits`).

        Every model with routes is added to the models. Wakes the pollers; returns the new revision.
        """
        if routes is not None:
            self.routes = {model: list(entries) for model, entries in routes.items()}
        if models is not None:
            self.models = sorted(models)
        if keys is not None:
            self.keys = dict(keys)
        if wake_on_demand is not None:
            self.wake_on_demand = sorted(wake_on_demand)
        if limits is not None:
            self.limits = dict(limits)
        self.models = sorted(set(self.models) | set(self.routes) | set(self.wake_on_demand))
        self.revision += 1
        self._changed.set()
        self._changed = trio.Event()
        return self.revision

    def document(self) -> dict:
        """The JSON the server's feed would answer now (a :class:`~llmgw.wire.RouteTable`)."""
        keys = None
        if self.keys is not None:
            keys = {hashlib.sha256(k.encode()).hexdigest(): v for k, v in self.keys.items()}
        table = RouteTable(
            revision=self.revision,
            models=self.models,
            routes={model: [Route(*entry) for entry in entries] for model, entries in self.routes.items()},
            keys=keys,
            wake_on_demand=self.wake_on_demand,
            limits=self.limits,
        )
        return to_json(table)

    async def handle(self, request: Request) -> Response:
        """The :class:`llmgw.net.server.HttpServer` handler."""
        if request.path == "/v1/gateway/suspect" and request.method == "POST":
            report = request.json()
            self.suspects.append(report)
            return Response.json(202, {"replica": report.get("replica"), "state": "unknown"})
        if request.path == "/v1/gateway/activity" and request.method == "POST":
            self.activity.append(request.json())
            self.activity_posted.set()
            self.activity_posted = trio.Event()
            return Response.json(202, request.json())
        if request.path != "/v1/routes":
            return Response.json(404, {"error": {"message": f"no such endpoint: {request.path}"}})
        known = int(request.query.get("revision", "0"))
        if request.query.get("wait") == "1":
            with trio.move_on_after(self.poll_timeout):
                while self.revision == known:
                    await self._changed.wait()
        self.polls += 1
        return Response.json(200, self.document())

    async def serve(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve until cancelled; ``task_status.started(base URL)`` once listening."""
        self.server = HttpServer(self.handle)
        await self.server.serve(host, port, task_status=_Url(task_status))


async def serve_feed(
    nursery: trio.Nursery,
    *,
    keys: Mapping[str, str] | None = None,
    models: Iterable[str] = (),
    **routes: Sequence[tuple],
) -> FakeRoutesFeed:
    """A :class:`FakeRoutesFeed` serving in ``nursery`` (127.0.0.1, port 0), for a gateway under test to read.

    :param keys: API keys (secret -> name) the feed hands out.
    :param models: models listed even with no routes.
    :param routes: model -> [(replica id, url)].
    :returns: the feed; its base URL is ``feed.url``.
    """
    feed = FakeRoutesFeed(models=models)
    feed.url = await nursery.start(feed.serve)
    feed.set(routes=routes, keys=keys)
    return feed


async def sims_behind_feed(
    nursery: trio.Nursery, processes: ProcessSet, *replicas: str, sim_args: Sequence[str] = ()
) -> tuple[list[Sim], FakeRoutesFeed]:
    """One sim per replica id, started with ``sim_args``, as the replicas of model ``m`` of a feed.

    Called by gateway tests before they start a gateway on ``feed.url`` (callers own the deadline).

    :returns: the sims (in the order of ``replicas``, each healthy) and the feed, serving in ``nursery``.
    """
    sims = [start_sim(processes, *sim_args) for _ in replicas]
    await wait_healthy([sim.url for sim in sims])
    feed = await serve_feed(nursery, m=list(zip(replicas, (sim.url for sim in sims), strict=True)))
    return sims, feed


class _Url:
    """Turns the server's ``started((host, port))`` into ``started("http://host:port")``."""

    def __init__(self, task_status: trio.TaskStatus[str]) -> None:
        self._task_status = task_status

    def started(self, address: tuple[str, int]) -> None:
        self._task_status.started(f"http://{address[0]}:{address[1]}")
