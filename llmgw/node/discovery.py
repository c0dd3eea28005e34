"""What a node has: GPUs, fabric adapters and fabrics, from the discovery hooks.

The agent and ``llmgw discover`` share :func:`discover_node`. Each discovery
plugin is called on its own, so one that raises becomes a problem line naming
it, and the others still report.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

from llmgw.errors import FabricError
from llmgw.models import GPU, Adapter, AdapterReport, DiscoverySettings, Fabric, GpuReport
from llmgw.node.fabric import DEFAULT_ADAPTERS_PER_FABRIC, parse_fabric_option, resolve_fabrics

__all__ = ["NodeDiscovery", "Reports", "collect_reports", "summarize", "discover_node"]


class Reports(NamedTuple):
    """Every discovery plugin's report, as returned."""

    gpus: tuple[GpuReport, ...]
    adapters: tuple[AdapterReport, ...]


class NodeDiscovery(NamedTuple):
    """What the agent reports about its node."""

    gpus: tuple[GPU, ...]
    adapters: tuple[Adapter, ...]
    fabrics: tuple[Fabric, ...]
    #: one line each, e.g. ``nvidia-smi failed: ...``
    problems: tuple[str, ...]


def collect_reports(plugins: Any, settings: DiscoverySettings) -> Reports:
    """Call ``llmgw_discover_gpus`` and ``llmgw_discover_adapters`` on every plugin.

    Called by :func:`discover_node` and by ``llmgw discover`` (which shows
    each report). A plugin whose hook raises or returns something other than
    a report is turned into a ``failed`` report whose source is the plugin.

    :param plugins: a :class:`llmgw.plugins.Plugins` (or anything with ``.pm``).
    :returns: :class:`Reports`, in plugin call order; plugins that returned
        ``None`` are left out.
    """
    return Reports(
        gpus=_call(plugins, "llmgw_discover_gpus", settings, GpuReport),
        adapters=_call(plugins, "llmgw_discover_adapters", settings, AdapterReport),
    )


def summarize(
    reports: Reports,
    fabric_options: Iterable[str],
    per_fabric: int = DEFAULT_ADAPTERS_PER_FABRIC,
) -> NodeDiscovery:
    """Merge the reports and resolve the ``--fabric`` options against their adapters.

    Problems are every GPU report that is not a plain ``ok`` (``not-found``,
    ``failed``, or notes), and every adapter report that ``failed``. A
    missing InfiniBand root is not a problem: the node is an island, unless
    fabrics were declared, which then fail to resolve.

    :returns: a :class:`NodeDiscovery`.
    :raises FabricError: a ``--fabric`` option is malformed or cannot be met;
        when adapter discovery did not succeed, its problem is added.
    """
    declarations = [parse_fabric_option(text) for text in fabric_options]
    gpus = tuple(gpu for report in reports.gpus for gpu in report.gpus)
    adapters = tuple(adapter for report in reports.adapters for adapter in report.adapters)
    problems = [r.problem for r in reports.gpus if r.problem]
    problems += [r.problem for r in reports.adapters if r.problem and r.status == "failed"]
    try:
        fabrics = resolve_fabrics(declarations, adapters, per_fabric)
    except FabricError as exc:
        unsure = [r.problem for r in reports.adapters if r.status != "ok" and r.problem]
        if not unsure:
            raise
        raise FabricError(f"{exc} [{'; '.join(unsure)}]") from exc
    return NodeDiscovery(gpus=gpus, adapters=adapters, fabrics=fabrics, problems=tuple(problems))


def discover_node(
    plugins: Any,
    settings: DiscoverySettings,
    fabric_options: Iterable[str],
    per_fabric: int = DEFAULT_ADAPTERS_PER_FABRIC,
) -> NodeDiscovery:
    """Discover this node's GPUs and adapters and resolve its ``--fabric`` options.

    Called by the agent at start and before each registration (in a worker
    thread: hooks may run ``nvidia-smi``). The ``--fabric`` options are
    parsed first, so a typo is refused before any tool runs.

    :returns: ``(gpus, adapters, fabrics, problems)`` as a :class:`NodeDiscovery`.
    :raises FabricError: as :func:`summarize`.
    """
    fabric_options = list(fabric_options)
    for text in fabric_options:
        parse_fabric_option(text)
    return summarize(collect_reports(plugins, settings), fabric_options, per_fabric)


def _call(plugins: Any, hook_name: str, settings: DiscoverySettings, kind: type) -> tuple:
    reports = []
    for plugin, result in plugins.call_each(hook_name, settings=settings):
        if isinstance(result, Exception):
            result = _broken(kind, plugin, f"{hook_name} raised {type(result).__name__}: {result}")
        if result is None:
            continue
        if not isinstance(result, kind):
            result = _broken(kind, plugin, f"{hook_name} returned {result!r}, not a {kind.__name__}")
        reports.append(result)
    return tuple(reports)


def _broken(kind: type, plugin: str, message: str) -> Any:
    return kind(source=plugin, status="failed", problem=f"plugin {plugin!r}: {message}")
