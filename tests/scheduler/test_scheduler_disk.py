"""Disk room: a node gets a copy only when its models directory can take it, and the reason says so."""

from __future__ import annotations

import attrs

from llmgw.models import Catalog, Model, ModelCopy, Profile
from llmgw.scheduler import NodeView, Replica, Shard, schedule
from tests.scheduler.test_scheduler import node

SEED = "seed:///data/chat"
OTHER = "seed:///data/old"
GB = 10**9
PROFILE = {"one": Profile(engine="vllm", gpus_per_node=1)}
SIZES = {SEED: 4_200_000_000, OTHER: 2 * GB}


def chat(replicas: int, source: str = SEED) -> Catalog:
    return Catalog(profiles=PROFILE, models={"chat": Model(source=source, profile="one", replicas=replicas)})


#: one replica each of ``chat`` (from SEED) and ``old`` (from OTHER)
CHAT_AND_OLD = Catalog(
    profiles=PROFILE,
    models={
        "chat": Model(source=SEED, profile="one", replicas=1),
        "old": Model(source=OTHER, profile="one", replicas=1),
    },
)


def disk_node(
    node_id: str, free: int | None, *copies: ModelCopy, sources: tuple[str, ...] = (), gpus: int = 8
) -> NodeView:
    view = node(node_id, sources=sources, gpus=gpus)
    return attrs.evolve(view, facts=attrs.evolve(view.facts, models_free_bytes=free, model_copies=copies))


def copy(source: str, present: int, *, complete: bool = False, last_used: float = 0.0) -> ModelCopy:
    return ModelCopy(
        (source[-1] * 64)[:64].replace("/", "a"), source, present, SIZES[source], complete, last_used
    )


def nodes_of(result) -> list[str]:
    return sorted(shard.node_id for replica in result.placements for shard in replica.shards)


def test_a_node_without_room_is_never_chosen_and_the_reason_names_its_free_bytes():
    """4.2 GB to copy: node-2 with 1.1 GB free gets nothing, node-1 (one GPU) one; the second waits."""
    nodes = [disk_node("node-1", 10 * GB, gpus=1), disk_node("node-2", 1_100_000_000)]
    result = schedule(nodes, chat(2), [], sizes=SIZES)
    assert nodes_of(result) == ["node-1"]
    [unplaced] = result.unplaced
    assert "1 node has no disk room for chat's 4.2 GB of weights (+5% headroom): node-2 (1.1 GB free)" in (
        unplaced.reason
    ), unplaced.reason


def test_headroom_counts():
    """Exactly the model's size free is not enough with 5% headroom; 5% more is."""
    assert not schedule([disk_node("a", SIZES[SEED])], chat(1), [], sizes=SIZES).placements
    assert schedule([disk_node("a", int(SIZES[SEED] * 1.05))], chat(1), [], sizes=SIZES).placements
    assert schedule([disk_node("a", SIZES[SEED])], chat(1), [], sizes=SIZES, headroom=0.0).placements


def test_unknown_sizes_and_free_bytes_are_not_checked():
    """No manifest yet, or an agent that cannot read its disk: placed as before."""
    assert schedule([disk_node("a", 1)], chat(1), []).placements
    assert schedule([disk_node("a", None)], chat(1), [], sizes=SIZES).placements


def test_a_holder_needs_no_room():
    """A node with a complete copy (or the seed) takes a replica however full its disk."""
    full = disk_node("a", 0, copy(SEED, SIZES[SEED], complete=True), sources=(SEED,))
    assert nodes_of(schedule([full], chat(1), [], sizes=SIZES)) == ["a"]


def test_a_partial_copy_needs_only_what_it_lacks():
    """3 of 4.2 GB present and 1.5 GB free: the copy fits (1.2 GB + 5% headroom left to fetch)."""
    partial = disk_node("a", 1_500_000_000, copy(SEED, 3 * GB))
    assert nodes_of(schedule([partial], chat(1), [], sizes=SIZES)) == ["a"]


def test_unused_copies_count_as_room_and_are_named():
    """A 2 GB copy nothing uses counts: 3 GB free + 2 GB evictable takes the 4.2 GB model."""
    view = disk_node("a", 3 * GB, copy(OTHER, 2 * GB, complete=True), sources=(OTHER,))
    assert nodes_of(schedule([view], chat(1), [], sizes=SIZES)) == ["a"]
    tight = disk_node("a", 1 * GB, copy(OTHER, 2 * GB, complete=True), sources=(OTHER,))
    [unplaced] = schedule([tight], chat(1), [], sizes=SIZES).unplaced
    assert "a (1.0 GB free, 2.0 GB in unused copies)" in unplaced.reason, unplaced.reason


def test_a_copy_in_use_is_not_counted_as_room():
    """The 2 GB copy runs a replica of another model on the node: only the 3 GB free count."""
    view = disk_node("a", 3 * GB, copy(OTHER, 2 * GB, complete=True), sources=(OTHER,))
    running = Replica("old-0", "old", 0, [Shard(0, "a", (0,), 20000)])
    result = schedule([view], CHAT_AND_OLD, [running], sizes=SIZES)
    assert [r.id for r in result.placements] == ["old-0"]
    assert "a (3.0 GB free)" in result.unplaced[0].reason, result.unplaced[0].reason


def test_a_copy_other_nodes_are_fetching_is_not_counted_as_room():
    """node b copies OTHER for its replica: node a's complete copy of it serves b, so it is not evictable."""
    holder = disk_node("a", 3 * GB, copy(OTHER, 2 * GB, complete=True), sources=(OTHER,))
    fetching = disk_node("b", 0, copy(OTHER, GB))
    running = Replica("old-0", "old", 0, [Shard(0, "b", (0,), 20000)])
    result = schedule([holder, fetching], CHAT_AND_OLD, [running], sizes=SIZES)
    assert "old-0" in {r.id for r in result.placements}
    assert "chat-0" not in {r.id for r in result.placements}, "a's copy of OTHER serves b's copy"


def test_room_is_shared_by_replicas_placed_in_one_run():
    """10 GB free: two different 4.2 GB models cannot both be copied there with 1 GB of room left over."""
    sizes = {SEED: 4_200_000_000, OTHER: 5 * GB}
    result = schedule([disk_node("a", 9 * GB)], CHAT_AND_OLD, [], sizes=sizes)
    assert len(result.placements) == 1 and len(result.unplaced) == 1
    # two replicas of the same model on one node share one copy
    two = schedule([disk_node("a", 5 * GB)], chat(2), [], sizes=SIZES)
    assert len(two.placements) == 2


def test_a_copy_under_way_keeps_its_room():
    """A replica staging 4.2 GB (1 GB present) holds the 3.2 GB it still needs: a second model finds none."""
    view = disk_node("a", 4 * GB, copy(SEED, GB))
    staging = Replica("chat-0", "chat", 0, [Shard(0, "a", (0,), 20000)])
    result = schedule([view], CHAT_AND_OLD, [staging], sizes=SIZES)
    [unplaced] = result.unplaced
    assert unplaced.model == "old"
    assert "a (4.0 GB free, 3.2 GB promised to copies under way)" in unplaced.reason, unplaced.reason


def test_a_copy_placed_before_its_size_was_known_leaves_a_node_without_room():
    """Placed with no manifest yet, chat-0 copies to a node with 1 GB free: once the size is known it is
    removed with the reason, and placed on a node with room; a copy with room keeps its place."""
    staging = Replica("chat-0", "chat", 0, [Shard(0, "a", (0,), 20000)])
    nodes = [disk_node("a", GB, copy(SEED, 100_000_000)), disk_node("b", 10 * GB)]
    result = schedule(nodes, chat(1), [staging], sizes=SIZES)
    [removal] = result.removed
    assert removal.reason == "node a has no disk room for the 4.2 GB copy of seed:///data/chat (1.0 GB free)"
    assert nodes_of(result) == ["b"]
    roomy = [disk_node("a", 4_150_000_000, copy(SEED, 100_000_000))]
    assert schedule(roomy, chat(1), [staging], sizes=SIZES).placements == (staging,)


def test_a_rollout_s_new_copy_never_pushes_out_a_copy_under_way():
    """node a: 'zeta' copies 2 GB (none present); 'chat' runs an old path and the catalog asks for SEED
    (4.2 GB): zeta's copy keeps its place though both cannot fit; the rollout's copy waits for room."""
    catalog = Catalog(
        profiles=PROFILE,
        models={
            "chat": Model(source=SEED, profile="one", replicas=1),
            "zeta": Model(source=OTHER, profile="one", replicas=1),
        },
    )
    view = disk_node("a", 3 * GB, sources=("/models/old",))
    running = Replica("chat-0", "chat", 0, [Shard(0, "a", (0,), 20000)])
    staging = Replica("zeta-0", "zeta", 0, [Shard(0, "a", (1,), 20001)])
    old = Model(source="/models/old", profile="one")
    result = schedule(
        [view], catalog, [running, staging], sizes=SIZES, launches={"chat-0": (old, PROFILE["one"])}
    )
    assert not result.removed and {r.id for r in result.placements} == {"chat-0", "zeta-0"}


SQL = "seed:///adapters/sql"
LEGAL = "hf://acme/legal-lora"
WITH_ADAPTERS = {**SIZES, SQL: 300_000_000, LEGAL: 500_000_000}


def chat_with_adapters(replicas: int) -> Catalog:
    adapters = {"sql": SQL, "legal": LEGAL, "local": "/adapters/local"}
    model = Model(source=SEED, profile="one", replicas=replicas, adapters=adapters)
    return Catalog(profiles=PROFILE, models={"chat": model})


def test_adapter_bytes_count_with_the_weights():
    """Every node running chat stages its distributable adapters (0.8 GB) with its weights (4.2 GB): room
    for the weights alone is not enough, and the reason names both; a local adapter takes nothing."""
    tight = int(SIZES[SEED] * 1.05) + 100
    result = schedule([disk_node("a", tight)], chat_with_adapters(1), [], sizes=WITH_ADAPTERS)
    assert not result.placements
    [unplaced] = result.unplaced
    assert "no disk room for chat's 4.2 GB of weights and 800 MB of LoRA adapters (+5% headroom)" in (
        unplaced.reason
    ), unplaced.reason
    enough = int((SIZES[SEED] + 800_000_000) * 1.05) + 100
    assert schedule([disk_node("a", enough)], chat_with_adapters(1), [], sizes=WITH_ADAPTERS).placements


def test_adapter_copies_in_use_are_not_counted_as_room():
    """A running replica's adapter copies are pinned: a second model cannot count them as evictable."""
    running = Replica("chat-0", "chat", 0, [Shard(0, "a", (0,), 20000)])
    catalog = attrs.evolve(
        chat_with_adapters(1),
        models={**chat_with_adapters(1).models, "old": Model(source=OTHER, profile="one", replicas=1)},
    )
    held = (
        copy(SEED, SIZES[SEED], complete=True),
        ModelCopy("b" * 64, SQL, 300_000_000, 300_000_000, True, 0.0),
        ModelCopy("c" * 64, LEGAL, 500_000_000, 500_000_000, True, 0.0),
    )
    node = disk_node("a", int(SIZES[OTHER] * 1.05) - 400_000_000, *held, sources=(SEED,))
    result = schedule([node], catalog, [running], sizes=WITH_ADAPTERS)
    assert [r.model for r in result.placements] == ["chat"], result.unplaced
