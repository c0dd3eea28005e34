"""``llmgw ctl``: the operator's commands over the admin API.

Credentials come from flags, environment variables, or a config directory
(``$LLMGW_CONFIG_DIR``, else ``$XDG_CONFIG_HOME/llmgw``, else
``~/.config/llmgw``) holding ``ca.pem``, ``admin.pem``, ``admin.key`` and
``config.toml`` with ``server = "https://HOST:PORT"``. ``llmgw dev`` writes
that directory, so ``llmgw ctl nodes`` works with no flags.
"""

from __future__ import annotations

import json
import os
import time
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import click
import httpx
from tabulate import tabulate

from llmgw.errors import LlmgwError

__all__ = ["AdminClient", "ClientConfig", "config_dir", "write_client_config", "register"]


class CtlError(LlmgwError):
    """The admin API could not be reached, or refused the request."""


def config_dir() -> Path:
    """Where ``ctl`` looks for its credentials by default."""
    if os.environ.get("LLMGW_CONFIG_DIR"):
        return Path(os.environ["LLMGW_CONFIG_DIR"])
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "llmgw"


@attrs.frozen
class ClientConfig:
    """How to reach the admin API: the server's URL and an admin certificate."""

    server: str
    ca: Path
    cert: Path
    key: Path

    @classmethod
    def resolve(
        cls, server: str | None, ca: Path | None, cert: Path | None, key: Path | None, directory: Path | None
    ) -> ClientConfig:
        """Flags first, then the config directory; says what is missing and where it looked."""
        directory = directory or config_dir()
        if server is None:
            config_file = directory / "config.toml"
            if config_file.exists():
                try:
                    data = tomllib.loads(config_file.read_text())
                except tomllib.TOMLDecodeError as exc:
                    raise CtlError(f"{config_file}: not valid TOML: {exc}") from None
                server = data.get("server")
                if server is not None and not isinstance(server, str):
                    raise CtlError(f"{config_file}: server: expected a string like https://host:7443")
        if server is None:
            raise CtlError(
                f"no server given: pass --server https://HOST:7443, set LLMGW_SERVER, or write "
                f'server = "https://HOST:7443" in {directory / "config.toml"} (llmgw dev does this)'
            )
        paths = {
            "--ca": ca or directory / "ca.pem",
            "--cert": cert or directory / "admin.pem",
            "--key": key or directory / "admin.key",
        }
        for flag, path in paths.items():
            if not path.exists():
                raise CtlError(
                    f"{flag} {path} does not exist; issue an admin certificate with "
                    f"`llmgw ca issue-admin NAME --ca-dir CA --out {directory}` or pass {flag}"
                )
        return cls(server.rstrip("/"), paths["--ca"], paths["--cert"], paths["--key"])


def write_client_config(
    directory: Path, server: str, ca: Path, cert: Path, key: Path, *, header: str = ""
) -> None:
    """Write a config directory ``ctl`` finds by default (used by ``llmgw dev``).

    ``header`` goes at the top of ``config.toml`` (a comment saying who wrote it).
    """
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    for source, name in ((ca, "ca.pem"), (cert, "admin.pem")):
        (directory / name).write_bytes(source.read_bytes())
    target = directory / "admin.key"
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key.read_bytes())
    (directory / "config.toml").write_text(f'{header}server = "{server}"\n')


class AdminClient:
    """A synchronous client of the admin API with an admin certificate."""

    def __init__(self, config: ClientConfig) -> None:
        from llmgw.pki import client_ssl_context

        self.config = config
        context = client_ssl_context(config.cert, config.key, config.ca)
        self._http = httpx.Client(base_url=config.server, verify=context, timeout=30)

    def close(self) -> None:
        """Close the client's connections."""
        self._http.close()

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        """Call the admin API; returns the JSON body or raises :class:`CtlError` with the server's message."""
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise CtlError(f"cannot reach the server at {self.config.server}: {exc}") from None
        try:
            body = response.json()
        except ValueError:
            body = {"error": {"message": response.text.strip() or f"HTTP {response.status_code}"}}
        if response.status_code >= 400:
            error = body.get("error", {}) if isinstance(body, dict) else {}
            raise CtlError(error.get("message") or f"the server answered {response.status_code}")
        return body


# ---------------------------------------------------------------------------
# commands
# ---------------------------------------------------------------------------

output_option = click.option(
    "-o",
    "--output",
    type=click.Choice(["table", "json"]),
    default="table",
    show_default=True,
    help="A table for people, or JSON for scripts.",
)


def _client(ctx: click.Context) -> AdminClient:
    options = ctx.find_root().meta.get("ctl_options", {})
    return AdminClient(ClientConfig.resolve(**options))


def _table(rows: list[list[Any]], headers: list[str]) -> str:
    return tabulate(rows, headers=headers, tablefmt="simple") if rows else "(none)"


@click.command()
@output_option
@click.pass_context
def nodes(ctx: click.Context, output: str) -> None:
    """List nodes: GPUs free/total, fabrics, engines, state, replicas, warnings."""
    data = _client(ctx).request("GET", "/v1/admin/nodes")
    if output == "json":
        click.echo(json.dumps(data["nodes"], indent=2))
        return
    rows = [
        [
            n["node_id"],
            n["address"],
            n["state"],
            f"{n['gpus_free']}/{n['gpus_total']}",
            ",".join(n["fabrics"]) or "island",
            ", ".join(f"{k} {v}" for k, v in sorted(n["engines"].items())) or "-",
            ", ".join(n["replicas"]) or "-",
            f"{n['last_sync_ago']:.0f}s",
        ]
        for n in data["nodes"]
    ]
    click.echo(
        _table(rows, ["node", "address", "state", "GPUs free", "fabric", "engines", "replicas", "last sync"])
    )
    for n in data["nodes"]:
        for warning in n["warnings"]:
            click.echo(f"warning: {n['node_id']}: {warning}")


@click.command()
@output_option
@click.pass_context
def replicas(ctx: click.Context, output: str) -> None:
    """List replicas with their shards, and those that cannot be placed, with why."""
    data = _client(ctx).request("GET", "/v1/admin/replicas")
    if output == "json":
        click.echo(json.dumps(data, indent=2))
        return
    rows = []
    for r in data["replicas"]:
        shards = "; ".join(
            f"r{s['rank']} {s['node']}:{s['port']} {s['state']}" + (f" pid {s['pid']}" if s["pid"] else "")
            for s in r["shards"]
        )
        note = r["reason"] or (f"replaces {r['replaces']}" if r["replaces"] else "")
        rows.append([r["id"], r["model"], r["state"], r["failures"], shards, note])
    click.echo(_table(rows, ["replica", "model", "state", "failures", "shards", "note"]))
    for u in data["unplaced"]:
        click.echo(f"unplaced: {u['id']}: {u['reason']}")


@click.command()
@click.argument("catalog", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--wait", is_flag=True, help="Wait until every replica of the catalog is ready.")
@click.option("--timeout", type=float, default=600, show_default=True, help="Seconds --wait waits at most.")
@click.pass_context
def apply(ctx: click.Context, catalog: Path, wait: bool, timeout: float) -> None:
    """Make CATALOG the desired state: all of it, or nothing if any part is invalid."""
    client = _client(ctx)
    try:
        result = client.request(
            "POST", "/v1/admin/catalog", json={"text": catalog.read_text(), "name": str(catalog)}
        )
    except CtlError as exc:
        click.echo(str(exc), err=True)
        ctx.exit(1)
    click.echo(f"applied {catalog} as revision {result['revision']}: {result['summary']}")
    if wait:
        _wait_ready(client, timeout)


def _wait_ready(client: AdminClient, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    last = None
    while True:
        data = client.request("GET", "/v1/admin/replicas")
        states = [r["state"] for r in data["replicas"] if not r["replaces"]]
        ready = states.count("ready")
        status = f"{ready}/{len(states) + len(data['unplaced'])} replicas ready"
        if status != last:
            click.echo(status)
            last = status
        if ready == len(states) and not data["unplaced"]:
            return
        if time.monotonic() > deadline:
            for u in data["unplaced"]:
                click.echo(f"unplaced: {u['id']}: {u['reason']}", err=True)
            for r in data["replicas"]:
                if r["state"] != "ready" and r["reason"]:
                    click.echo(f"{r['id']}: {r['reason']}", err=True)
            raise CtlError(f"not every replica was ready within {timeout:.0f} s ({status}); see ctl replicas")
        time.sleep(0.5)


@click.command()
@click.option("--since", type=int, default=0, help="Only events after this id.")
@click.option("--limit", type=int, default=50, show_default=True, help="At most this many, newest last.")
@output_option
@click.pass_context
def events(ctx: click.Context, since: int, limit: int, output: str) -> None:
    """What the server decided and why: placements, rebuilds, refusals."""
    data = _client(ctx).request("GET", "/v1/admin/events", params={"since": since, "limit": limit})
    if output == "json":
        click.echo(json.dumps(data["events"], indent=2))
        return
    for e in data["events"]:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e["at"]))
        click.echo(f"{e['id']:>5} {stamp} {e['kind']:<8} {e['subject']}: {e['message']}")


def _node_action(action: str, doc: str) -> click.Command:
    @click.command(action, help=doc)
    @click.argument("node")
    @click.pass_context
    def command(ctx: click.Context, node: str) -> None:
        status = _client(ctx).request("POST", f"/v1/admin/nodes/{node}/{action}")
        click.echo(f"{node}: {status['state']}")

    return command


cordon = _node_action("cordon", "Stop placing new replicas on NODE; running ones stay.")
uncordon = _node_action("uncordon", "Let NODE take new replicas again.")


@click.command()
@click.argument("node")
@click.option("--no-wait", is_flag=True, help="Start the drain and return at once.")
@click.option("--timeout", type=float, default=1800, show_default=True, help="Seconds to wait at most.")
@click.pass_context
def drain(ctx: click.Context, node: str, no_wait: bool, timeout: float) -> None:
    """Move NODE's replicas elsewhere one at a time, each replacement ready before its original stops."""
    client = _client(ctx)
    status = client.request("POST", f"/v1/admin/nodes/{node}/drain")
    click.echo(
        f"{node}: draining {len(status['remaining'])} replicas: {', '.join(status['remaining']) or '-'}"
    )
    if no_wait:
        return
    deadline = time.monotonic() + timeout
    last: tuple = ()
    while status["remaining"]:
        now = (tuple(status["remaining"]), tuple(status["moving"]), tuple(status["stuck"]))
        if now != last:
            moving = f"; moving {', '.join(status['moving'])}" if status["moving"] else ""
            click.echo(f"{node}: {len(status['remaining'])} left{moving}")
            for line in status["stuck"]:
                click.echo(f"{node}: stuck: {line}")
            last = now
        if time.monotonic() > deadline:
            raise CtlError(f"{node}: drain not finished within {timeout:.0f} s; it goes on (ctl replicas)")
        time.sleep(0.5)
        status = client.request("GET", f"/v1/admin/nodes/{node}/drain")
    click.echo(f"{node}: drained; it stays cordoned until `llmgw ctl uncordon {node}`")


@click.group()
def keys() -> None:
    """API keys clients send as `Authorization: Bearer KEY` to the gateway."""


@keys.command("create")
@click.argument("name")
@click.pass_context
def keys_create(ctx: click.Context, name: str) -> None:
    """Create API key NAME and print its secret: it is shown this once, only a hash is stored."""
    result = _client(ctx).request("POST", "/v1/admin/keys", json={"name": name})
    click.echo(result["secret"])
    click.echo(
        f"API key {name!r} created; the secret above is not stored and cannot be shown again", err=True
    )


@keys.command("list")
@output_option
@click.pass_context
def keys_list(ctx: click.Context, output: str) -> None:
    """List API keys (names and dates; secrets are never stored)."""
    data = _client(ctx).request("GET", "/v1/admin/keys")["keys"]
    if output == "json":
        click.echo(json.dumps(data, indent=2))
        return

    def when(stamp: float | None) -> str:
        return time.strftime("%Y-%m-%d %H:%M", time.localtime(stamp)) if stamp else "-"

    rows = [[k["name"], when(k["created_at"]), when(k["revoked_at"])] for k in data]
    click.echo(_table(rows, ["name", "created", "revoked"]))


@keys.command("revoke")
@click.argument("name")
@click.pass_context
def keys_revoke(ctx: click.Context, name: str) -> None:
    """Revoke API key NAME: gateways refuse it within a second."""
    _client(ctx).request("DELETE", f"/v1/admin/keys/{name}")
    click.echo(f"API key {name!r} revoked")


def register(group: click.Group) -> None:
    """Add the admin-API commands and the connection options to the ``ctl`` group."""
    for command in (nodes, replicas, apply, events, cordon, uncordon, drain, keys):
        group.add_command(command)
    options: list[Callable] = [
        click.option("--server", envvar="LLMGW_SERVER", help="The server's URL, https://HOST:7443."),
        click.option("--ca", type=click.Path(dir_okay=False, path_type=Path), help="The CA certificate."),
        click.option("--cert", type=click.Path(dir_okay=False, path_type=Path), help="An admin certificate."),
        click.option("--key", type=click.Path(dir_okay=False, path_type=Path), help="Its key."),
        click.option(
            "--config-dir",
            "directory",
            type=click.Path(file_okay=False, path_type=Path),
            help="Where ca.pem, admin.pem, admin.key and config.toml are (default ~/.config/llmgw).",
        ),
    ]
    callback = group.callback

    def with_options(**kwargs: Any) -> Any:
        click.get_current_context().find_root().meta["ctl_options"] = kwargs
        return callback() if callback else None

    group.callback = with_options
    for option in options:
        option(group)
