"""Running the control plane: :func:`serve_server`."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import attrs
import trio

from llmgw.engine import Engine
from llmgw.errors import LlmgwError
from llmgw.net.server import HttpServer, Limits, Request, Response
from llmgw.pki import RevocationList, server_ssl_context
from llmgw.plugins import get_plugin_manager
from llmgw.server.api import ServerApp
from llmgw.server.cluster import Settings
from llmgw.server.persist import load_cluster
from llmgw.server.store import open_store
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

    state_dir: Path
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


async def serve_server(
    config: ServerConfig,
    engines: dict[str, Engine] | None = None,
    *,
    loaded: trio.Event | None = None,
    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the control plane until cancelled.

    Opens the state database, listens (HTTPS with mutual TLS), then loads
    the cluster and starts the reconciler: until the state is loaded, every
    request gets a 503 saying the server is starting. Calls
    ``task_status.started((host, port))`` once listening.

    :param engines: the engines catalogs may use; default: installed plugins'.
    :param loaded: set once the state is loaded and requests are answered (tests wait on it).
    :raises ServerError: when the listening address cannot be bound.
    """
    if engines is None:
        engines = {name: r.engine for name, r in get_plugin_manager().engines().items()}
    ssl_context = server_ssl_context(config.cert, config.key, config.ca)
    revocations = RevocationList(config.crl, config.ca) if config.crl else None
    store = open_store(config.state_dir)
    front = _Starting(f"loading the cluster's state from {store.path}")
    try:
        async with trio.open_nursery() as nursery:
            server = HttpServer(front.handle, ssl_context=ssl_context, limits=SERVER_LIMITS)
            try:
                address = await nursery.start(server.serve, config.host, config.port)
            except OSError as exc:
                raise ServerError(
                    f"cannot listen on {config.host}:{config.port}: {exc.strerror or exc}"
                ) from None
            log.info("llmgw server listening on https://%s:%s (state in %s)", *address, config.state_dir)
            task_status.started(address)
            started = time.monotonic()
            cluster = await store.run(lambda conn: load_cluster(conn, config.settings, engines, time.time()))
            app = ServerApp(
                cluster, store, engines, revocations=revocations, poll_timeout=config.poll_timeout
            )
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
    finally:
        store.close()


class _Starting:
    """The server's handler while it loads its state: every request gets a 503 that says so."""

    def __init__(self, detail: str) -> None:
        self.detail = detail
        self.app: ServerApp | None = None

    async def handle(self, request: Request) -> Response:
        """The app's answer once it runs; until then a 503 with kind ``starting``."""
        if self.app is not None:
            return await self.app.handle(request)
        message = f"the server is starting ({self.detail}); try again in a few seconds"
        return Response.json(503, to_json(ErrorReply(ErrorDetail(message, "starting"))))
