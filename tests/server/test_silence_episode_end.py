"""The end of a mass-silence episode: nodes released together are not declared lost one by one.

Issue 24: SIGCONT of two spared agents at once; the first sync of one ended the
episode and the other, due to sync a moment later, was declared lost "no sync
for 64 s" in the same second. Driven step by step on the cluster's own clock.
"""

from __future__ import annotations

from llmgw.server.reconciler import reconcile
from tests.server.test_cluster_faults import LOST_AFTER, Fleet


def test_nodes_returning_a_moment_apart_end_the_episode_and_none_is_lost():
    """node-4 syncs, node-3 one second later: nothing lost, nothing moved, one event ends the episode."""
    fleet = Fleet(4, replicas=4)
    placements = {r.id: r.placement for r in fleet.cluster.replicas.values()}
    fleet.pass_time(60, silent=("node-3", "node-4"))
    assert fleet.cluster.spared == {"node-3", "node-4"}
    fleet.cluster.take_events()
    fleet.now += 1
    fleet.sync("node-4")
    fleet.now += 1
    reconcile(fleet.cluster, fleet.now)
    fleet.sync("node-3")
    fleet.pass_time(2 * LOST_AFTER)
    assert fleet.lost() == []
    assert {r.id: r.placement for r in fleet.cluster.replicas.values()} == placements
    events = fleet.cluster.take_events()
    assert not [e.message for e in events if e.kind == "node"], "no node was lost"
    assert [e.message for e in events if e.kind == "cluster"] == [
        "syncs are back (node-4): the silence is over and no node was declared lost; still silent: node-3, "
        "each declared lost if it does not sync within 30 s"
    ]


def test_a_node_still_silent_after_the_episode_is_lost_by_the_usual_rule_counted_from_its_end():
    """node-3 never comes back: lost once it has not synced for lost_after after the episode ended."""
    fleet = Fleet(4, replicas=4)
    fleet.pass_time(60, silent=("node-3", "node-4"))
    fleet.now += 1
    fleet.sync("node-4")
    ended = fleet.now
    fleet.pass_time(LOST_AFTER - 1, silent=("node-3",))
    assert fleet.lost() == []
    fleet.pass_time(2, silent=("node-3",))
    assert fleet.lost() == ["node-3"]
    assert fleet.now - ended <= LOST_AFTER + 1
    assert all("node-3" not in r.placement.node_ids for r in fleet.cluster.replicas.values())


def test_a_new_episode_after_one_ended_is_spared_again():
    """The fleet goes silent again later: the same guard holds, with a new event."""
    fleet = Fleet(4)
    fleet.pass_time(60, silent=("node-3", "node-4"))
    fleet.pass_time(60)
    fleet.cluster.take_events()
    fleet.pass_time(60, silent=("node-1", "node-2"))
    assert fleet.lost() == []
    [event] = [e.message for e in fleet.cluster.take_events() if e.kind == "cluster"]
    assert event.startswith("2 of 4 nodes stopped syncing together (node-1, node-2)")
