"""Agents restarted on a real cluster: their replicas start again with no failure counted and no backoff."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from llmgw.dev.cluster import LocalCluster
from llmgw.testing.load import GatewayLoad, gateway_models
from llmgw.testing.processes import free_port
from llmgw.wire import EventList

CATALOG = """
profiles:
  tp2:
    engine: sim
    nodes: 2
    gpus_per_node: 2
    stop_grace: 5
  one:
    engine: sim
    gpus_per_node: 1
    stop_grace: 5
models:
  big:
    source: {models}/big
    profile: tp2
  chat:
    source: {models}/chat
    profile: one
    replicas: 2
"""

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def cluster(tmp_path: Path):
    """Server and 2 agents on one fabric: a two-node replica and a single-node one on each node."""
    # a restarted agent is back well within lost_after, even on a loaded 2-core machine
    local = LocalCluster(tmp_path / "cluster", server_port=free_port(), lost_after=40, poll_timeout=1)
    try:
        for name in ("big", "chat"):
            (tmp_path / "models" / name).mkdir(parents=True)
        local.start(2, fabric="ib-a")
        local.start_gateway(free_port())
        local.apply(CATALOG.format(models=tmp_path / "models"))
        local.wait(lambda: local.all_ready() and len(local.replicas().replicas) == 3, "every replica ready")
        local.wait(lambda: gateway_models(local.gateway_url) == ["big", "chat"], "the gateway to route both")
        yield local
    finally:
        local.stop_all()


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


def test_agents_restarted_cost_no_failure(cluster):
    """SIGTERM (the agent says it leaves), then kill -9 (the new agent finds what the old one left).

    16 clients (half streaming) of the single-node model, which has a replica on each node, lose no
    request through the SIGTERM restart: the gateway stops sending to node-2 before its engines stop.
    """
    before = {r.id: r.attempt for r in cluster.replicas().replicas}
    with GatewayLoad(cluster.gateway_url, 16, models=["chat"]) as load:
        load.wait_served(32, check=cluster.check)
        restart_agent(cluster, "node-2", signal.SIGTERM)
        cluster.wait(
            lambda: (
                cluster.all_ready()
                and {r.attempt for r in cluster.replicas().replicas} - set(before.values())
            ),
            "the replicas to start again after node-2's agent restarted",
            90,
        )
        load.wait_served(32, check=cluster.check)
    assert load.failures == [], load.report()
    cluster.wait(
        lambda: cluster.all_ready() and len(cluster.replicas().replicas) == 3, "every replica ready", 60
    )
    replicas = cluster.replicas().replicas
    assert all(r.failures == 0 and r.state == "ready" for r in replicas), replicas
    on_node_2 = {r.id for r in replicas if any(s.node == "node-2" for s in r.shards)}
    assert all(r.attempt != before[r.id] for r in replicas if r.id in on_node_2)
    seen = events(cluster)
    assert any(e.startswith("node-2: its agent is stopping on purpose") for e in seen), seen
    assert "big-0: starting again: the agent of node-2 is stopping (not counted as a failure)" in seen, seen
    assert not [e for e in seen if ": failed: " in e], seen
    assert "told the server this agent is leaving" in cluster.tail("agent-node-2", 200)

    # kill -9: no farewell; the new agent reports the shards its predecessor's launchers ended
    [chat] = [r for r in replicas if r.model == "chat" and {s.node for s in r.shards} == {"node-1"}]
    restart_agent(cluster, "node-1", signal.SIGKILL)
    cluster.wait(
        lambda: any(r.id == chat.id and r.attempt != chat.attempt for r in cluster.replicas().replicas),
        f"{chat.id} to start again after node-1's agent was killed and started again",
        90,
    )
    cluster.wait(
        lambda: cluster.all_ready() and len(cluster.replicas().replicas) == 3, "every replica ready", 90
    )
    # big-0 too: if its other rank saw the killed one go first, that failure was taken back
    assert all(r.failures == 0 for r in cluster.replicas().replicas), cluster.replicas().replicas
    seen = events(cluster)
    assert any(e.startswith("node-1: its agent restarted") for e in seen), seen
    assert any(e.startswith(f"{chat.id}: starting again: the agent of node-1 restarted") for e in seen), seen
