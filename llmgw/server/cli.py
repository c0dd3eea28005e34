"""``llmgw server``: the control plane, as a command, and its settings."""

from __future__ import annotations

import logging
from pathlib import Path

import attrs
import click

from llmgw.cli import Group, serve_until_signalled
from llmgw.net.server import parse_listen
from llmgw.server.controllers.stopping import linger_bound
from llmgw.server.main import ServerConfig, serve_server
from llmgw.server.persist.migrate import migrate_command
from llmgw.server.persist.postgres import check_store_url
from llmgw.server.persist.sqlite import StoreError
from llmgw.server.state.cluster import Settings
from llmgw.settings import LogSettings, setting, settings_options

__all__ = ["ServerSettings", "server_command"]

log = logging.getLogger("llmgw.server")


@attrs.frozen(kw_only=True)
class ServerSettings(LogSettings):
    """Everything ``llmgw server`` is started with: each field a flag, a key of ``--config``, a line of
    ``--show-config``."""

    state_dir: Path | None = setting(
        None, directory=True, help="Where the sqlite state database lives (unless --store is given)."
    )
    store: str | None = setting(
        None,
        env="LLMGW_STORE",
        metavar="postgresql://USER@HOST[:PORT]/DB",
        help="Keep the state in PostgreSQL instead of sqlite under --state-dir. The password comes from "
        "--store-password-file or libpq's PGPASSWORD / PGPASSFILE, never from the URL.",
    )
    store_password_file: Path | None = setting(
        None, help="A file whose first line is the PostgreSQL password."
    )
    advertise: str | None = setting(
        None,
        metavar="URL",
        help="With --store: the URL standbys send clients to while this server leads "
        "[default: https://LISTEN-ADDRESS, this host's name for 0.0.0.0].",
    )
    lease: float = setting(
        6.0,
        min=1.0,
        help="With --store: seconds the leader's lease lasts unrenewed; a standby leads after it runs out.",
    )
    listen: str = setting("0.0.0.0:7443", help="HOST:PORT to serve HTTPS on.")
    metrics_listen: str | None = setting(
        None,
        metavar="HOST:PORT",
        help="Also serve GET /metrics and /health in plain HTTP on HOST:PORT, for a Prometheus without a "
        "client certificate (e.g. 127.0.0.1:9464). Both are always on the HTTPS port for any CA certificate.",
    )
    cert: Path | None = setting(
        None, help="The server certificate (llmgw ca issue-server). Required to serve."
    )
    key: Path | None = setting(None, help="The server certificate's key. Required to serve.")
    ca: Path | None = setting(
        None, help="The CA certificate clients' certificates must chain to. Required to serve."
    )
    crl: Path | None = setting(
        None, help="The CA's revocation list (crl.pem in the CA directory); reloaded when it changes."
    )
    lost_after: float = setting(30.0, min=0, help="Seconds without a sync before a node is declared lost.")
    max_lost_fraction: float = setting(
        0.3,
        min=0.0,
        max=1.0,
        help="When more than this fraction of the nodes (and at least two) stop syncing together, declare "
        "none of them lost: the server suspects its own network (ctl nodes lost declares one anyway).",
    )
    disk_headroom: float = setting(
        0.05,
        min=0.0,
        max=1.0,
        help="A node gets a copy of a model's weights only when its models directory's filesystem has the "
        "copy's size plus this share of it free (counting copies no replica uses, which its agent evicts).",
    )
    poll_timeout: float = setting(
        5.0, min=0, help="Seconds a sync long-poll waits for a change (the heartbeat)."
    )

    def server_config(self) -> ServerConfig:
        """The :class:`ServerConfig` to serve with; refuses what cannot serve (a missing certificate, ...)."""
        tls = {"cert": self.cert, "key": self.key, "ca": self.ca}
        missing = [f"--{name}" for name, value in tls.items() if value is None]
        if missing:
            raise click.UsageError(
                f"missing {', '.join(missing)}: the server needs its certificate, key and CA"
            )
        host, port = parse_listen(self.listen, "--listen")
        metrics = parse_listen(self.metrics_listen, "--metrics-listen") if self.metrics_listen else None
        if (self.state_dir is None) == (self.store is None):
            raise click.UsageError("give either --state-dir (sqlite) or --store postgresql://... (not both)")
        if self.store is not None:
            try:
                check_store_url(self.store)
            except StoreError as exc:
                raise click.BadParameter(str(exc).removeprefix("--store: "), param_hint="--store") from None
        return ServerConfig(
            state_dir=self.state_dir,
            host=host,
            port=port,
            crl=self.crl,
            settings=Settings(
                lost_after=self.lost_after,
                max_lost_fraction=self.max_lost_fraction,
                disk_headroom=self.disk_headroom,
                linger_max=linger_bound(self.poll_timeout),
            ),
            poll_timeout=self.poll_timeout,
            store=self.store,
            store_password_file=self.store_password_file,
            advertise=self.advertise,
            lease=self.lease,
            metrics_listen=metrics,
            **tls,
        )


@click.group("server", cls=Group, invoke_without_command=True)
@settings_options(ServerSettings)
def server_command(settings: ServerSettings) -> None:
    """Run the control plane: HTTPS with mutual TLS, state in sqlite (or PostgreSQL), the reconciler.

    Closes the state database and exits 0 on SIGTERM or Ctrl-C.
    """
    if click.get_current_context().invoked_subcommand is not None:
        return
    config = settings.server_config()
    serve_until_signalled(
        lambda: serve_server(config), log=log, stopping="stopping, then closing the state database"
    )


server_command.add_command(migrate_command)
