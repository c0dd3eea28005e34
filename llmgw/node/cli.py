"""``llmgw discover``: show what an agent on this node would report."""

from __future__ import annotations

import json
from typing import Any

import attrs
import click
from tabulate import tabulate

from llmgw.cli import Command
from llmgw.models import DiscoverySettings
from llmgw.node.discovery import NodeDiscovery, Reports, collect_reports, summarize
from llmgw.node.fabric import parse_fabric_option
from llmgw.plugins import get_plugin_manager

__all__ = ["discover"]


@click.command(cls=Command)
@click.option(
    "--nvidia-smi",
    "nvidia_smi",
    default="nvidia-smi",
    show_default=True,
    metavar="PATH",
    help="The nvidia-smi program (a bare name is looked up on PATH).",
)
@click.option(
    "--ib-root",
    default="/sys/class/infiniband",
    show_default=True,
    metavar="DIR",
    help="The sysfs directory listing RDMA adapters.",
)
@click.option(
    "--fabric",
    "fabrics",
    multiple=True,
    metavar="NAME[:ADAPTER,...]",
    help="A fabric this node is on, as the agent takes it (repeatable).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
def discover(nvidia_smi: str, ib_root: str, fabrics: tuple[str, ...], as_json: bool) -> None:
    """Show the GPUs, adapters, fabrics and problems an agent here would report.

    Exits 0 even with no GPU (problems are listed), 1 when a --fabric cannot
    be met on this node.
    """
    settings = DiscoverySettings(nvidia_smi=nvidia_smi, ib_root=ib_root)
    for text in fabrics:
        parse_fabric_option(text)
    reports = collect_reports(get_plugin_manager(), settings)
    node = summarize(reports, fabrics)
    if as_json:
        click.echo(json.dumps(_as_json(node, reports), indent=2))
    else:
        click.echo(_as_text(node, reports))


def _as_json(node: NodeDiscovery, reports: Reports) -> dict[str, object]:
    return {
        "gpus": [attrs.asdict(gpu) for gpu in node.gpus],
        "adapters": [
            {**attrs.asdict(a), "active": a.active}
            for a in node.adapters
        ],
        "fabrics": [attrs.asdict(f) for f in node.fabrics],
        "problems": list(node.problems),
        "reports": [
            {"kind": kind, "source": r.source, "status": r.status, "problem": r.problem}
            for kind, group in (("gpus", reports.gpus), ("adapters", reports.adapters))
            for r in group
        ],
    }


def _as_text(node: NodeDiscovery, reports: Reports) -> str:
    gpus = [[g.index, g.name, g.memory_total_mib, g.memory_free_mib, g.pci_bus_id, g.uuid] for g in node.gpus]
    adapters = [
        [a.name, p.number, p.state, p.rate, p.link_layer, a.node_guid] for a in node.adapters for p in a.ports
    ]
    adapters += [[a.name, "-", "no ports", "", "", a.node_guid] for a in node.adapters if not a.ports]
    sections = [
        *_plugin_section(
            "GPUs",
            ", ".join(r.describe() for r in reports.gpus) or "no GPU discovery plugin",
            gpus,
            ["index", "name", "memory MiB", "free MiB", "PCI bus", "uuid"],
        ),
        *_plugin_section(
            "\nAdapters",
            ", ".join(r.describe() for r in reports.adapters) or "no adapter plugin",
            adapters,
            ["adapter", "port", "state", "rate", "link layer", "node GUID"],
        ),
    ]
    sections.append("\nFabrics")
    if node.fabrics:
        rows = [[f.name, ", ".join(f.adapters)] for f in node.fabrics]
        sections.append(tabulate(rows, headers=["fabric", "adapters"], tablefmt="simple"))
    else:
        sections.append("none: an island node (single-node replicas only)")
    if node.problems:
        sections.append("\nProblems")
        sections.extend(f"- {problem}" for problem in node.problems)
    return "\n".join(sections)


def _plugin_section(title: str, plugins: str, rows: list[list[Any]], headers: list[str]) -> list[str]:
    """``title`` with the ``plugins`` that looked, then what they found as a table (none: no table)."""
    lines = [f"{title} ({plugins})"]
    if rows:
        lines.append(tabulate(rows, headers=headers, tablefmt="simple"))
    return lines
