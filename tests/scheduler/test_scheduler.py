"""The scheduler: where each replica runs, and why a replica has no place."""

from __future__ import annotations

import random
from collections import Counter

import attrs
import pytest

from llmgw.models import GPU, Catalog, Fabric, Model, NodeFacts, Profile
from llmgw.scheduler import (
    NodeView,
    Replica,
    ScheduleResult,
    node_warnings,
    replica_id,
    schedule,
)

SOURCE = "/models/llama"


def node(
    node_id: str,
    *,
    fabric: str | None = None,
    gpus: int = 8,
    memory: int | list[int] = 81920,
    engines: tuple[str, ...] = ("vllm",),
    sources: tuple[str, ...] = (SOURCE,),
    state: str = "ready",
    port_range: tuple[int, int] = (20000, 20999),
    fabrics: tuple[str, ...] = (),
    problems: tuple[str, ...] = (),
) -> NodeView:
    """A node view with ``gpus`` GPUs of ``memory`` MiB (or one size per GPU)."""
    sizes = memory if isinstance(memory, list) else [memory] * gpus
    names = (fabric,) if fabric else fabrics
    facts = NodeFacts(
        node_id=node_id,
        agent_version="0.1.0",
        gpus=[
            GPU(i, f"GPU-{node_id}-{i}", "H100", size, size, f"0000:{i:02x}:00.0", "550")
            for i, size in enumerate(sizes)
        ],
        fabrics=[Fabric(name, (f"mlx5_{n}" for n in range(2))) for name in names],
        engines={engine: "1.0" for engine in engines},
        model_sources=sources,
        problems=problems,
    )
    return NodeView(facts=facts, address=f"10.0.0.{len(node_id)}", state=state, port_range=port_range)


def catalog(profiles: dict[str, Profile], **models: tuple[str, int]) -> Catalog:
    """A catalog whose models all use :data:`SOURCE`: ``name=(profile, replicas)``."""
    return Catalog(
        profiles=profiles,
        models={
            name: Model(source=SOURCE, profile=profile, replicas=count)
            for name, (profile, count) in models.items()
        },
    )


TP4 = {"tp4": Profile(engine="vllm", gpus_per_node=4)}
TP8X2 = {"tp8x2": Profile(engine="vllm", nodes=2, gpus_per_node=8)}


def nodes_of(result: ScheduleResult, model: str) -> list[str]:
    """Every node a model's shards run on, one entry per shard."""
    return [
        shard.node_id for replica in result.placements if replica.model == model for shard in replica.shards
    ]


def mixed_cluster() -> tuple[list[NodeView], Catalog]:
    """Eight nodes on three fabrics and two islands, room for a multi-node and two single-node models."""
    nodes = [
        node("a1", fabric="ib-a"),
        node("a2", fabric="ib-a"),
        node("a3", fabric="ib-a"),
        node("b1", fabric="ib-b"),
        node("b2", fabric="ib-b"),
        node("c1", fabric="ib-c"),
        node("island"),
        node("island2"),
    ]
    profiles = {**TP4, **TP8X2, "tp1": Profile(engine="vllm", gpus_per_node=1)}
    return nodes, catalog(profiles, big=("tp8x2", 2), mid=("tp4", 3), small=("tp1", 5))


class TestDeterminism:
    def test_same_inputs_in_any_order_give_the_same_result(self):
        """The same nodes and catalog, listed in another order, give exactly the same placements."""
        nodes, cat = mixed_cluster()
        first = schedule(nodes, cat, [])
        shuffled = list(nodes)
        random.Random(7).shuffle(shuffled)
        reordered = Catalog(profiles=cat.profiles, models=dict(reversed(list(cat.models.items()))))
        assert schedule(shuffled, reordered, []) == first
        assert schedule(nodes, cat, list(reversed(first.placements))) == schedule(
            nodes, cat, first.placements
        )

    def test_rerun_with_its_own_output_changes_nothing(self):
        """Feeding the result back in keeps every placement, removes nothing and gives the same reasons."""
        nodes, cat = mixed_cluster()
        cat = attrs.evolve(cat, models={**cat.models, "huge": Model(SOURCE, "tp8x2", 5)})
        first = schedule(nodes, cat, [])
        assert first.unplaced, "the cluster is meant to be too small for every replica"
        second = schedule(nodes, cat, first.placements)
        assert second.placements == first.placements
        assert second.unplaced == first.unplaced
        assert second.removed == ()

    def test_adding_a_model_leaves_the_others_where_they_are(self):
        """Applying a catalog with one more model places it without moving any existing replica."""
        nodes, cat = mixed_cluster()
        first = schedule(nodes, cat, [])
        grown = attrs.evolve(cat, models={**cat.models, "extra": Model(SOURCE, "tp1", 2)})
        second = schedule(nodes, grown, first.placements)
        assert set(first.placements) <= set(second.placements)
        assert len(nodes_of(second, "extra")) == 2
        assert second.removed == ()


class TestSpread:
    def test_replicas_of_one_model_go_to_different_nodes(self):
        """Four replicas on four nodes land one per node, even though each node could hold two."""
        nodes = [node(f"n{i}") for i in range(4)]
        result = schedule(nodes, catalog(TP4, m=("tp4", 4)), [])
        assert sorted(nodes_of(result, "m")) == ["n0", "n1", "n2", "n3"]

    def test_more_replicas_than_nodes_are_balanced(self):
        """Eight single-GPU replicas on three nodes are spread 3/3/2."""
        nodes = [node(f"n{i}") for i in range(3)]
        result = schedule(nodes, catalog({"tp1": Profile("vllm")}, m=("tp1", 8)), [])
        assert sorted(Counter(nodes_of(result, "m")).values()) == [2, 3, 3]

    def test_least_loaded_node_is_preferred(self):
        """A new model's replica goes to the node with the fewest used GPUs."""
        nodes = [node("n0"), node("n1")]
        busy = schedule(nodes, catalog(TP4, a=("tp4", 1)), [])
        assert nodes_of(busy, "a") == ["n0"]
        result = schedule(nodes, catalog(TP4, a=("tp4", 1), b=("tp4", 1)), busy.placements)
        assert nodes_of(result, "b") == ["n1"]


class TestFit:
    def test_gpus_are_never_shared(self):
        """Three 4-GPU replicas on one 8-GPU node: two fit on distinct GPUs, the third is unplaced."""
        result = schedule([node("n0")], catalog(TP4, m=("tp4", 3)), [])
        gpus = [set(replica.shards[0].gpus) for replica in result.placements]
        assert len(gpus) == 2 and not gpus[0] & gpus[1]
        assert [(item.model, item.index) for item in result.unplaced] == [("m", 2)]
        assert "needs 1 node with 4 free GPUs" in result.unplaced[0].reason
        assert "n0 (0 free)" in result.unplaced[0].reason

    def test_min_gpu_memory_picks_only_big_enough_gpus(self):
        """A profile's minimum GPU memory skips small GPUs, on a mixed node and on a node of small ones."""
        profiles = {"big-mem": Profile("vllm", gpus_per_node=2, min_gpu_memory_mib=80000)}
        nodes = [node("mixed", memory=[40960, 81920, 40960, 81920]), node("small", gpus=4, memory=40960)]
        result = schedule(nodes, catalog(profiles, m=("big-mem", 2)), [])
        assert [replica.shards[0].gpus for replica in result.placements] == [(1, 3)]
        (unplaced,) = result.unplaced
        assert "at least 80000 MiB" in unplaced.reason
        assert "small (0)" in unplaced.reason

    def test_cpu_only_profile_needs_no_gpu(self):
        """A profile with no GPUs per node runs on nodes without GPUs and takes no GPU."""
        result = schedule(
            [node("cpu0", gpus=0, engines=("llamacpp",)), node("cpu1", gpus=0, engines=("llamacpp",))],
            catalog({"cpu": Profile("llamacpp", gpus_per_node=0)}, m=("cpu", 2)),
            [],
        )
        assert sorted(nodes_of(result, "m")) == ["cpu0", "cpu1"]
        assert all(replica.shards[0].gpus == () for replica in result.placements)


class TestFabrics:
    def test_multi_node_replica_stays_on_one_fabric(self):
        """Every shard of a two-node replica is on nodes of the fabric it names, never on an island."""
        nodes, cat = mixed_cluster()
        result = schedule(nodes, cat, [])
        fabric_of = {view.node_id: {f.name for f in view.facts.fabrics} for view in nodes}
        big = [replica for replica in result.placements if replica.model == "big"]
        assert len(big) == 2
        for replica in big:
            assert len(set(replica.node_ids)) == 2
            assert all(replica.fabric in fabric_of[node_id] for node_id in replica.node_ids)
            assert "island" not in replica.node_ids

    def test_rank0_gets_the_dist_init_port_and_workers_do_not(self):
        """Rank 0 of a multi-node replica has an HTTP port and its own dist-init port; workers have none."""
        result = schedule(
            [node("a", fabric="ib"), node("b", fabric="ib")], catalog(TP8X2, m=("tp8x2", 1)), []
        )
        (replica,) = result.placements
        rank0, worker = replica.shards
        assert (rank0.rank, worker.rank) == (0, 1)
        assert rank0.dist_init_port is not None and rank0.dist_init_port != rank0.port
        assert worker.dist_init_port is None

    def test_island_and_a_lone_fabric_node_cannot_host_a_multi_node_replica(self):
        """A fabric node and an island are not enough for a two-node replica, and the reason says so."""
        result = schedule([node("a", fabric="ib-a"), node("isl")], catalog(TP8X2, m=("tp8x2", 1)), [])
        assert result.placements == ()
        (unplaced,) = result.unplaced
        assert "needs 2 nodes with 8 free GPUs on one fabric" in unplaced.reason
        assert "fabric ib-a has 1 such node (a)" in unplaced.reason
        assert "1 node is an island (no fabric): isl" in unplaced.reason

    def test_two_fabrics_with_one_node_each_are_not_one_fabric(self):
        """One free node on each of two fabrics cannot host a two-node replica."""
        result = schedule(
            [node("a", fabric="ib-a"), node("b", fabric="ib-b")], catalog(TP8X2, m=("tp8x2", 1)), []
        )
        assert result.placements == ()
        assert "fabric ib-a has 1 such node (a), fabric ib-b has 1 such node (b)" in result.unplaced[0].reason

    def test_island_takes_single_node_replicas(self):
        """A node with no fabric runs single-node replicas."""
        result = schedule([node("isl")], catalog(TP4, m=("tp4", 2)), [])
        assert nodes_of(result, "m") == ["isl", "isl"]
        assert all(replica.fabric is None for replica in result.placements)

    def test_node_on_two_fabrics_serves_either(self):
        """A node declared on two fabrics pairs with a node of either one."""
        nodes = [node("both", fabrics=("ib-a", "ib-b")), node("a", fabric="ib-a"), node("b", fabric="ib-b")]
        profiles = {"tp4x2": Profile("vllm", nodes=2, gpus_per_node=4)}
        result = schedule(nodes, catalog(profiles, m=("tp4x2", 2)), [])
        assert result.unplaced == ()
        assert {replica.fabric for replica in result.placements} == {"ib-a", "ib-b"}
        assert Counter(nodes_of(result, "m")) == {"both": 2, "a": 1, "b": 1}


class TestExcludedNodes:
    def test_cordoned_node_keeps_its_replicas_and_gets_no_new_ones(self):
        """Cordoning a node leaves its replicas in place; a new replica waits, with a reason."""
        first = schedule([node("n0")], catalog(TP4, m=("tp4", 1)), [])
        nodes = [node("n0", state="cordoned")]
        result = schedule(nodes, catalog(TP4, m=("tp4", 2)), first.placements)
        assert set(first.placements) <= set(result.placements)
        assert len(result.placements) == 1
        assert "1 node is cordoned: n0" in result.unplaced[0].reason

    def test_nodes_missing_engine_or_source_or_lost_are_never_chosen(self):
        """Only the ready node with the engine and the weights is chosen; the reason names the others."""
        nodes = [
            node("good"),
            node("no-engine", engines=("sglang",)),
            node("no-weights", sources=()),
            node("gone", state="lost"),
        ]
        result = schedule(nodes, catalog(TP4, m=("tp4", 3)), [])
        assert nodes_of(result, "m") == ["good", "good"]
        reason = result.unplaced[0].reason
        assert "1 node lacks engine vllm: no-engine" in reason
        assert f"1 node lacks model source {SOURCE}: no-weights" in reason
        assert "1 node is lost: gone" in reason
        assert "1 node has fewer than 4 free GPUs: good (0 free)" in reason

    def test_node_without_gpus_shows_its_discovery_problem(self):
        """A node whose GPU discovery failed is named with the problem the agent reported."""
        nodes = [node("blind", gpus=0, problems=("nvidia-smi not found at /usr/bin/nvidia-smi",))]
        result = schedule(nodes, catalog(TP4, m=("tp4", 1)), [])
        assert "blind (0; nvidia-smi not found at /usr/bin/nvidia-smi)" in result.unplaced[0].reason

    def test_no_nodes_at_all(self):
        """With no node registered, the reason says so."""
        result = schedule([], catalog(TP4, m=("tp4", 1)), [])
        assert result.unplaced[0].reason == "needs 1 node with 4 free GPUs; no node has registered"

    def test_reason_lists_a_few_names_and_counts_the_rest(self):
        """A reason naming many nodes shows five and says how many more."""
        nodes = [node(f"n{i:02}", engines=()) for i in range(12)]
        reason = schedule(nodes, catalog(TP4, m=("tp4", 1)), []).unplaced[0].reason
        assert "12 nodes lack engine vllm: n00, n01, n02, n03, n04 and 7 more" in reason


class TestChanges:
    def test_scale_down_removes_the_highest_indexes(self):
        """Going from four replicas to two keeps indexes 0 and 1 where they were."""
        nodes = [node(f"n{i}") for i in range(4)]
        first = schedule(nodes, catalog(TP4, m=("tp4", 4)), [])
        result = schedule(nodes, catalog(TP4, m=("tp4", 2)), first.placements)
        assert [replica.id for replica in result.placements] == ["m-0", "m-1"]
        assert set(result.placements) <= set(first.placements)
        assert [removal.replica.id for removal in result.removed] == ["m-2", "m-3"]
        assert "scaled down to 2" in result.removed[0].reason

    def test_scale_up_fills_the_lowest_free_indexes(self):
        """Scaling back up reuses the freed ids, lowest first."""
        nodes = [node(f"n{i}") for i in range(4)]
        two = schedule(nodes, catalog(TP4, m=("tp4", 2)), [])
        three = schedule(nodes, catalog(TP4, m=("tp4", 3)), two.placements)
        assert [replica.id for replica in three.placements] == ["m-0", "m-1", "m-2"]

    def test_model_removed_from_catalog_is_removed(self):
        """A model no longer in the catalog loses all its replicas, the others stay."""
        nodes, cat = mixed_cluster()
        first = schedule(nodes, cat, [])
        smaller = attrs.evolve(cat, models={k: v for k, v in cat.models.items() if k != "mid"})
        result = schedule(nodes, smaller, first.placements)
        assert nodes_of(result, "mid") == []
        assert {r.replica.model for r in result.removed} == {"mid"}
        assert all("no longer in the catalog" in r.reason for r in result.removed)
        assert set(result.placements) <= set(first.placements)

    def test_lost_node_replicas_are_placed_elsewhere(self):
        """A replica with a shard on a lost node is placed again on other nodes, one generation up."""
        nodes = [node("a", fabric="ib"), node("b", fabric="ib"), node("c", fabric="ib")]
        first = schedule(nodes, catalog(TP8X2, m=("tp8x2", 1)), [])
        (before,) = first.placements
        lost_id = before.node_ids[1]
        nodes = [attrs.evolve(view, state="lost") if view.node_id == lost_id else view for view in nodes]
        result = schedule(nodes, catalog(TP8X2, m=("tp8x2", 1)), first.placements)
        (after,) = result.placements
        assert lost_id not in after.node_ids
        assert (after.id, after.generation) == (before.id, 1)
        assert result.removed[0].reason == f"node {lost_id} is lost"

    def test_replica_on_an_unknown_node_is_placed_again(self):
        """A replica on a node the server no longer knows is placed on a known node."""
        first = schedule([node("old")], catalog(TP4, m=("tp4", 1)), [])
        result = schedule([node("new")], catalog(TP4, m=("tp4", 1)), first.placements)
        assert nodes_of(result, "m") == ["new"]
        assert result.removed[0].reason == "node old is not known"

    def test_node_that_lost_the_engine_loses_its_replicas(self):
        """A replica whose node no longer has the engine is placed where the engine is."""
        first = schedule([node("n0"), node("n1", engines=())], catalog(TP4, m=("tp4", 1)), [])
        assert nodes_of(first, "m") == ["n0"]
        result = schedule([node("n0", engines=()), node("n1")], catalog(TP4, m=("tp4", 1)), first.placements)
        assert nodes_of(result, "m") == ["n1"]
        assert result.removed[0].reason == "node n0 lacks engine vllm"

    def test_profile_shape_change_places_again(self):
        """Changing a profile from 4 to 8 GPUs replaces its replicas with 8-GPU ones."""
        nodes = [node("n0"), node("n1")]
        first = schedule(nodes, catalog(TP4, m=("tp4", 2)), [])
        bigger = {"tp4": Profile("vllm", gpus_per_node=8)}
        result = schedule(nodes, catalog(bigger, m=("tp4", 2)), first.placements)
        assert [len(replica.shards[0].gpus) for replica in result.placements] == [8, 8]
        assert "now needs 1 node(s) with 8 GPU(s) each" in result.removed[0].reason

    def test_conflicting_placements_keep_the_first_by_id(self):
        """Two stored replicas on the same GPUs: the first by id stays, the other is placed again."""
        nodes = [node("n0"), node("n1")]
        first = schedule(nodes, catalog(TP4, a=("tp4", 1)), [])
        (a0,) = first.placements
        clash = attrs.evolve(a0, id="b-0", model="b")
        result = schedule(nodes, catalog(TP4, a=("tp4", 1), b=("tp4", 1)), [a0, clash])
        assert a0 in result.placements
        assert nodes_of(result, "b") == ["n1"]
        assert "GPU 0 on n0 is already used by a-0" in result.removed[0].reason


class TestDrain:
    def test_replacement_is_placed_away_and_does_not_count(self):
        """A replica being moved gets a replacement elsewhere; the original stays until the caller ends it."""
        nodes = [node("n0"), node("n1")]
        cat = catalog(TP4, m=("tp4", 1))
        (original,) = schedule(nodes, cat, []).placements
        cordoned = [attrs.evolve(view, state="cordoned") if view.node_id == "n0" else view for view in nodes]
        moving = schedule(cordoned, cat, [original], replace=[original.id])
        replacement = next(r for r in moving.placements if r.replaces == original.id)
        assert original in moving.placements
        assert replacement.node_ids == ("n1",)
        assert replacement.id == "m-1"
        # While both exist, a run changes nothing: no second replacement, no scale down.
        assert schedule(cordoned, cat, moving.placements, replace=[original.id]) == moving
        assert schedule(cordoned, cat, moving.placements) == moving
        # The caller removes the original once the replacement is ready.
        done = schedule(cordoned, cat, [replacement])
        assert done.placements == (attrs.evolve(replacement, replaces=None),)
        assert done.unplaced == ()

    def test_replacement_without_room_is_unplaced_with_reason(self):
        """When no other node can take the replacement, it is unplaced and names the replica it was for."""
        (original,) = schedule([node("n0")], catalog(TP4, m=("tp4", 1)), []).placements
        result = schedule(
            [node("n0", state="cordoned")], catalog(TP4, m=("tp4", 1)), [original], replace=["m-0"]
        )
        (unplaced,) = result.unplaced
        assert unplaced.replaces == "m-0"
        assert "already runs the replica being moved: n0" in unplaced.reason


class TestPorts:
    def test_ports_are_unique_per_node_and_within_range(self):
        """Every port on a node, HTTP or dist-init, is used once and lies inside the node's range."""
        nodes = [node(f"n{i}", fabric="ib", port_range=(31000, 31099)) for i in range(4)]
        profiles = {**TP8X2, "tp1": Profile("vllm", gpus_per_node=1), "cpu": Profile("vllm", gpus_per_node=0)}
        result = schedule(nodes, catalog(profiles, big=("tp8x2", 1), small=("tp1", 16), cpu=("cpu", 6)), [])
        assert result.unplaced == ()
        used: dict[str, list[int]] = {}
        for replica in result.placements:
            for shard in replica.shards:
                ports = [shard.port] + ([shard.dist_init_port] if shard.dist_init_port is not None else [])
                used.setdefault(shard.node_id, []).extend(ports)
        for ports in used.values():
            assert len(ports) == len(set(ports))
            assert all(31000 <= port <= 31099 for port in ports)

    def test_new_ports_avoid_ports_in_use(self):
        """A new replica on a node takes the lowest port no existing shard holds."""
        nodes = [node("n0", port_range=(100, 110))]
        first = schedule(nodes, catalog(TP4, a=("tp4", 1)), [])
        moved = attrs.evolve(
            first.placements[0],
            shards=[attrs.evolve(first.placements[0].shards[0], port=100)],
        )
        result = schedule(nodes, catalog(TP4, a=("tp4", 1), b=("tp4", 1)), [moved])
        (b,) = [replica for replica in result.placements if replica.model == "b"]
        assert b.shards[0].port == 101

    def test_exhausted_port_range_is_a_reason(self):
        """A node whose port range is used up takes no more shards, and the reason names its range."""
        nodes = [node("n0", port_range=(100, 101))]
        result = schedule(nodes, catalog({"cpu": Profile("vllm", gpus_per_node=0)}, m=("cpu", 3)), [])
        assert len(result.placements) == 2
        assert "1 node has no free port left in its range: n0 (100-101)" in result.unplaced[0].reason


class TestRecords:
    def test_replica_ids_are_model_and_index(self):
        """Replica ids are the model name and the slot index."""
        assert replica_id("llama-3.1-70b", 2) == "llama-3.1-70b-2"

    def test_a_node_view_refuses_an_unknown_state_and_a_bad_port_range(self):
        """A node view only takes the states the scheduler knows and a port range low <= high."""
        with pytest.raises(ValueError):
            node("n0", state="sleeping")
        with pytest.raises(ValueError):
            node("n0", port_range=(2000, 1000))

    def test_duplicate_node_ids_are_refused(self):
        """Two nodes with one id are a bug in the caller, and schedule says which id."""
        with pytest.raises(ValueError, match="node n0 appears twice"):
            schedule([node("n0"), node("n0")], catalog(TP4), [])

    def test_missing_profile_is_a_reason(self):
        """A model whose profile is not in the catalog is unplaced with that reason."""
        cat = Catalog(profiles={}, models={"m": Model(SOURCE, "nope", 1)})
        assert schedule([node("n0")], cat, []).unplaced[0].reason == "profile nope is not in the catalog"

    def test_result_placements_are_replicas(self):
        """A result holds frozen Replica records, sorted by id."""
        nodes, cat = mixed_cluster()
        result = schedule(nodes, cat, [])
        assert all(isinstance(replica, Replica) for replica in result.placements)
        assert [r.id for r in result.placements] == sorted(r.id for r in result.placements)


class TestNodeWarnings:
    def test_warnings_name_missing_engines_and_sources(self):
        """ctl nodes can say which engine or model source a node lacks, and for which models."""
        cat = Catalog(
            profiles={"v": Profile("vllm"), "s": Profile("sglang")},
            models={"a": Model("/m/a", "v"), "b": Model("/m/b", "v"), "c": Model("/m/c", "s")},
        )
        view = node("n0", sources=("/m/a",), problems=("nvidia-smi failed: exit 9",))
        assert node_warnings(view, cat) == (
            "nvidia-smi failed: exit 9",
            "engine sglang not installed (model c)",
            "model source /m/b missing (model b)",
        )


class TestKeeping:
    def test_node_whose_gpu_discovery_fails_keeps_its_replicas(self):
        """A node that suddenly reports no GPUs (nvidia-smi failing) keeps its running replicas."""
        first = schedule([node("n0")], catalog(TP4, m=("tp4", 1)), [])
        blind = node("n0", gpus=0, problems=("nvidia-smi failed: exit 9",))
        result = schedule([blind], catalog(TP4, m=("tp4", 1)), first.placements)
        assert result.placements == first.placements
        assert result.removed == ()

    def test_scaling_down_a_replica_being_moved_drops_its_replacement(self):
        """When the catalog no longer wants a replica that is being moved, its replacement goes too."""
        nodes = [node("n0"), node("n1")]
        cat = catalog(TP4, m=("tp4", 1))
        (original,) = schedule(nodes, cat, []).placements
        moving = schedule(nodes, cat, [original], replace=[original.id])
        assert len(moving.placements) == 2
        result = schedule(nodes, catalog(TP4, m=("tp4", 0)), moving.placements)
        assert result.placements == ()
        assert sorted(removal.replica.id for removal in result.removed) == ["m-0", "m-1"]
