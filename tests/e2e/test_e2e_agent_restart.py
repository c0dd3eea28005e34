"""Agents killed and upgraded on a real cluster under load: they adopt their engines, nothing restarts.

An agent's engines outlive it (its launchers keep them for ``--orphan-grace``),
and the next agent on the node adopts them: the same shards, the same
attempts, the same pids. So a kill -9 of the agent holding rank 1 of the only
replica of a two-node model, and an agent restarted in place (SIGTERM, then
start: an upgrade), lose no request of 16 clients.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from llmgw.dev.cluster import LocalCluster
from llmgw.testing.catalogs import LOAD_SIM, catalog_yaml, model, sim_profile
from llmgw.testing.load import GatewayLoad, routed_cluster
from llmgw.wire import EventList

CATALOG = catalog_yaml(
    {"big": model("{models}/big", "tp2"), "chat": model("{models}/chat", replicas=2)},
    tp2=sim_profile(2, *LOAD_SIM, nodes=2, stop_grace=5),
    one=sim_profile(1, *LOAD_SIM, stop_grace=5),
)


pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def cluster(tmp_path: Path):
    """Server and 2 agents on one fabric: a two-node replica and a single-node one on each node."""
    # a restarted agent is back well within lost_after, even on a loaded 2-core machine
    with routed_cluster(tmp_path, CATALOG, fabric="ib-a", lost_after=40) as local:
        yield local


def events(cluster: LocalCluster) -> list[str]:
    return [
        f"{e.subject}: {e.message}"
        for e in cluster.client.request("GET", "/v1/admin/events", EventList).events
    ]


def restart_agent(cluster: LocalCluster, node_id: str, sig: int) -> None:
    node = cluster.nodes[node_id]
    assert node.process is not None
    cluster.stop(node.process, sig)
    cluster.start_agent(node)


def engines(cluster: LocalCluster) -> dict[tuple[str, int], tuple[int, int | None]]:
    """(replica, rank) -> (attempt, engine pid) of every shard."""
    return {(r.id, s.rank): (r.attempt, s.pid) for r in cluster.replicas().replicas for s in r.shards}


def test_agents_killed_and_upgraded_under_load_restart_nothing(cluster):
    """kill -9 of the agent holding rank 1 of big (its only replica, on two nodes), then SIGTERM and start
    of the other node's agent (an upgrade): 16 clients (half streaming) of both models lose no request;
    every engine keeps its pid, every replica its attempt, and no failure is counted."""
    before = engines(cluster)
    [big] = [r for r in cluster.replicas().replicas if r.model == "big"]
    rank1_node = next(s.node for s in big.shards if s.rank == 1)
    other = next(n for n in cluster.nodes if n != rank1_node)
    with GatewayLoad(cluster.gateway_url, 16, models=["big", "chat"]) as load:
        load.wait_served(32, check=cluster.check)
        for node_id, sig in ((rank1_node, signal.SIGKILL), (other, signal.SIGTERM)):
            how = signal.Signals(sig).name
            adopted = f"{node_id}: its agent restarted and adopted every shard"
            restart_agent(cluster, node_id, sig)
            cluster.wait(
                lambda adopted=adopted: any(e.startswith(adopted) for e in events(cluster)),
                f"{node_id}'s new agent ({how}) to adopt its shards",
                90,
            )
            load.wait_served(64, check=cluster.check)
    assert load.failures == [], load.report()
    replicas = cluster.replicas().replicas
    assert all(r.failures == 0 and r.state == "ready" for r in replicas), replicas
    assert engines(cluster) == before
    seen = events(cluster)
    assert not [e for e in seen if ": failed: " in e or ": starting again" in e], seen
    assert "leaving 2 shards running" in cluster.tail("agent-" + other, 400)
    print(f"two agent restarts under 16 clients: {load.report()}")
