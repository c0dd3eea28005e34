"""``llmgw server``: the control plane, as a command."""

from __future__ import annotations

import logging
from pathlib import Path

import click

from llmgw.cli import Group, serve_until_signalled
from llmgw.configfile import config_options
from llmgw.net.server import parse_listen
from llmgw.server.main import ServerConfig, serve_server
from llmgw.server.persist.migrate import migrate_command
from llmgw.server.persist.postgres import check_store_url
from llmgw.server.persist.sqlite import StoreError
from llmgw.server.state.cluster import Settings

__all__ = ["server_command"]

log = logging.getLogger("llmgw.server")


@click.group("server", cls=Group, invoke_without_command=True)
@config_options
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where the sqlite state database lives (unless --store is given).",
)
@click.option(
    "--store",
    envvar="LLMGW_STORE",
    default=None,
    metavar="postgresql://USER@HOST[:PORT]/DB",
    help="Keep the state in PostgreSQL instead of sqlite under --state-dir (env LLMGW_STORE). The password "
    "comes from --store-password-file or libpq's PGPASSWORD / PGPASSFILE, never from the URL.",
)
@click.option(
    "--store-password-file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="A file whose first line is the PostgreSQL password.",
)
@click.option(
    "--advertise",
    default=None,
    metavar="URL",
    help="With --store: the URL standbys send clients to while this server leads "
    "[default: https://LISTEN-ADDRESS, this host's name for 0.0.0.0].",
)
@click.option(
    "--lease",
    type=click.FloatRange(min=1.0),
    default=6.0,
    show_default=True,
    help="With --store: seconds the leader's lease lasts unrenewed; a standby leads after it runs out.",
)
@click.option("--listen", default="0.0.0.0:7443", show_default=True, help="HOST:PORT to serve HTTPS on.")
@click.option(
    "--metrics-listen",
    default=None,
    metavar="HOST:PORT",
    help="Also serve GET /metrics and /health in plain HTTP on HOST:PORT, for a Prometheus without a "
    "client certificate (e.g. 127.0.0.1:9464). Both are always on the HTTPS port for any CA certificate.",
)
@click.option(
    "--cert",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="The server certificate (llmgw ca issue-server). Required to serve.",
)
@click.option(
    "--key",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="The server certificate's key. Required to serve.",
)
@click.option(
    "--ca",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="The CA certificate clients' certificates must chain to. Required to serve.",
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
    "--max-lost-fraction",
    type=click.FloatRange(0.0, 1.0),
    default=0.3,
    show_default=True,
    help="When more than this fraction of the nodes (and at least two) stop syncing together, declare "
    "none of them lost: the server suspects its own network (ctl nodes lost declares one anyway).",
)
@click.option(
    "--disk-headroom",
    type=click.FloatRange(0.0, 1.0),
    default=0.05,
    show_default=True,
    help="A node gets a copy of a model's weights only when its models directory's filesystem has the "
    "copy's size plus this share of it free (counting copies no replica uses, which its agent evicts).",
)
@click.option(
    "--poll-timeout",
    type=float,
    default=5.0,
    show_default=True,
    help="Seconds a sync long-poll waits for a change (the heartbeat).",
)
@click.pass_context
def server_command(
    ctx: click.Context,
    state_dir: Path | None,
    store: str | None,
    store_password_file: Path | None,
    advertise: str | None,
    lease: float,
    listen: str,
    metrics_listen: str | None,
    cert: Path | None,
    key: Path | None,
    ca: Path | None,
    crl: Path | None,
    lost_after: float,
    max_lost_fraction: float,
    disk_headroom: float,
    poll_timeout: float,
) -> None:
    """Run the control plane: HTTPS with mutual TLS, state in sqlite (or PostgreSQL), the reconciler.

    Closes the state database and exits 0 on SIGTERM or Ctrl-C.
    """
    if ctx.invoked_subcommand is not None:
        return
    missing = [flag for flag, value in (("--cert", cert), ("--key", key), ("--ca", ca)) if value is None]
    if missing:
        raise click.UsageError(f"missing {', '.join(missing)}: the server needs its certificate, key and CA")
    host, port = parse_listen(listen, "--listen")
    metrics_address = parse_listen(metrics_listen, "--metrics-listen") if metrics_listen else None
    if (state_dir is None) == (store is None):
        raise click.UsageError("give either --state-dir (sqlite) or --store postgresql://... (not both)")
    if store is not None:
        try:
            check_store_url(store)
        except StoreError as exc:
            raise click.BadParameter(str(exc).removeprefix("--store: "), param_hint="--store") from None
    config = ServerConfig(
        state_dir=state_dir,
        cert=cert,
        key=key,
        ca=ca,
        host=host,
        port=port,
        crl=crl,
        settings=Settings(
            lost_after=lost_after, max_lost_fraction=max_lost_fraction, disk_headroom=disk_headroom
        ),
        poll_timeout=poll_timeout,
        store=store,
        store_password_file=store_password_file,
        advertise=advertise,
        lease=lease,
        metrics_listen=metrics_address,
    )
    serve_until_signalled(
        lambda: serve_server(config), log=log, stopping="stopping, then closing the state database"
    )


server_command.add_command(migrate_command)
