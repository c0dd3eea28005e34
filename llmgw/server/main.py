"""Running the control plane: ``serve_server`` and the ``llmgw server`` command."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import attrs
import click
import trio

from llmgw.engine import Engine
from llmgw.errors import LlmgwError
from llmgw.http import HttpServer
from llmgw.pki import RevocationList, server_ssl_context
from llmgw.plugins import get_plugin_manager
from llmgw.server.api import ServerApp
from llmgw.server.cluster import Settings
from llmgw.server.persist import load_cluster
from llmgw.store import open_store

__all__ = ["ServerConfig", "serve_server", "server_command"]

log = logging.getLogger("llmgw.server")


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
    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the control plane until cancelled.

    Opens the state database, loads the cluster, starts the reconciler, and
    serves HTTPS with mutual TLS. Calls ``task_status.started((host, port))``
    once listening.

    :param engines: the engines catalogs may use; default: installed plugins'.
    """
    if engines is None:
        engines = {name: r.engine for name, r in get_plugin_manager().engines().items()}
    ssl_context = server_ssl_context(config.cert, config.key, config.ca)
    revocations = RevocationList(config.crl, config.ca) if config.crl else None
    store = open_store(config.state_dir)
    try:
        cluster = await store.run(lambda conn: load_cluster(conn, config.settings, engines, time.time()))
        app = ServerApp(cluster, store, engines, revocations=revocations, poll_timeout=config.poll_timeout)
        await app.load_keys()
        async with trio.open_nursery() as nursery:
            await nursery.start(app.run_reconciler, config.tick)
            server = HttpServer(app.handle, ssl_context=ssl_context)
            address = await nursery.start(server.serve, config.host, config.port)
            log.info("llmgw server listening on https://%s:%s (state in %s)", *address, config.state_dir)
            task_status.started(address)
    finally:
        store.close()


@click.command("server")
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False, path_type=Path),
    required=True,
    help="Where the state database lives.",
)
@click.option("--listen", default="0.0.0.0:7443", show_default=True, help="HOST:PORT to serve HTTPS on.")
@click.option(
    "--cert",
    type=click.Path(dir_okay=False, path_type=Path),
    required=True,
    help="The server certificate (llmgw ca issue-server).",
)
@click.option(
    "--key",
    type=click.Path(dir_okay=False, path_type=Path),
    required=True,
    help="The server certificate's key.",
)
@click.option(
    "--ca",
    type=click.Path(dir_okay=False, path_type=Path),
    required=True,
    help="The CA certificate clients' certificates must chain to.",
)
@click.option(
    "--crl",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="The CA's revocation list (crl.pem in the CA directory); reloaded when it changes.",
)
@click.option(
    "--lost-after",
    type=float,
    default=30.0,
    show_default=True,
    help="Seconds without a sync before a node is declared lost.",
)
@click.option(
    "--poll-timeout",
    type=float,
    default=5.0,
    show_default=True,
    help="Seconds a sync long-poll waits for a change (the heartbeat).",
)
def server_command(
    state_dir: Path,
    listen: str,
    cert: Path,
    key: Path,
    ca: Path,
    crl: Path | None,
    lost_after: float,
    poll_timeout: float,
) -> None:
    """Run the control plane: HTTPS with mutual TLS, state in sqlite, the reconciler."""
    host, port = parse_listen(listen, "--listen")
    config = ServerConfig(
        state_dir=state_dir,
        cert=cert,
        key=key,
        ca=ca,
        host=host,
        port=port,
        crl=crl,
        settings=Settings(lost_after=lost_after),
        poll_timeout=poll_timeout,
    )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    trio.run(serve_server, config)


def parse_listen(text: str, flag: str) -> tuple[str, int]:
    """``HOST:PORT`` as (host, port); raises a :class:`LlmgwError` naming ``flag``."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise LlmgwError(f"{flag} {text!r}: expected HOST:PORT, e.g. 0.0.0.0:7443")
    return host.strip("[]") or "0.0.0.0", int(port)
