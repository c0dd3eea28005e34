"""Placement without fragmentation on a real cluster: a two-node replica gets room from a moved one."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw.dev.cluster import LocalCluster
from llmgw.testing.load import GatewayLoad, gateway_models
from llmgw.testing.processes import free_port
from llmgw.wire import NodeList

SMALL = """
profiles:
  one:
    engine: sim
    gpus_per_node: 1
    args: ["--time-to-first-token", "0.02", "--tokens-per-second", "400"]
  pair:
    engine: sim
    nodes: 2
    gpus_per_node: 2
models:
  small:
    source: {models}/small
    profile: one
    replicas: 5
"""
BIG = """
  big:
    source: {models}/big
    profile: pair
    replicas: 1
"""
#: node -> fabric: two fabrics of two nodes, two islands; two GPUs each
FLEET = {1: "ib-a", 2: "ib-a", 3: "ib-b", 4: "ib-b", 5: None, 6: None}

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def cluster(tmp_path: Path):
    """Server, 6 agents (FLEET) and a gateway; five single-node replicas of ``small`` ready and routed."""
    local = LocalCluster(tmp_path / "cluster", server_port=free_port(), lost_after=10, poll_timeout=1)
    try:
        for name in ("small", "big"):
            (tmp_path / "models" / name).mkdir(parents=True)
        local.start_server()
        for index, fabric in FLEET.items():
            local.start_agent(local.add_node(index, fabric=fabric, gpus=2))
        local.wait(lambda: len(nodes(local).nodes) == len(FLEET), "every agent to register")
        local.start_gateway(free_port())
        local.apply(SMALL.format(models=tmp_path / "models"))
        local.wait(local.all_ready, "the five small replicas to be ready")
        local.wait(lambda: gateway_models(local.gateway_url) == ["small"], "the gateway to route small")
        yield local
    finally:
        local.stop_all()


def nodes(cluster: LocalCluster) -> NodeList:
    return cluster.client.request("GET", "/v1/admin/nodes", NodeList)


def whole_free(cluster: LocalCluster) -> dict[str, int]:
    """Per fabric, its nodes no replica uses a GPU of."""
    counts = {fabric: 0 for fabric in FLEET.values() if fabric}
    for node in nodes(cluster).nodes:
        for fabric in node.fabrics:
            counts[fabric] += node.gpus_free == node.gpus_total
    return counts


def test_two_node_replica_gets_room_by_moving_a_single_node_one_under_load(cluster, tmp_path):
    """Islands first, then fabric nodes: no fabric keeps two whole nodes; asking for a two-node replica moves
    one single-node replica (its replacement ready before it stops) and places it, with 0 failed requests."""
    small = cluster.replicas().replicas
    on_islands = {s.node for r in small for s in r.shards} & {"node-5", "node-6"}
    assert on_islands == {"node-5", "node-6"}, "single-node replicas should take the islands first"
    assert max(whole_free(cluster).values()) < 2, whole_free(cluster)
    listed = cluster.ctl("nodes")
    expected = ", ".join(f"{f} {n} of 2" for f, n in sorted(whole_free(cluster).items()))
    assert f"whole nodes free: {expected}" in listed.stdout, listed.stdout
    before = {r.id: r.shards[0].node for r in small}

    catalog = tmp_path / "big.yaml"
    catalog.write_text(SMALL.format(models=tmp_path / "models") + BIG.format(models=tmp_path / "models"))
    with GatewayLoad(cluster.gateway_url, 8, models=["small"]) as load:
        load.wait_served(32, check=cluster.check)
        applied = cluster.ctl("apply", "--wait", "--timeout", "200", str(catalog))
        assert applied.returncode == 0, applied.stdout + applied.stderr
        load.wait_served(32, check=cluster.check)
    assert load.failures == [], load.report()

    after = cluster.replicas().replicas
    (big,) = [r for r in after if r.model == "big"]
    assert big.state == "ready" and big.fabric in ("ib-a", "ib-b")
    room = {s.node for s in big.shards}
    assert len(room) == 2
    smalls = [r for r in after if r.model == "small"]
    assert len(smalls) == 5 and all(r.state == "ready" and not r.replaces for r in smalls)
    assert not room & {s.node for r in smalls for s in r.shards}
    moved = sorted(i for i, node in before.items() if node in room)
    assert len(moved) == 1 and moved[0] not in {r.id for r in smalls}, (before, room)
    events = cluster.ctl("events").stdout
    assert f"moving to small-5: room for big-0 on nodes {', '.join(sorted(room))}" in events, events
    assert "is ready, stopping the original" in events, events
    listed = cluster.ctl("nodes").stdout
    expected = ", ".join(f"{f} {n} of 2" for f, n in sorted(whole_free(cluster).items()))
    assert f"whole nodes free: {expected}" in listed, listed
