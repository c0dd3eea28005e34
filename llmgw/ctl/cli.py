"""``llmgw ctl``: the operator's commands over the admin API, and the offline ones (validate, engines).

Connection options (``--server``, ``--ca``, ``--cert``, ``--key``,
``--config-dir``) belong to the ``ctl`` group; :class:`~llmgw.ctl.client.ClientConfig`
resolves them against the config directory ``llmgw dev`` writes.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import click

from llmgw.catalog import catalog_summary, load_catalog
from llmgw.cli import Group
from llmgw.ctl.adapters import adapters
from llmgw.ctl.autoscale import autoscale
from llmgw.ctl.catalog import apply, catalog, diff, installed_engines
from llmgw.ctl.client import AdminClient, CtlError, segment
from llmgw.ctl.keys import keys
from llmgw.ctl.models import models
from llmgw.ctl.options import interval_option, output_option, watch_options
from llmgw.ctl.output import follow as follow_items
from llmgw.ctl.output import show, show_admin, structured, table
from llmgw.ctl.replicas import describe, replicas
from llmgw.ctl.rollout import rollout
from llmgw.enginecheck.cli import engine_check
from llmgw.errors import CatalogError
from llmgw.plugins import get_plugin_manager
from llmgw.scheduler import format_bytes
from llmgw.wire import (
    DrainStatus,
    EventEntry,
    EventList,
    NodeList,
    NodeStatus,
    to_json,
)
from llmgw.wire.servers import ControlServers

__all__ = ["ctl"]

_FILE = click.Path(dir_okay=False, path_type=Path)


@click.group(cls=Group)
@click.option(
    "--server",
    envvar="LLMGW_SERVER",
    help="The server's URL, https://HOST:7443; several comma-separated: requests go to the leader.",
)
@click.option("--ca", type=_FILE, help="The CA certificate.")
@click.option("--cert", type=_FILE, help="An admin certificate.")
@click.option("--key", type=_FILE, help="Its key.")
@click.option(
    "--config-dir",
    "directory",
    type=click.Path(file_okay=False, path_type=Path),
    help="Where ca.pem, admin.pem, admin.key and config.toml are (default ~/.config/llmgw).",
)
@click.pass_context
def ctl(ctx: click.Context, **options: Any) -> None:
    """Operate a cluster: catalogs, engines, nodes, replicas."""
    ctx.find_root().meta["ctl_options"] = options


def _client(ctx: click.Context) -> AdminClient:
    return AdminClient.for_command(ctx)


def node_lines(data: NodeList, wide: bool) -> list[str]:
    """What ``ctl nodes`` prints: a row per node (``wide``: GPU models, adapters, agent), then warnings."""
    rows = []
    for n in data.nodes:
        row = [n.node_id, n.address, n.state, f"{n.gpus_free}/{n.gpus_total}"]
        if wide:
            row.append(", ".join(f"{count}x {model}" for model, count in sorted(n.gpu_models.items())) or "-")
            fabrics = [f"{f}: {','.join(n.fabric_adapters.get(f, ())) or '-'}" for f in n.fabrics]
            row.append("; ".join(fabrics) or "island")
        else:
            row.append(",".join(n.fabrics) or "island")
        row.append(", ".join(f"{k} {v}" for k, v in sorted(n.engines.items())) or "-")
        if wide:
            row.append(n.agent_version or "-")
        row += [", ".join(n.replicas) or "-", _models_disk(n), f"{n.last_sync_ago:.0f}s"]
        rows.append(row)
    headers = ["node", "address", "state", "GPUs free"]
    headers += ["GPUs", "fabric: adapters"] if wide else ["fabric"]
    headers += ["engines", "agent"] if wide else ["engines"]
    lines = [table(rows, [*headers, "replicas", "models disk", "last sync"])]
    lines += _whole_nodes(data)
    lines += [f"warning: {n.node_id}: {warning}" for n in data.nodes for warning in n.warnings]
    return lines


@click.group(invoke_without_command=True)
@output_option()
@watch_options()
@click.pass_context
def nodes(ctx: click.Context, output: str, watch: bool, interval: float) -> None:
    """List nodes: GPUs free/total, fabrics, engines, state, replicas, warnings."""
    if ctx.invoked_subcommand is not None:
        return
    show_admin(
        ctx,
        "/v1/admin/nodes",
        NodeList,
        node_lines,
        output,
        doc=lambda data: to_json(data.nodes),
        watch=watch,
        interval=interval,
    )


def _whole_nodes(data: NodeList) -> list[str]:
    """``whole nodes free: ib-a 1 of 2, ib-b 0 of 1``: per fabric, its ready nodes no replica uses a GPU of
    (what a multi-node replica can take), out of its nodes; nothing when no node is on a fabric."""
    whole: dict[str, list[int]] = {}
    for n in data.nodes:
        free = n.state == "ready" and n.gpus_total > 0 and n.gpus_free == n.gpus_total
        for fabric in n.fabrics:
            counts = whole.setdefault(fabric, [0, 0])
            counts[0] += free
            counts[1] += 1
    if not whole:
        return []
    return [
        "whole nodes free: "
        + ", ".join(f"{f} {free} of {total}" for f, (free, total) in sorted(whole.items()))
    ]


def _models_disk(node: NodeStatus) -> str:
    """``16 MB free, 2 copies``: the models directory's free bytes and the copies in it."""
    free = f"{format_bytes(node.models_free_bytes)} free" if node.models_free_bytes is not None else "-"
    return f"{free}, {node.copies} cop{'y' if node.copies == 1 else 'ies'}" if node.copies else free


@nodes.command("lost")
@click.argument("node_ids", metavar="NODE...", nargs=-1, required=True)
@click.pass_context
def nodes_lost(ctx: click.Context, node_ids: tuple[str, ...]) -> None:
    """Declare NODE... lost now: their replicas are rebuilt elsewhere.

    For nodes the server spares because many stopped syncing at once (see
    `llmgw ctl events`); a node that syncs again is back, as after any loss.
    """
    client = _client(ctx)
    for node in node_ids:
        status = client.request("POST", f"/v1/admin/nodes/{segment(node)}/lost", DrainStatus)
        click.echo(f"{node}: {status.state}")


def event_line(event: EventEntry) -> str:
    """One event as ``ctl events`` prints it: id, local time, kind, subject and message."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(event.at))
    return f"{event.id:>5} {stamp} {event.kind:<8} {event.subject}: {event.message}"


@click.command()
@click.option("--since", type=int, default=0, help="Only events after this id.")
@click.option("--limit", type=int, default=50, show_default=True, help="At most this many, newest last.")
@click.option(
    "-f",
    "--follow",
    is_flag=True,
    help="Then print new events as they come, until Ctrl-C (JSON: one per line).",
)
@interval_option("--follow", 1.0)
@output_option()
@click.pass_context
def events(ctx: click.Context, since: int, limit: int, follow: bool, interval: float, output: str) -> None:
    """What the server decided and why: placements, rebuilds, refusals."""
    client = _client(ctx)

    looks = []

    def fetch(after: int) -> list[EventEntry]:
        # --limit bounds the first look; following, every event counts (the server's cap: 10,000 a look)
        params = {"since": after, "limit": limit if not looks else 10_000}
        looks.append(after)
        return list(client.request("GET", "/v1/admin/events", EventList, params=params).events)

    if follow:
        render = (
            event_line
            if output in ("table", "wide")
            else lambda e: structured(output, to_json(e), stream=True)
        )
        follow_items(fetch, lambda e: e.id, render, since, interval)
        return
    show(
        output,
        lambda: fetch(since),
        lambda data: to_json(tuple(data)),
        lambda data, _wide: [event_line(e) for e in data],
    )


def server_lines(data: ControlServers, _wide: bool) -> list[str]:
    """What ``ctl servers`` prints: one line for a single sqlite server, else a row per server."""
    if data.store == "sqlite":
        return ["one server, state in sqlite: it leads (run several on --store postgresql://... instead)"]
    rows = [
        [
            s.address,
            s.role,
            s.epoch if s.epoch is not None else "-",
            f"{s.lease_age:.0f}s" if s.lease_age is not None else "-",
            f"{s.expires_in:.1f}s" if s.expires_in is not None else "-",
            f"{s.seen_ago:.1f}s",
            f"{s.up_for:.0f}s",
        ]
        for s in data.servers
    ]
    return [table(rows, ["server", "role", "epoch", "leads for", "lease left", "last seen", "up"])]


@click.command()
@output_option()
@watch_options()
@click.pass_context
def servers(ctx: click.Context, output: str, watch: bool, interval: float) -> None:
    """The control plane's servers: which one leads, its epoch and lease, the standbys."""
    show_admin(ctx, "/v1/admin/servers", ControlServers, server_lines, output, watch=watch, interval=interval)


def _node_action(action: str, doc: str) -> click.Command:
    @click.command(action, help=doc)
    @click.argument("node")
    @click.pass_context
    def command(ctx: click.Context, node: str) -> None:
        status = _client(ctx).request("POST", f"/v1/admin/nodes/{segment(node)}/{action}", DrainStatus)
        click.echo(f"{node}: {status.state}")

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
    status = client.request("POST", f"/v1/admin/nodes/{segment(node)}/drain", DrainStatus)
    click.echo(f"{node}: draining {len(status.remaining)} replicas: {', '.join(status.remaining) or '-'}")
    if no_wait:
        return
    deadline = time.monotonic() + timeout
    last: DrainStatus | None = None
    while status.remaining:
        if status != last:
            moving = f"; moving {', '.join(status.moving)}" if status.moving else ""
            click.echo(f"{node}: {len(status.remaining)} left{moving}")
            for line in status.stuck:
                click.echo(f"{node}: stuck: {line}")
            last = status
        if time.monotonic() > deadline:
            raise CtlError(f"{node}: drain not finished within {timeout:.0f} s; it goes on (ctl replicas)")
        time.sleep(0.5)
        status = client.request("GET", f"/v1/admin/nodes/{segment(node)}/drain", DrainStatus)
    click.echo(f"{node}: drained; it stays cordoned until `llmgw ctl uncordon {node}`")


@click.command()
@output_option()
@click.option("--json", "as_json", is_flag=True, hidden=True, help="Deprecated: -o json.")
def engines(output: str, as_json: bool) -> None:
    """List the engines installed plugins provide and the versions each was checked against."""
    records = get_plugin_manager().engines()

    def lines(found: dict, wide: bool) -> list[str]:
        rows = []
        for r in sorted(found.values(), key=lambda r: r.name):
            row = [r.name, r.plugin, f"{r.distribution or '-'} {r.version or ''}".strip()]
            row += [", ".join(r.checked_versions) or "-", "yes" if r.multi_node else "no"]
            rows.append(row)
        return [table(rows, ["engine", "plugin", "distribution", "checked against", "multi-node"])]

    show(
        "json" if as_json else output,
        lambda: records,
        lambda found: [r.to_json() for r in found.values()],
        lines,
    )


@click.command()
@click.argument("catalog", type=click.Path(dir_okay=False, path_type=str))
def validate(catalog: str) -> None:
    """Check CATALOG offline: types, unknown keys, profiles and engines.

    Prints every error with its path and exits 1, or a one-line summary and 0.
    """
    try:
        result = load_catalog(catalog, installed_engines())
    except CatalogError as exc:
        click.echo(str(exc), err=True)
        sys.exit(1)
    click.echo(f"{catalog}: valid: {catalog_summary(result)}")


for _command in (
    engines,
    validate,
    engine_check,
    nodes,
    replicas,
    models,
    describe,
    apply,
    diff,
    catalog,
    rollout,
    autoscale,
    adapters,
    events,
    servers,
    cordon,
    uncordon,
    drain,
    keys,
):
    ctl.add_command(_command)
