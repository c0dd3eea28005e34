"""Every hook llmgw calls, with when it is called and what it returns.

Plugins implement these with ``@llmgw.hookimpl`` and are found through the
``llmgw`` entry point group (built-ins in ``plugins/`` are registered the same
way). Hooks are synchronous and return data: the core does the waiting, the
processes and the network. A hook grows only by new parameters, which
implementations may leave out (pluggy passes only the arguments a hookimpl
names).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from llmgw.engine import Engine
    from llmgw.models import AdapterReport, DiscoverySettings, GpuReport
    from llmgw.provision import Provisioner

hookspec = pluggy.HookspecMarker("llmgw")

# ---------------------------------------------------------------------------
# engines
# ---------------------------------------------------------------------------


@hookspec
def llmgw_register_engines() -> list[Engine]:
    """Return the engines this plugin provides.

    Called once per process that builds the plugin manager (agent, server,
    ctl, ``llmgw plugins``), when the engine registry is first needed. Every
    implementation is called; the results are collected into one registry and
    an engine name registered by two plugins is an error naming both.

    :returns: a list of :class:`llmgw.engine.Engine` instances; an empty list
        (or ``None``) when this plugin provides no engine.
    """


# ---------------------------------------------------------------------------
# discovery
# ---------------------------------------------------------------------------


@hookspec
def llmgw_discover_gpus(settings: DiscoverySettings) -> GpuReport | None:
    """Find this node's GPUs.

    Called by the agent at start and before each registration, in a worker
    thread; may run a tool (``nvidia-smi``) with ``settings.timeout``. Every
    implementation is called and their GPUs are merged.

    :param settings: where to look (``settings.nvidia_smi``).
    :returns: a :class:`llmgw.models.GpuReport` whose ``status`` tells "found
        N GPUs" (N may be 0), "tool not found" and "tool failed" apart;
        ``None`` when this plugin does not look for GPUs.
    """


@hookspec
def llmgw_discover_adapters(settings: DiscoverySettings) -> AdapterReport | None:
    """Find this node's RDMA fabric adapters.

    Called by the agent at start, before it resolves its ``--fabric``
    declarations, in a worker thread; reads files under ``settings.ib_root``.
    Every implementation is called and their adapters are merged.

    :param settings: where to look (``settings.ib_root``).
    :returns: a :class:`llmgw.models.AdapterReport` (an absent root is
        ``status="not-found"``, not an error: such a node is an island);
        ``None`` when this plugin does not look for adapters.
    """


# ---------------------------------------------------------------------------
# provisioners
# ---------------------------------------------------------------------------


@hookspec
def llmgw_register_provisioners() -> list[Provisioner]:
    """Return the provisioners this plugin provides.

    Called by ``llmgw-provision-node`` when it builds its plugin manager.
    Every implementation is called; a provisioner name registered by two
    plugins is an error naming both.

    :returns: a list of :class:`llmgw.provision.Provisioner` instances; an
        empty list (or ``None``) when this plugin provides none.
    """
