"""The reconciler when nodes go silent together, or must not be trusted: driven step by step.

No mass eviction: too many nodes silent at once are spared (the server suspects its own
network); a node whose certificate is revoked or expired is lost at once.
"""

from __future__ import annotations

import pytest
from llmgw_engine_sim import SimEngine

from llmgw.catalog import parse_catalog
from llmgw.server.reconciler import reconcile
from llmgw.server.state.cluster import ClusterState, Settings
from llmgw.server.views import cluster as views
from llmgw.testing.catalogs import catalog_yaml, model, sim_profile
from llmgw.testing.nodes import sim_node_sync
from llmgw.wire import ObservedShard

LOST_AFTER = 30.0


class Fleet:
    """A cluster and ``count`` nodes whose agents sync when the test says, running what they are told."""

    def __init__(self, count: int, replicas: int = 0, **settings) -> None:
        self.cluster = ClusterState(Settings(lost_after=LOST_AFTER, **settings))
        self.now = 1000.0
        self.ids = [f"node-{i}" for i in range(1, count + 1)]
        for node_id in self.ids:
            self.sync(node_id)
        text = catalog_yaml({"small": model("/models/small", replicas=replicas)}, one=sim_profile(8))
        self.cluster.apply_catalog(parse_catalog(text, {"sim": SimEngine()}), text, self.now)
        self.sync_all()
        self.sync_all()  # the shards placed by the first round report ready

    def sync(self, node_id: str) -> None:
        """One sync of ``node_id``: every shard it should run is reported ready."""
        desired = views.desired_for(self.cluster, node_id)
        request = sim_node_sync(
            node_id,
            gpus=8,
            address=f"127.0.0.{self.ids.index(node_id) + 10}",
            port_range=(20000, 20999),
            sources=("/models/small",),
            observed=[ObservedShard(s.replica_id, s.attempt, s.rank, "ready") for s in desired],
            revision=self.cluster.revision,
        )
        self.cluster.sync(request, self.now)
        reconcile(self.cluster, self.now)

    def sync_all(self, except_: tuple[str, ...] = ()) -> None:
        for node_id in self.ids:
            if node_id not in except_:
                self.sync(node_id)

    def pass_time(self, seconds: float, silent: tuple[str, ...] = ()) -> None:
        """``seconds`` go by in 1 s ticks; every node but ``silent`` syncs every 5 s."""
        for _ in range(int(seconds)):
            self.now += 1
            if int(self.now) % 5 == 0:
                self.sync_all(except_=silent)
            reconcile(self.cluster, self.now)

    def lost(self) -> list[str]:
        return sorted(n for n, node in self.cluster.nodes.items() if node.lost)

    def events(self, kind: str) -> list[str]:
        return [e.message for e in self.cluster.take_events() if e.kind == kind]


def test_one_silent_node_of_four_is_lost_as_before():
    """25% silent is under the 30% limit: the node is lost after lost_after and its replica moves."""
    fleet = Fleet(4, replicas=2)
    fleet.pass_time(40, silent=("node-1",))
    assert fleet.lost() == ["node-1"]
    assert len(fleet.cluster.replicas) == 2
    assert all("node-1" not in r.placement.node_ids for r in fleet.cluster.replicas.values())


def test_two_of_four_silent_together_are_spared_with_one_event():
    """50% silent at once: none is lost for ten minutes, their replicas stay, one event says why."""
    fleet = Fleet(4, replicas=4)
    placements = {r.id: r.placement for r in fleet.cluster.replicas.values()}
    fleet.cluster.take_events()
    fleet.pass_time(600, silent=("node-1", "node-2"))
    assert fleet.lost() == []
    assert {r.id: r.placement for r in fleet.cluster.replicas.values()} == placements
    events = fleet.events("cluster")
    assert events == [
        "2 of 4 nodes stopped syncing together (node-1, node-2): more than 30% at once looks like the "
        "server's own network, so none is declared lost and their replicas stay until syncs return; "
        "`llmgw ctl nodes lost NODE...` declares one lost"
    ]
    assert fleet.cluster.spared == {"node-1", "node-2"}
    status = {n.node_id: n for n in views.node_list(fleet.cluster, fleet.now).nodes}
    assert status["node-1"].state == "ready" and status["node-1"].warnings[-1].startswith(
        "no sync for 600 s, not declared lost: many nodes stopped syncing at once (ctl events); "
        "`llmgw ctl nodes lost node-1` if it is gone"
    )


def test_nodes_a_few_seconds_apart_count_as_together():
    """The second node stops 10 s after the first: when the first is due, the second is late: spared."""
    fleet = Fleet(4)
    fleet.pass_time(10, silent=("node-1",))
    fleet.pass_time(100, silent=("node-1", "node-2"))
    assert fleet.lost() == []
    (event,) = fleet.events("cluster")
    assert event.startswith("2 of 4 nodes stopped syncing together (node-1, node-2)")


def test_a_third_node_falling_silent_later_joins_the_episode():
    """Two spared, then a third goes silent: it is spared too, with one more event naming it."""
    fleet = Fleet(5)
    fleet.pass_time(60, silent=("node-1", "node-2"))
    fleet.pass_time(60, silent=("node-1", "node-2", "node-3"))
    assert fleet.lost() == []
    assert fleet.events("cluster")[1:] == ["also stopped syncing: node-3; still none is declared lost"]


def test_syncs_returning_end_the_episode_and_the_still_silent_are_judged():
    """One of two spared nodes syncs again: the episode ends; the other, silent lost_after more, is lost."""
    fleet = Fleet(4, replicas=4)
    fleet.pass_time(60, silent=("node-1", "node-2"))
    fleet.cluster.take_events()
    fleet.pass_time(10, silent=("node-2",))
    assert fleet.lost() == []
    assert fleet.events("cluster") == [
        "syncs are back (node-1): the silence is over and no node was declared lost; still silent: node-2, "
        "each declared lost if it does not sync within 30 s"
    ]
    assert fleet.cluster.spared == frozenset()
    fleet.pass_time(LOST_AFTER, silent=("node-2",))
    assert fleet.lost() == ["node-2"]
    assert fleet.events("node") == ["lost: no sync for 31 s (limit 30 s)"]


def test_all_syncs_returning_loses_nothing():
    """Both spared nodes come back: nothing was lost, nothing moved, the episode is over."""
    fleet = Fleet(4, replicas=4)
    placements = {r.id: r.placement for r in fleet.cluster.replicas.values()}
    fleet.pass_time(60, silent=("node-1", "node-2"))
    fleet.pass_time(60)
    assert fleet.lost() == [] and fleet.cluster.spared == frozenset()
    assert {r.id: r.placement for r in fleet.cluster.replicas.values()} == placements


def test_operator_declares_one_spared_node_lost_and_the_other_stays_spared():
    """`ctl nodes lost node-1` during an episode: node-1 is lost and its replica moves; node-2 stays."""
    fleet = Fleet(4, replicas=4)
    fleet.pass_time(60, silent=("node-1", "node-2"))
    assert fleet.cluster.fence_node("node-1", "declared lost by ops", fleet.now)
    reconcile(fleet.cluster, fleet.now)
    fleet.pass_time(120, silent=("node-1", "node-2"))
    assert fleet.lost() == ["node-1"]
    assert all("node-1" not in r.placement.node_ids for r in fleet.cluster.replicas.values())
    assert any("node-2" in r.placement.node_ids for r in fleet.cluster.replicas.values())


@pytest.mark.parametrize(
    ("count", "silent", "lost"), [(2, 1, 1), (3, 1, 1), (3, 2, 0), (10, 3, 3), (10, 4, 0)]
)
def test_the_limit_is_more_than_the_fraction_and_at_least_two(count, silent, lost):
    """One silent node is always judged; 3 of 10 (30%) are lost, 4 of 10 and 2 of 3 are spared."""
    fleet = Fleet(count)
    fleet.pass_time(60, silent=tuple(fleet.ids[:silent]))
    assert len(fleet.lost()) == lost


def test_the_fraction_is_a_setting():
    """With max_lost_fraction 0.6, 2 of 4 silent nodes are lost as before."""
    fleet = Fleet(4, max_lost_fraction=0.6)
    fleet.pass_time(60, silent=("node-1", "node-2"))
    assert fleet.lost() == ["node-1", "node-2"]


class TestFencing:
    """Nodes the server no longer trusts are lost at once, whatever their last sync."""

    def test_fenced_node_is_lost_at_once_and_its_replica_moves(self):
        """fence_node: lost now, one event naming why; the replica is placed elsewhere at once."""
        fleet = Fleet(2, replicas=1)
        node_id = fleet.cluster.replicas["small-0"].placement.rank0.node_id
        fleet.cluster.take_events()
        assert fleet.cluster.fence_node(node_id, "its certificate 1f is revoked", fleet.now)
        assert not fleet.cluster.fence_node(node_id, "again", fleet.now)
        reconcile(fleet.cluster, fleet.now)
        assert fleet.lost() == [node_id]
        replica = fleet.cluster.replicas["small-0"]
        assert replica.placement.rank0.node_id != node_id and replica.state == "starting"
        assert views.route_table(fleet.cluster).routes == {}
        assert [m for m in fleet.events("node") if m.startswith("lost")] == [
            "lost at once: its certificate 1f is revoked; its replicas are rebuilt elsewhere"
        ]

    def test_expired_certificate_is_lost_at_once(self):
        """A node past its recorded certificate expiry is lost at the next reconcile, not after lost_after."""
        fleet = Fleet(4)
        fleet.cluster.record_certificate("node-3", 0x2A, fleet.now + 2)
        fleet.pass_time(3)
        assert fleet.lost() == ["node-3"]
        lost = [m for m in fleet.events("node") if m.startswith("lost")]
        assert lost == ["lost at once: its certificate 2a expired; its replicas are rebuilt elsewhere"]
