"""Placement of a model whose engine loads LoRA adapters only at start (llama.cpp): an adapter given as a
path must be on the node, as a model source given as a path must."""

from __future__ import annotations

from llmgw.models import Catalog, Model, Profile
from llmgw.scheduler import Replica, Shard, node_warnings, schedule
from tests.scheduler.test_scheduler import SOURCE, node

AT_START = Profile(engine="llamacpp", gpus_per_node=0, adapters_at_start=True)
RUN_TIME = Profile(engine="llamacpp", gpus_per_node=0)
ADAPTERS = {"sql": "seed:///adapters/sql", "chat": "/adapters/chat.gguf"}


def catalog(profile: Profile) -> Catalog:
    model = Model(source=SOURCE, profile="cpu", adapters=ADAPTERS)
    return Catalog(profiles={"cpu": profile}, models={"tiny": model})


def llama_node(node_id: str, *sources: str):
    return node(node_id, engines=("llamacpp",), sources=(SOURCE, *sources), gpus=0)


def test_a_node_without_an_adapter_path_is_never_chosen_and_says_so():
    """Only the node holding chat.gguf is chosen (the seed one is copied); the other names what it lacks,
    in the reason and in its warnings."""
    nodes = [llama_node("node-1"), llama_node("node-2", "/adapters/chat.gguf")]
    result = schedule(nodes, catalog(AT_START), [])
    assert [s.node_id for r in result.placements for s in r.shards] == ["node-2"]
    alone = schedule(nodes[:1], catalog(AT_START), [])
    [unplaced] = alone.unplaced
    assert "1 node lacks LoRA adapter chat (/adapters/chat.gguf): node-1" in unplaced.reason, unplaced.reason
    warnings = node_warnings(nodes[0], catalog(AT_START))
    assert warnings == (
        "LoRA adapter /adapters/chat.gguf missing (model tiny, whose engine loads its adapters at start)",
    )


def test_adapters_loaded_at_run_time_need_not_be_on_the_node():
    """On an engine loading adapters on demand, a missing adapter fails its load, not the placement."""
    result = schedule([llama_node("node-1")], catalog(RUN_TIME), [])
    assert len(result.placements) == 1


def test_a_placed_replica_on_a_node_that_lost_an_adapter_is_removed():
    """A replica placed where the adapter's path no longer is: removed, naming the adapter."""
    placed = Replica("tiny-0", "tiny", 0, [Shard(0, "node-1", (), 20000)])
    result = schedule([llama_node("node-1")], catalog(AT_START), [placed])
    [removal] = result.removed
    assert removal.reason == "node node-1 lacks LoRA adapter chat (/adapters/chat.gguf)"
