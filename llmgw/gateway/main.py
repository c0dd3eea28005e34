"""Running a gateway: :class:`GatewayConfig`, :class:`Gateway` and :func:`serve_gateway`."""

from __future__ import annotations

import logging
from functools import partial
from pathlib import Path
from urllib.parse import urlsplit

import attrs
import trio

from llmgw.cli import error_leaves
from llmgw.errors import LlmgwError
from llmgw.gateway.admission import Admission
from llmgw.gateway.app import GatewayApp
from llmgw.gateway.balancer import Balancer
from llmgw.gateway.demand import ACTIVITY_PATH
from llmgw.gateway.leases import Leases
from llmgw.gateway.metrics import GatewayMetrics
from llmgw.gateway.proxy import Proxy, ProxySettings
from llmgw.gateway.queue import Queues, QueueSettings
from llmgw.gateway.reports import HeldReporter, SuspectReporter
from llmgw.gateway.routes import RoutesWatcher, RouteTable
from llmgw.gateway.stalls import StallWatch
from llmgw.net.client import ConnectionPool
from llmgw.net.server import HttpServer, Limits, ParsedRequest, Request, Response
from llmgw.pki import client_ssl_context
from llmgw.serverlist import parse_servers

__all__ = ["GatewayConfig", "GatewayError", "Gateway", "serve_gateway"]

log = logging.getLogger("llmgw.gateway")


class GatewayError(LlmgwError):
    """A gateway that cannot start as configured."""


@attrs.frozen
class GatewayConfig:
    """Everything a gateway is started with. Times are in seconds."""

    #: the server's base URL (``https://host:7443``); ``http://`` only for test feeds
    server: str
    #: the CA certificate the server's certificate must chain to
    ca: Path | None = None
    #: a gateway (or admin) client certificate and its key, to read routes
    cert: Path | None = None
    key: Path | None = None
    host: str = "0.0.0.0"
    port: int = 8080
    #: False serves everyone without an API key (logged as a warning)
    require_keys: bool = True
    proxy: ProxySettings = ProxySettings()
    #: consecutive failures that take a replica out
    breaker_failures: int = 3
    #: how long a replica stays out before one probe request
    breaker_open_for: float = 5.0
    #: connecting to a replica or to the server
    connect_timeout: float = 2.0
    #: idle keep-alive connections kept per replica
    max_idle_per_replica: int = 128
    #: one poll of the routes feed, long-poll wait included
    routes_request_timeout: float = 30.0
    #: between attempts to reach the server while it does not answer
    routes_retry_interval: float = 0.5
    #: what clients may send (a larger body is answered 413; past the bytes held for all, 503)
    limits: Limits = Limits(
        max_body_bytes=32 * 1024 * 1024, max_buffered_bytes=128 * 1024 * 1024, idle_timeout=60.0
    )
    #: how a replica is chosen for a request without a session: ``least-outstanding``, ``prefix``, ``random``
    routing: str = "prefix"
    #: with ``prefix`` routing, no replica gets more than this times the mean requests in flight
    prefix_load_factor: float = 1.5
    #: seats per replica and the model queues' bounds (:mod:`llmgw.gateway.queue`)
    queue: QueueSettings = QueueSettings()
    #: share the port with other gateway processes (``SO_REUSEPORT``; ``--workers``)
    reuse_port: bool = False


class Gateway:
    """One gateway: serve it with :meth:`serve`, stop it gracefully with :meth:`shutdown`.

    Once serving, its parts are attributes (``app``, ``balancer``, ``metrics``,
    ``watcher``, ``upstreams``), for tests and introspection.
    """

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        try:
            servers = parse_servers(config.server, schemes=("http", "https"))
        except ValueError as exc:
            raise GatewayError(str(exc)) from None
        scheme = "https" if any(urlsplit(url).scheme == "https" for url in servers) else "http"
        if scheme == "https" and config.ca is None:
            raise GatewayError("--ca is required to verify the server's certificate")
        if (config.cert is None) != (config.key is None):
            raise GatewayError("--cert and --key go together")
        self._feed_tls = client_ssl_context(config.cert, config.key, config.ca) if scheme == "https" else None
        self.server = HttpServer(
            self._handle, limits=config.limits, reuse_port=config.reuse_port, precheck=self._precheck
        )
        self.app: GatewayApp | None = None
        self.balancer = Balancer(
            breaker_failures=config.breaker_failures,
            breaker_open_for=config.breaker_open_for,
            routing=config.routing,
            prefix_load_factor=config.prefix_load_factor,
            seats=config.queue.replica_concurrency,
        )
        #: every model's seats and queue (:mod:`llmgw.gateway.queue`)
        self.queues = Queues(config.queue, lambda model: len(self.balancer.replicas(model)))
        self.watcher: RoutesWatcher | None = None
        self.metrics: GatewayMetrics | None = None
        self.upstreams: ConnectionPool | None = None
        self.stalls: StallWatch | None = None
        self.reporter: SuspectReporter | None = None
        #: reports the routes generation in force to the leader (a replica stops once no gateway uses it)
        self.held: HeldReporter | None = None
        #: every limited API key's buckets (:mod:`llmgw.gateway.admission`); with the leases once serving
        self.admission = Admission(trio.current_time)
        self.leases: Leases | None = None

    async def _handle(self, request: Request) -> Response:  # the server exists before the app does
        return await self.app.handle(request)

    def _precheck(self, head: ParsedRequest) -> Response | None:
        return self.app.precheck(head) if self.app is not None else None

    async def serve(
        self, *, task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Watch the routes and serve clients until :meth:`shutdown` has run its course, or cancelled.

        Calls ``task_status.started((host, port))`` once listening (``port=0`` works). Serves at once:
        until the server's first answer, ``/v1`` requests get 503. Nothing runs after it returns.

        :raises GatewayError: when the listening address cannot be bound.
        """
        config = self.config
        upstreams = ConnectionPool(
            max_idle_per_host=config.max_idle_per_replica,
            connect_timeout=config.connect_timeout,
            read_timeout=config.proxy.read_timeout,
        )
        feed = ConnectionPool(
            max_idle_per_host=1,
            connect_timeout=config.connect_timeout,
            read_timeout=config.routes_request_timeout,
            ssl_context=self._feed_tls,
        )
        async with upstreams, feed:
            self.upstreams = upstreams
            balancer = self.balancer
            self.reporter = reporter = SuspectReporter(feed, config.server)
            self.held = held = HeldReporter(feed, config.server)
            self.leases = self.admission.leases = leases = Leases(feed, config.server, trio.current_time)
            stall_timeout = config.proxy.stall_timeout
            self.stalls = stalls = StallWatch(balancer, upstreams, stall_timeout, reporter.report)

            self.metrics = metrics = GatewayMetrics(balancer, lambda: watcher)
            metrics.certificate(self.config.cert)
            proxy = Proxy(upstreams, balancer, metrics, config.proxy)
            metrics.held_from(proxy.demand)
            metrics.queued_from(self.queues)

            def routes_changed(table: RouteTable) -> None:
                self.admission.update(table.limits)
                stalls.left(balancer.update(table.routes))
                balancer.update_adapters(table.adapters, table.base_fields)
                upstreams.retain_only(replica.url for replica in balancer)
                proxy.demand.routes_changed(table)
                self.queues.routes_changed()
                held.routes_changed(table)

            self.watcher = watcher = RoutesWatcher(
                feed,
                config.server,
                routes_changed,
                request_timeout=config.routes_request_timeout,
                retry_interval=config.routes_retry_interval,
            )
            self.app = GatewayApp(
                proxy,
                balancer,
                metrics,
                watcher,
                require_keys=config.require_keys,
                admission=self.admission,
                queues=self.queues,
            )
            try:
                async with trio.open_nursery() as nursery:
                    try:
                        host, port = await nursery.start(self._serve_http, nursery)
                    except OSError as exc:
                        raise GatewayError(
                            f"cannot listen on {config.host}:{config.port}: {exc.strerror or exc}"
                        ) from None
                    await nursery.start(watcher.run)
                    await nursery.start(stalls.run)
                    await nursery.start(reporter.run)
                    await nursery.start(held.run)
                    post = partial(reporter.post, ACTIVITY_PATH, about="the models' activity")
                    await nursery.start(proxy.demand.run, post)
                    await nursery.start(leases.run)
                    log.info("llmgw gateway on http://%s:%d, routes from %s", host, port, config.server)
                    if not config.require_keys:
                        log.warning(
                            "serving WITHOUT API keys (--no-keys): anyone who can reach http://%s:%d "
                            "can use every model",
                            host,
                            port,
                        )
                    task_status.started((host, port))
            except BaseExceptionGroup as group:
                # no exception groups at the user's door: a lone llmgw error is raised as itself
                leaves = error_leaves(group)
                if len(leaves) == 1 and isinstance(leaves[0], LlmgwError):
                    raise leaves[0] from None
                raise

    async def _serve_http(self, nursery: trio.Nursery, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        await self.server.serve(self.config.host, self.config.port, task_status=task_status)
        if self.leases is not None:  # the last answers' usage is counted against budgets, held leases go back
            with trio.move_on_after(self.leases.timeout):
                await self.leases.close()
        nursery.cancel_scope.cancel()  # shut down: the routes watcher stops too

    def shutdown(self, grace: float) -> None:
        """Stop accepting clients; requests in flight get ``grace`` seconds to finish. Returns at once."""
        log.info("shutting down: %d requests in flight, grace %gs", self.server.in_flight, grace)
        self.server.shutdown(grace)


async def serve_gateway(
    config: GatewayConfig,
    *,
    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run a gateway until cancelled; ``task_status.started((host, port))`` once listening.

    A shorthand for ``Gateway(config).serve()``; build a :class:`Gateway` to shut it down gracefully.

    :raises GatewayError: when the configuration is unusable or the address cannot be bound.
    """
    await Gateway(config).serve(task_status=task_status)
