"""Placement without fragmentation: single-node replicas keep fabric nodes whole, and make room when asked."""

from __future__ import annotations

import random

import attrs

from llmgw.models import Catalog, Model, Profile
from llmgw.scheduler import NodeView, Replica, ScheduleResult, Shard, schedule
from tests.scheduler.test_scheduler import SOURCE, node, nodes_of

PROFILES = {
    "one": Profile(engine="vllm", gpus_per_node=1),
    "half": Profile(engine="vllm", gpus_per_node=4),
    "pair": Profile(engine="vllm", nodes=2, gpus_per_node=2),
}


def models(**replicas: tuple[str, int]) -> Catalog:
    """A catalog: ``name=(profile, replicas)`` over :data:`PROFILES`."""
    return Catalog(
        profiles=PROFILES,
        models={name: Model(source=SOURCE, profile=p, replicas=n) for name, (p, n) in replicas.items()},
    )


def fleet() -> list[NodeView]:
    """Two fabrics of two nodes and two islands, two GPUs each; the fabric nodes' ids sort first."""
    return [
        node("a1", fabric="ib-a", gpus=2),
        node("a2", fabric="ib-a", gpus=2),
        node("b1", fabric="ib-b", gpus=2),
        node("b2", fabric="ib-b", gpus=2),
        node("x1", gpus=2),
        node("x2", gpus=2),
    ]


def filled() -> tuple[list[NodeView], list[Replica]]:
    """The fleet with one single-node replica on every node but ``b2``: no fabric has two free nodes."""
    nodes = fleet()
    where = ["x1", "x2", "a1", "a2", "b1"]
    placements = [
        Replica(f"small-{i}", "small", i, [Shard(0, node_id, (0,), 20000)]) for i, node_id in enumerate(where)
    ]
    return nodes, placements


def retired(result: ScheduleResult) -> list[Replica]:
    """The placements once every replacement is ready and its original stopped (the server's retire)."""
    moved = {r.replaces for r in result.placements if r.replaces}
    return [attrs.evolve(r, replaces=None) for r in result.placements if r.id not in moved]


class TestPreference:
    def test_single_node_replica_takes_an_island_before_a_whole_fabric_node(self):
        result = schedule(fleet(), models(chat=("one", 1)), [])
        assert nodes_of(result, "chat")[0] in {"x1", "x2"}

    def test_single_node_replica_takes_a_partly_used_fabric_node_before_a_whole_one(self):
        nodes = [node("a1", fabric="ib-a"), node("a2", fabric="ib-a")]
        used = Replica("chat-0", "chat", 0, [Shard(0, "a2", (0, 1, 2, 3), 20000)])
        result = schedule(nodes, models(chat=("half", 1), embed=("half", 1)), [used])
        assert nodes_of(result, "embed") == ["a2"]

    def test_the_only_node_of_its_fabric_is_no_fabric_node_to_keep_whole(self):
        nodes = [node("a1", fabric="ib-a"), node("a2", fabric="ib-a"), node("b1", fabric="ib-b")]
        used = Replica("chat-0", "chat", 0, [Shard(0, "a1", (0, 1, 2, 3), 20000)])
        # a2 is whole and pairs with a1; b1 alone can never take a multi-node replica: the least used wins
        result = schedule(nodes, models(chat=("half", 1), embed=("half", 1)), [used])
        assert nodes_of(result, "embed") == ["b1"]

    def test_replicas_of_one_model_still_spread_over_nodes_first(self):
        nodes = [node("a1", fabric="ib-a"), node("x1")]
        result = schedule(nodes, models(chat=("one", 2)), [])
        assert sorted(nodes_of(result, "chat")) == ["a1", "x1"]

    def test_a_multi_node_replica_still_takes_the_least_used_fabric(self):
        nodes, placements = filled()
        result = schedule(nodes, models(small=("one", 5), big=("pair", 1)), placements[:2])
        assert sorted(nodes_of(result, "big")) in (["a1", "a2"], ["b1", "b2"])
        assert not result.moves


class TestMakingRoom:
    def test_a_single_node_replica_moves_away_from_a_fabric_a_two_node_replica_needs(self):
        nodes, placements = filled()
        result = schedule(nodes, models(small=("one", 5), big=("pair", 1)), placements)

        assert [(m.replica, m.replacement, m.fabric, m.nodes) for m in result.moves] == [
            ("small-4", "small-5", "ib-b", ("b1", "b2"))
        ]
        replacement = next(r for r in result.placements if r.id == "small-5")
        assert replacement.replaces == "small-4"
        assert replacement.node_ids[0] not in {"b1", "b2"}
        (waiting,) = result.unplaced
        assert waiting.id == "big-0" and "making room on nodes b1, b2 of fabric ib-b" in waiting.reason
        assert "small-4" in {r.id for r in result.placements}, (
            "the original serves until its replacement is ready"
        )

    def test_while_the_move_is_under_way_nothing_else_moves(self):
        nodes, placements = filled()
        catalog = models(small=("one", 5), big=("pair", 1))
        first = schedule(nodes, catalog, placements)
        again = schedule(nodes, catalog, first.placements)
        assert again.placements == first.placements and not again.moves
        assert "waiting for small-4 to move off nodes b1, b2 of fabric ib-b" in again.unplaced[0].reason

    def test_once_the_original_stopped_the_two_node_replica_takes_the_freed_nodes(self):
        nodes, placements = filled()
        catalog = models(small=("one", 5), big=("pair", 1))
        after = schedule(nodes, catalog, retired(schedule(nodes, catalog, placements)))
        assert sorted(nodes_of(after, "big")) == ["b1", "b2"]
        assert len(nodes_of(after, "small")) == 5 and not after.unplaced and not after.moves

    def test_no_move_when_the_moved_replica_would_have_no_place(self):
        nodes, placements = filled()
        # a second replica on every node but b2 leaves b2's two GPUs as the only room
        placements += [
            Replica(f"small-{5 + i}", "small", 5 + i, [Shard(0, r.node_ids[0], (1,), 20001)])
            for i, r in enumerate(placements)
        ]
        result = schedule(nodes, models(small=("one", 10), big=("pair", 1)), placements)
        assert not result.moves and list(result.placements) == sorted(placements, key=lambda r: r.id)
        assert "making room" not in result.unplaced[0].reason

    def test_multi_node_and_outdated_replicas_are_not_moved(self):
        nodes, placements = filled()
        launches = {"small-4": (Model(source=SOURCE, profile="one", replicas=5), PROFILES["one"])}
        result = schedule(nodes, models(small=("one", 5), big=("pair", 1)), placements, launches=launches)
        # small-4 on b1 runs an outdated command; moving the ones on a1 and a2 makes room on ib-a instead
        assert {m.replica for m in result.moves} == {"small-2", "small-3"}
        assert {m.fabric for m in result.moves} == {"ib-a"}

    def test_the_decision_does_not_depend_on_input_order(self):
        nodes, placements = filled()
        catalog = models(small=("one", 5), big=("pair", 1))
        expected = schedule(nodes, catalog, placements)
        for seed in range(5):
            rng = random.Random(seed)
            shuffled_nodes, shuffled = nodes[:], placements[:]
            rng.shuffle(shuffled_nodes)
            rng.shuffle(shuffled)
            assert schedule(shuffled_nodes, catalog, shuffled) == expected
