"""A fleet driven step by step: simulated nodes syncing with a cluster state in this process, on a set clock.

For tests of the server's decisions without a network or a running server::

    fleet = SteppedFleet(CATALOG, {"sim": SimEngine()}, gpus=1, sources=("/models/chat",))
    fleet.report("ready")            # every node reports its shards ready, twice
    fleet.now += 30                  # the clock moves only when the test says
    fleet.sync("n1", [], adapters)   # one agent sync, then a reconciler pass

Every node is a :func:`~llmgw.testing.nodes.sim_node_sync` of the same facts (``gpus`` fake GPUs, the
``engines`` installed, the model ``sources`` present), on ``127.0.0.2``, ``127.0.0.3``...
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from llmgw.catalog import parse_catalog
from llmgw.server.reconciler import reconcile
from llmgw.server.state.cluster import ClusterState
from llmgw.server.views import cluster as views
from llmgw.testing.nodes import sim_node_sync
from llmgw.wire import ObservedAdapter, ObservedShard

if TYPE_CHECKING:
    from llmgw.engine import Engine

__all__ = ["SteppedFleet"]


class SteppedFleet:
    """``nodes`` that have synced once each, then a catalog applied and a reconciler pass 20 s later."""

    def __init__(
        self,
        catalog: str,
        engines: Mapping[str, Engine],
        *,
        nodes: Sequence[str] = ("n1", "n2"),
        gpus: int = 1,
        installed: Mapping[str, str] | None = None,
        sources: tuple[str, ...] = (),
    ) -> None:
        """:param installed: engine -> version on every node (default: the sim)."""
        self.cluster = ClusterState()
        self.now = 1000.0
        self.nodes = tuple(nodes)
        self.gpus, self.installed, self.sources = gpus, installed, sources
        for node in self.nodes:
            self.sync(node, [])
        self.cluster.apply_catalog(parse_catalog(catalog, engines), catalog, self.now)
        self.now += 20
        reconcile(self.cluster, self.now)

    def sync(
        self, node: str, shards: Sequence[ObservedShard], adapters: tuple[ObservedAdapter, ...] = ()
    ) -> None:
        """One sync of ``node``'s agent reporting ``shards`` (and its rank 0s' ``adapters``), then a pass."""
        request = sim_node_sync(
            node,
            gpus=self.gpus,
            address=f"127.0.0.{self.nodes.index(node) + 2}",
            port_range=(20000, 20999),
            sources=self.sources,
            engines=self.installed,
            observed=shards,
            adapters=adapters,
            checked_sources=self.cluster.sources_to_check(),
        )
        self.cluster.sync(request, self.now)
        rank0 = [r.id for r in self.cluster.replicas.values() if r.placement.rank0.node_id == node]
        self.cluster.adapters.observe(rank0, adapters)
        reconcile(self.cluster, self.now)

    def report(self, state: str) -> None:
        """Every node reports each shard it should run in ``state``, twice over (a shard a first round
        started on one node may reach another's desired state)."""
        for _ in range(2):
            for node in self.nodes:
                shards = [
                    ObservedShard(s.replica_id, s.attempt, s.rank, state)
                    for s in views.desired_for(self.cluster, node)
                ]
                self.sync(node, shards)
