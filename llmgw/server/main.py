"""Running the control plane: :func:`serve_server`."""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import trio

from llmgw.engine import Engine
from llmgw.errors import LlmgwError
from llmgw.net.metrics import observability_handler, render_registry
from llmgw.net.server import HttpServer, Limits, Request, Response
from llmgw.pki import IdentityError, RevocationList, peer_identity, server_ssl_context
from llmgw.plugins import get_plugin_manager
from llmgw.server.ha.lease import NotLeader, lead_when_elected
from llmgw.server.ha.standby import StandbyView
from llmgw.server.http.api import ServerApp
from llmgw.server.metrics import ServerMetrics
from llmgw.server.persist.cluster import load_cluster
from llmgw.server.persist.postgres import PgStore, open_pg_store
from llmgw.server.persist.sqlite import open_store
from llmgw.server.state.cluster import Settings
from llmgw.wire import ErrorDetail, ErrorReply, to_json

__all__ = ["ServerConfig", "ServerError", "serve_server"]

log = logging.getLogger("llmgw.server")


#: the largest body the server reads: a catalog is at most 1 MiB of text (llmgw.catalog.MAX_CATALOG_BYTES),
#: a sync a few KiB; anything larger is answered 413 before it is parsed
SERVER_LIMITS = Limits(max_body_bytes=4 * 1024 * 1024)


class ServerError(LlmgwError):
    """A server that cannot start as configured."""


@attrs.frozen
class ServerConfig:
    """Everything ``llmgw server`` is started with."""

    #: where the sqlite state database lives (when ``store`` is None)
    state_dir: Path | None
    cert: Path
    key: Path
    ca: Path
    host: str = "0.0.0.0"
    port: int = 7443
    #: the CA's certificate revocation list; reloaded when it changes
    crl: Path | None = None
    settings: Settings = Settings()
    #: how long a sync or routes long-poll waits for a change
    poll_timeout: float = 5.0
    #: how often the reconciler runs without being asked
    tick: float = 1.0
    #: a ``postgresql://`` URL: the state in PostgreSQL instead of sqlite under ``state_dir``
    store: str | None = None
    #: a file holding the PostgreSQL password (else libpq's PG* environment)
    store_password_file: Path | None = None
    #: the URL standbys send clients to while this one leads (PostgreSQL); default: the listen address
    advertise: str | None = None
    #: seconds the leader's lease lasts without renewal (PostgreSQL): a standby takes over after it
    lease: float = 6.0
    #: (host, port) to serve ``/metrics`` and ``/health`` on in plain HTTP; None: not served there
    metrics_listen: tuple[str, int] | None = None


async def serve_server(
    config: ServerConfig,
    engines: dict[str, Engine] | None = None,
    *,
    loaded: trio.Event | None = None,
    metrics: ServerMetrics | None = None,
    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the control plane until cancelled.

    Opens the state database, listens (HTTPS with mutual TLS), then loads
    the cluster and starts the reconciler: until the state is loaded, every
    request gets a 503 saying the server is starting. Calls
    ``task_status.started((host, port))`` once listening.

    :param engines: the engines catalogs may use; default: installed plugins'.
    :param loaded: set once the state is loaded and requests are answered (tests wait on it).
    :param metrics: where to count (tests read it); default: a new :class:`ServerMetrics`. Its
        ``listen_address`` is the bound ``--metrics-listen`` address once serving.
    :raises ServerError: when the listening address cannot be bound.
    """
    if engines is None:
        engines = {name: r.engine for name, r in get_plugin_manager().engines().items()}
    ssl_context = server_ssl_context(config.cert, config.key, config.ca)
    revocations = RevocationList(config.crl, config.ca) if config.crl else None
    if config.store is not None:
        store = open_pg_store(config.store, config.store_password_file)
    else:
        store = open_store(config.state_dir)
    front = _Starting(f"loading the cluster's state from {store.path}")
    if metrics is None:
        metrics = ServerMetrics(config.cert, tick=config.tick)
    metrics.front, metrics.store = front, store
    front.observe = partial(_observe, metrics, revocations)
    try:
        async with trio.open_nursery() as nursery:
            if config.metrics_listen is not None:
                await _serve_metrics(nursery, metrics, *config.metrics_listen)
            server = HttpServer(front.handle, ssl_context=ssl_context, limits=SERVER_LIMITS)
            try:
                address = await nursery.start(server.serve, config.host, config.port)
            except OSError as exc:
                raise ServerError(
                    f"cannot listen on {config.host}:{config.port}: {exc.strerror or exc}"
                ) from None
            log.info("llmgw server listening on https://%s:%s (state in %s)", *address, store.path)
            task_status.started(address)
            lead = partial(_lead, config, store, engines, revocations, front, loaded, metrics)
            if isinstance(store, PgStore):
                advertise = config.advertise or _default_advertise(*address)
                view = StandbyView(
                    store,
                    engines,
                    config.settings,
                    revocations=revocations,
                    poll_timeout=config.poll_timeout,
                    stale_after=config.lease,
                )
                await lead_when_elected(
                    store, front, lead, address=advertise, duration=config.lease, view=view
                )
            else:
                await lead(nursery)
    finally:
        store.close()


async def _lead(
    config: ServerConfig,
    store: Any,
    engines: dict[str, Engine],
    revocations: RevocationList | None,
    front: _Starting,
    loaded: trio.Event | None,
    metrics: ServerMetrics,
    nursery: trio.Nursery,
) -> None:
    """Load the cluster from the store, start the reconciler in ``nursery``, and hand requests to the app."""
    started = time.monotonic()
    front.detail = f"loading the cluster's state from {store.path}"
    cluster = await store.run(lambda conn: load_cluster(conn, config.settings, engines, time.time()))
    # a leader before this one may have served gateways routes generations it never stored: start past them
    cluster.routes_generation = max(cluster.routes_generation, int(time.time() * 1000))
    app = ServerApp(cluster, store, engines, revocations=revocations, poll_timeout=config.poll_timeout)
    app.metrics = app.reconciler.metrics = metrics
    cluster.event_log.listeners.append(partial(metrics.event, model_of=_model_of(cluster)))
    await app.load_keys()
    front.detail = "placing the stored catalog's replicas"
    await nursery.start(app.run_reconciler, config.tick)
    nursery.start_soon(app.watch_revocations)
    front.app = app
    if loaded is not None:
        loaded.set()
    log.info(
        "state loaded in %.1f s: %d nodes, %d replicas, catalog revision %d",
        time.monotonic() - started,
        len(cluster.nodes),
        len(cluster.replicas),
        cluster.catalog_revision,
    )


def _model_of(cluster: Any) -> Callable[[str], str | None]:
    def model_of(replica_id: str) -> str | None:
        record = cluster.replicas.get(replica_id)
        return record.placement.model if record is not None else None

    return model_of


async def _serve_metrics(nursery: trio.Nursery, metrics: ServerMetrics, host: str, port: int) -> None:
    """Serve ``/metrics`` and ``/health`` in plain HTTP on ``host:port`` (``--metrics-listen``)."""
    handler = observability_handler(
        lambda: metrics.registry, metrics.health, {"/sd/engines": metrics.engine_targets}
    )
    try:
        metrics.listen_address = await nursery.start(HttpServer(handler).serve, host, port)
    except OSError as exc:
        raise ServerError(f"--metrics-listen {host}:{port}: cannot listen: {exc.strerror or exc}") from None
    log.info("metrics on http://%s:%s/metrics", *metrics.listen_address)


async def _observe(metrics: ServerMetrics, revocations: RevocationList | None, request: Request) -> Response:
    """``/metrics``, ``/health``, ``/sd/engines`` on the HTTPS port: any CA certificate not revoked."""
    try:
        identity = peer_identity(request.peer_cert_der)
    except IdentityError as exc:
        detail = ErrorDetail(f"client certificate refused: {exc}", "unauthorized")
        return Response.json(401, to_json(ErrorReply(detail)))
    if revocations is not None and revocations.is_revoked(identity.serial):
        message = f"certificate {identity.serial_hex} of {identity.name} is revoked"
        return Response.json(403, to_json(ErrorReply(ErrorDetail(message, "revoked"))))
    if request.path == "/metrics":
        return render_registry(metrics.registry, request.header("accept"))
    if request.path == "/sd/engines":
        return Response.json(200, metrics.engine_targets())
    status, body = await metrics.health()
    return Response.json(status, body)


def _default_advertise(host: str, port: int) -> str:
    if host in ("0.0.0.0", "::", ""):
        host = socket.getfqdn()
    return f"https://{host}:{port}"


_OBSERVED = ("/metrics", "/health", "/sd/engines")


class _Starting:
    """The server's handler while it loads its state: every request gets a 503 that says so."""

    def __init__(self, detail: str) -> None:
        self.detail = detail
        self.app: ServerApp | None = None
        #: the answer while there is no app, instead of "starting" (a standby's "not the leader")
        self.refusal: Callable[[], Response] | None = None
        #: a standby's handler (reads from the store, else the refusal), while there is no app
        self.standby: Callable[[Request], Awaitable[Response]] | None = None
        #: answers ``GET /metrics`` and ``GET /health``, whether leading, standing by or starting
        self.observe: Callable[[Request], Awaitable[Response]] | None = None

    async def handle(self, request: Request) -> Response:
        """The app's answer once it runs; until then 503 ``starting`` (a standby: its own answers).

        ``GET /metrics`` and ``GET /health`` are answered in every state.
        """
        if self.observe is not None and request.method in ("GET", "HEAD") and request.path in _OBSERVED:
            return await self.observe(request)
        if self.app is not None:
            try:
                return await self.app.handle(request)
            except NotLeader:  # its write was fenced: it just lost the lease, and answers as a standby
                if self.refusal is None:
                    raise
        if self.standby is not None:
            return await self.standby(request)
        if self.refusal is not None:
            return self.refusal()
        message = f"the server is starting ({self.detail}); try again in a few seconds"
        return Response.json(503, to_json(ErrorReply(ErrorDetail(message, "starting"))))
