"""Stopping a multi-node replica: rank 0 first with its grace, its workers once rank 0 is gone."""

from __future__ import annotations

from test_cluster import Harness  # the reconciler's step-by-step harness

from llmgw.models import Catalog
from llmgw.server.controllers.stopping import STOP_MARGIN
from llmgw.server.reconciler import reconcile
from llmgw.server.views import cluster as views
from llmgw.wire import ObservedShard


def running_two_node_replica() -> tuple[Harness, str, str]:
    """A ready two-node replica big-0 on a1 and a2: (harness, rank 0's node, rank 1's node)."""
    h = Harness.running_big()
    record = h.cluster.replicas["big-0"]
    assert record.state == "ready"
    rank0, rank1 = record.placement.shards
    return h, rank0.node_id, rank1.node_id


def big_shards(h: Harness, node_id: str) -> list[tuple[int, bool]]:
    desired = views.desired_for(h.cluster, node_id)
    return [(s.rank, s.stop_after_rank0) for s in desired if s.replica_id == "big-0"]


def test_workers_are_held_until_rank_0_has_stopped():
    """Scaled to 0: rank 0 leaves its node's shards at once; rank 1 stays, held, until rank 0 is gone."""
    h, rank0_node, rank1_node = running_two_node_replica()
    h.apply(big=0)
    assert big_shards(h, rank0_node) == []
    assert big_shards(h, rank1_node) == [(1, True)]
    assert "big" not in views.route_table(h.cluster).routes
    h.sync(rank0_node)  # its agent applied the stop and reports rank 0 gone
    h.sync(rank1_node)
    assert big_shards(h, rank1_node) == []
    events = [e.message for e in h.cluster.take_events() if e.subject == "big-0"]
    assert any(m.endswith("rank 0 stopped; stopping its workers") for m in events), events


def test_rank_0_exiting_releases_the_workers():
    """A rank 0 reported `exited` is gone: its workers are released at the next pass."""
    h, rank0_node, rank1_node = running_two_node_replica()
    attempt = h.cluster.replicas["big-0"].attempt
    h.apply(big=0)
    h.states[rank0_node][f"big-0/{attempt}/r0"] = ObservedShard("big-0", attempt, 0, "exited", exit_code=0)
    h.revisions[rank0_node] = 0  # as if the agent had not applied the newest reply yet
    h.sync(rank0_node)
    assert big_shards(h, rank1_node) == []


def test_workers_are_released_after_rank_0s_grace():
    """A rank 0 still stopping holds its workers for its stop grace (30 s) plus the margin, no longer."""
    h, rank0_node, rank1_node = running_two_node_replica()
    attempt = h.cluster.replicas["big-0"].attempt
    h.apply(big=0)

    def pass_time(seconds: float) -> None:
        h.now += seconds
        h.states[rank0_node][f"big-0/{attempt}/r0"] = ObservedShard("big-0", attempt, 0, "stopping")
        h.sync(rank0_node)
        h.sync(rank1_node)

    for _ in range(3):
        pass_time((30 + STOP_MARGIN - 1) / 3)
    assert big_shards(h, rank1_node) == [(1, True)]
    pass_time(1)
    assert big_shards(h, rank1_node) == []
    events = [e.message for e in h.cluster.take_events() if e.subject == "big-0"]
    assert any(m.endswith("rank 0 is still stopping past its grace; stopping its workers") for m in events)


def test_a_lost_rank_0_node_releases_the_workers():
    """When rank 0's node is lost there is nothing to wait for."""
    h, rank0_node, rank1_node = running_two_node_replica()
    h.apply(big=0)
    h.now += 31  # past lost_after for the silent rank 0 node, within the grace
    h.sync(rank1_node)
    assert h.cluster.nodes[rank0_node].lost
    assert big_shards(h, rank1_node) == []


def test_a_failed_replica_stops_every_shard_at_once():
    """A replica that failed holds nothing back: every shard of the failed attempt leaves at once."""
    h, rank0_node, rank1_node = running_two_node_replica()
    h.set_state(rank1_node, "big-0", "exited", exit_code=1)
    h.sync(rank1_node)
    assert h.cluster.replicas["big-0"].state == "backoff"
    assert big_shards(h, rank0_node) == big_shards(h, rank1_node) == []


def test_single_node_replicas_hold_nothing():
    """One-node replicas have no workers to hold."""
    h = Harness()
    h.join("node-1")
    h.apply()
    h.sync_all()
    h.run_all("small-0")
    h.cluster.apply_catalog(Catalog(h.cluster.catalog.profiles, {}), "", h.now)
    reconcile(h.cluster, h.now)
    assert views.desired_for(h.cluster, "node-1") == () and not h.cluster.stopping.held
