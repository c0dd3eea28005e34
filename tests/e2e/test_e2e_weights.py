"""End to end: a model seeded on one node is copied node to node, verified, served; corruption is caught.

Real ``llmgw server`` and ``llmgw agent`` processes on 127.0.0.x, each
simulated node with its own models directory and its own disk for seeds
(``--seed-root``), real node certificates and real TLS between the agents.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import pytest

from llmgw.dev.cluster import LocalCluster
from llmgw.testing.catalogs import catalog_yaml, model
from llmgw.testing.processes import free_port
from llmgw.weights import file_sha256
from llmgw.wire import EventList, ReplicaStatus

pytestmark = pytest.mark.timeout(300)

#: three files, 48 MB in all: large enough to take several progress reports, small for a 2-core machine
FILES = {"model-00001.safetensors": 24_000_000, "model-00002.safetensors": 24_000_000, "config.json": 300}

CATALOG = catalog_yaml({"seeded": model("seed:///data/seeded", replicas=3)})


@pytest.fixture
def cluster(tmp_path: Path):
    """Server, gateway and 3 agents; the model's files on node-1's disk only."""
    local = LocalCluster(tmp_path / "cluster", server_port=free_port(), lost_after=8, poll_timeout=1)
    try:
        local.add_node(1).seed("data/seeded", FILES)
        local.start(3)
        yield local
    finally:
        local.stop_all()


def replica(cluster: LocalCluster, replica_id: str) -> ReplicaStatus:
    return next(r for r in cluster.replicas().replicas if r.id == replica_id)


def copy_of(cluster: LocalCluster, node: str) -> Path:
    """The one copy in ``node``'s models directory."""
    [copy] = [p for p in cluster.nodes[node].models_dir.iterdir() if not p.name.startswith(".")]
    return copy


def test_seeded_model_is_copied_verified_and_served(cluster):
    """Replicas on nodes without the files wait in staging, get verified copies from peers, and serve."""
    seed = cluster.nodes["node-1"].seed_root / "data" / "seeded"
    cluster.apply(CATALOG)
    seen_staging: set[str] = set()

    def ready() -> bool:
        replicas = cluster.replicas().replicas
        for r in replicas:
            seen_staging.update(f"{s.node}: {s.detail}" for s in r.shards if s.state == "staging")
        return len(replicas) == 3 and cluster.all_ready()

    cluster.wait(ready, "3 replicas ready", 180)
    nodes = sorted(s.node for r in cluster.replicas().replicas for s in r.shards)
    assert nodes == ["node-1", "node-2", "node-3"]
    assert any("fetching" in line for line in seen_staging), seen_staging
    for node in ("node-2", "node-3"):
        copy = copy_of(cluster, node)
        assert {p.name: file_sha256(p) for p in copy.iterdir()} == {
            name: file_sha256(seed / name) for name in FILES
        }
        shard = next(s for r in cluster.replicas().replicas for s in r.shards if s.node == node)
        assert str(copy) in shard.argv, "the engine should be given the node's own copy"
    holder = next(s for r in cluster.replicas().replicas for s in r.shards if s.node == "node-1")
    assert str(seed) in holder.argv, "the seed's node runs on the seed itself"
    port = free_port()
    cluster.start_gateway(port)
    body = {"model": "seeded", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

    def answered() -> bool:
        try:
            return (
                httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=5).status_code
                == 200
            )
        except httpx.HTTPError:
            return False

    cluster.wait(answered, "a chat completion through the gateway", 30)
    events = cluster.client.request("GET", "/v1/admin/events", EventList).events
    assert any(e.kind == "weights" and "made by node-1" in e.message for e in events)

    # a flipped byte in node-2's copy: found before the next start there, that file fetched again
    on_node2 = next(r for r in cluster.replicas().replicas if r.shards[0].node == "node-2")
    target = copy_of(cluster, "node-2") / "model-00002.safetensors"
    good = file_sha256(target)
    with open(target, "r+b") as handle:
        handle.seek(12_345_678)
        byte = handle.read(1)
        handle.seek(12_345_678)
        handle.write(bytes([byte[0] ^ 0xFF]))
    assert file_sha256(target) != good
    os.kill(on_node2.shards[0].pid, signal.SIGKILL)
    cluster.wait(lambda: replica(cluster, on_node2.id).attempt != on_node2.attempt, "a rebuild on node-2", 30)
    cluster.wait(lambda: replica(cluster, on_node2.id).state == "ready", "the rebuilt replica ready", 120)
    assert file_sha256(target) == good
    events = cluster.client.request("GET", "/v1/admin/events", EventList).events
    assert any("model-00002.safetensors" in e.message and "failed verification" in e.message for e in events)


def test_a_holder_dying_mid_copy_leaves_the_copy_to_the_others(tmp_path: Path):
    """The third node copying from node-1 and the second holder (uploads at 10 MB/s) completes when node-1's
    agent dies."""
    local = LocalCluster(tmp_path / "cluster", server_port=free_port(), lost_after=8, poll_timeout=1)
    local.agent_args = ["--bandwidth-limit", "10"]
    try:
        seed = local.add_node(1).seed("data/seeded", {f"part-{index}.bin": 12_000_000 for index in range(4)})
        local.start(3)
        local.apply(catalog_yaml({"seeded": model("seed:///data/seeded", replicas=2)}))
        local.wait(lambda: len(local.replicas().replicas) == 2 and local.all_ready(), "2 replicas ready", 120)
        placed = {s.node for r in local.replicas().replicas for s in r.shards}
        assert "node-1" in placed, "the seed's holder runs a replica"
        [fetcher] = {"node-2", "node-3"} - placed
        local.apply(CATALOG)

        def fetching() -> bool:
            shards = [s for r in local.replicas().replicas for s in r.shards if s.node == fetcher]
            return any(s.state == "staging" and s.detail and "fetching" in s.detail for s in shards)

        local.wait(fetching, f"{fetcher} fetching", 60)
        local.stop(local.nodes["node-1"].process, signal.SIGKILL)
        local.wait(
            lambda: any(
                r.state == "ready" for r in local.replicas().replicas for s in r.shards if s.node == fetcher
            ),
            f"{fetcher}'s replica ready from the other holder's copy",
            180,
        )
        copy = copy_of(local, fetcher)
        assert {p.name: file_sha256(p) for p in copy.iterdir()} == {
            p.name: file_sha256(p) for p in seed.iterdir()
        }
    finally:
        local.stop_all()
