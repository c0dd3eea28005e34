"""Placement for distributable sources: nodes without the files may be chosen; holders come first."""

from __future__ import annotations

from llmgw.models import Catalog, Model, Profile
from llmgw.scheduler import node_warnings, schedule
from tests.scheduler.test_scheduler import node

SEED = "seed:///data/llama"
PROFILE = {"one": Profile(engine="vllm", gpus_per_node=1)}


def seeded(replicas: int) -> Catalog:
    return Catalog(profiles=PROFILE, models={"llama": Model(source=SEED, profile="one", replicas=replicas)})


def nodes_of(result) -> list[str]:
    return sorted(shard.node_id for replica in result.placements for shard in replica.shards)


def test_the_holder_is_chosen_before_nodes_without_the_files():
    """One replica goes to the node holding the seed, though another node sorts first by name."""
    result = schedule(
        [node("a", sources=()), node("b", sources=(SEED,)), node("c", sources=())], seeded(1), []
    )
    assert nodes_of(result) == ["b"]


def test_replicas_spread_to_nodes_that_will_copy_the_files():
    """Three replicas, one holder: one per node, two copying (a plain path places none)."""
    nodes = [node("a", sources=()), node("b", sources=(SEED,)), node("c", sources=())]
    result = schedule(nodes, seeded(3), [])
    assert nodes_of(result) == ["a", "b", "c"] and not result.unplaced
    plain = Catalog(
        profiles=PROFILE, models={"llama": Model(source="/data/llama", profile="one", replicas=3)}
    )
    assert len(schedule(nodes, plain, []).placements) == 0


def test_holders_win_among_equally_loaded_nodes():
    """With two holders of four nodes, two replicas go to the two holders."""
    nodes = [node(n, sources=(SEED,) if n in "bd" else ()) for n in "abcd"]
    assert nodes_of(schedule(nodes, seeded(2), [])) == ["b", "d"]


def test_a_node_without_a_seed_is_not_warned_about():
    """ctl nodes does not call a distributable source missing: it is copied when needed."""
    assert node_warnings(node("a", sources=()), seeded(1)) == ()
