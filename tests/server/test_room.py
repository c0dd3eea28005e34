"""Room for a multi-node replica, step by step: single-node replicas move (ready first), then it is placed."""

from __future__ import annotations

from llmgw.catalog import parse_catalog
from llmgw.server.reconciler import reconcile
from llmgw.server.views import cluster as views
from tests.server.test_cluster import ENGINES, Harness

CATALOG = """
profiles:
  one:
    engine: sim
    gpus_per_node: 2
  whole:
    engine: sim
    nodes: 2
    gpus_per_node: 8
models:
  small:
    source: /models/small
    profile: one
    replicas: 4
{big}
"""
BIG = """
  big:
    source: /models/big
    profile: whole
    replicas: 1
"""


def apply(h: Harness, big: bool) -> None:
    text = CATALOG.format(big=BIG if big else "")
    h.cluster.apply_catalog(parse_catalog(text, ENGINES), text, h.now)
    reconcile(h.cluster, h.now)
    h.sync_all()


def test_single_node_replicas_move_off_a_fabric_ready_first_then_the_two_node_replica_takes_it():
    h = Harness()
    h.join("node-1", "ib")
    h.join("node-2", "ib")
    h.join("node-3")
    apply(h, big=False)
    for replica_id in list(h.cluster.replicas):
        h.run_all(replica_id)
    ready = lambda: len(views.route_table(h.cluster).routes.get("small", ()))  # noqa: E731
    assert ready() == 4
    on_fabric = sorted(r.id for r in h.cluster.replicas.values() if r.placement.rank0.node_id != "node-3")
    assert on_fabric, "the island alone cannot hold four replicas"
    h.cluster.take_events()

    apply(h, big=True)
    moving = {r.placement.replaces: r for r in h.cluster.replicas.values() if r.placement.replaces}
    assert sorted(moving) == on_fabric
    assert all(r.placement.node_ids == ("node-3",) for r in moving.values())
    assert "big-0" not in h.cluster.replicas
    assert "making room on nodes node-1, node-2 of fabric ib" in h.cluster.unplaced[0].reason
    messages = [e.message for e in h.cluster.take_events() if e.subject in on_fabric]
    assert len([m for m in messages if m.startswith("moving to small-")]) == len(on_fabric), messages

    h.now += h.cluster.settings.unplaced_retry + 1  # tried again: nothing more moves meanwhile
    h.sync_all()
    assert set(on_fabric) <= set(h.cluster.replicas), "an original stopped before its replacement was ready"
    assert len(h.cluster.replicas) == 4 + len(on_fabric)
    assert ready() == 4 and "waiting for" in h.cluster.unplaced[0].reason
    for replacement in moving.values():
        h.run_all(replacement.id)
        assert ready() >= 4
    h.sync_all()

    assert not set(on_fabric) & set(h.cluster.replicas)
    big = h.cluster.replicas["big-0"].placement
    assert sorted(big.node_ids) == ["node-1", "node-2"] and big.fabric == "ib"
    assert ready() == 4 and not h.cluster.unplaced
