"""The ``llmgw`` command line: one group, a module per area of commands.

Errors an operator can fix (:class:`~llmgw.errors.LlmgwError`) are printed as
``error: ...`` on stderr with their exit code; no traceback, no exception group.
"""

from __future__ import annotations

import json
import sys

import click
from tabulate import tabulate

import llmgw
from llmgw.cli_base import Group
from llmgw.config import catalog_summary, load_catalog
from llmgw.errors import CatalogError
from llmgw.plugins import get_plugin_manager

__all__ = ["main", "cli"]


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(llmgw.__version__, prog_name="llmgw")
def cli() -> None:
    """llmgw: run large language models on a fleet of GPU machines."""


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON records instead of a table.")
def plugins(as_json: bool) -> None:
    """List every plugin: distribution, version, hooks, engines, load errors.

    Exits 1 when any plugin failed to load, after listing them all.
    """
    manager = get_plugin_manager()
    records = manager.records()
    if as_json:
        click.echo(json.dumps([r.to_json() for r in records], indent=2))
    else:
        rows = [
            [
                r.name,
                r.distribution or "-",
                r.version or "-",
                r.status,
                ", ".join(h.removeprefix("llmgw_") for h in r.hooks) or "-",
                ", ".join(r.engines + r.provisioners) or "-",
            ]
            for r in records
        ]
        headers = ["plugin", "distribution", "version", "status", "hooks", "provides"]
        click.echo(tabulate(rows, headers=headers, tablefmt="simple"))
        for r in records:
            if r.error:
                click.echo(f"{r.name}: {r.error}", err=True)
    if any(r.status == "failed" for r in records):
        sys.exit(1)


@cli.group(cls=Group)
def ctl() -> None:
    """Operate a cluster: catalogs, engines, nodes, replicas."""


@ctl.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON records instead of a table.")
def engines(as_json: bool) -> None:
    """List the engines installed plugins provide and the versions each was checked against."""
    records = get_plugin_manager().engines()
    if as_json:
        click.echo(json.dumps([r.to_json() for r in records.values()], indent=2))
        return
    rows = [
        [
            r.name,
            r.plugin,
            f"{r.distribution or '-'} {r.version or ''}".strip(),
            ", ".join(r.checked_versions) or "-",
            "yes" if r.multi_node else "no",
        ]
        for r in sorted(records.values(), key=lambda r: r.name)
    ]
    headers = ["engine", "plugin", "distribution", "checked against", "multi-node"]
    click.echo(tabulate(rows, headers=headers, tablefmt="simple"))


@ctl.command()
@click.argument("catalog", type=click.Path(dir_okay=False, path_type=str))
def validate(catalog: str) -> None:
    """Check CATALOG offline: types, unknown keys, profiles and engines.

    Prints every error with its path and exits 1, or a one-line summary and 0.
    """
    engines = {name: r.engine for name, r in get_plugin_manager().engines().items()}
    try:
        result = load_catalog(catalog, engines)
    except CatalogError as exc:
        click.echo(str(exc), err=True)
        sys.exit(1)
    click.echo(f"{catalog}: valid: {catalog_summary(result)}")


def _register_optional_commands() -> None:
    from llmgw.dev import dev

    cli.add_command(dev)
    from llmgw.cli_agent import agent
    from llmgw.cli_ca import ca
    from llmgw.cli_discover import discover
    from llmgw.cli_enginecheck import engine_check
    from llmgw.ctl import register
    from llmgw.gateway.cli import gateway_command
    from llmgw.server.main import server_command
    from llmgw.version import version

    register(ctl)
    ctl.add_command(engine_check)
    cli.add_command(gateway_command)
    cli.add_command(version)

    cli.add_command(ca)
    cli.add_command(agent)
    cli.add_command(server_command)

    cli.add_command(discover)


_register_optional_commands()


def main() -> None:
    """Entry point of the ``llmgw`` console script."""
    cli(prog_name="llmgw")
