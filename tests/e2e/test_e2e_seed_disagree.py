"""End to end: nodes whose seed folder is empty or holds other files never become holders of the source.

Real ``llmgw server`` and three ``llmgw agent`` processes: node-1 holds the
model's files, node-2 the same folder empty, node-3 the same folder with one
file of other content and one extra file. The fleet's manifest is node-1's;
node-2 is no copy at all; node-3 is named, with its differing files, in one
event and in ``ctl models``, and neither serves its folder to peers nor runs
an engine on it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from llmgw.dev.cluster import LocalCluster
from llmgw.testing.catalogs import catalog_yaml, model
from llmgw.testing.processes import free_port
from llmgw.weights import file_sha256
from llmgw.wire import EventList, ModelList, ModelStatus

pytestmark = pytest.mark.timeout(300)

FILES = {"weights.bin": 6_000_000, "config.json": 200}

CATALOG = catalog_yaml({"m": model("seed:///data/m", replicas=1)})


@pytest.fixture
def cluster(tmp_path: Path):
    """Server and the agents of node-1 (the files) and node-2 (an empty folder); node-3 (other files) is
    made but its agent not started: whichever complete folder reaches the server first is the fleet's
    manifest, so the test starts node-3 once node-1's is made."""
    local = LocalCluster(tmp_path / "cluster", server_port=free_port(), lost_after=8, poll_timeout=1)
    try:
        seeds = [local.add_node(index).seed_root / "data" / "m" for index in (1, 2, 3)]
        for seed in seeds:
            seed.mkdir(parents=True)
        for name, size in FILES.items():
            (seeds[0] / name).write_bytes(os.urandom(size))
        (seeds[2] / "config.json").write_bytes((seeds[0] / "config.json").read_bytes())
        (seeds[2] / "weights.bin").write_bytes(os.urandom(FILES["weights.bin"]))
        (seeds[2] / "extra.txt").write_bytes(b"not in the model\n")
        local.start(2)
        yield local
    finally:
        local.stop_all()


def m_status(cluster: LocalCluster) -> ModelStatus:
    [status] = cluster.client.request("GET", "/v1/admin/models", ModelList).models
    return status


def test_empty_and_different_seed_folders_are_not_holders(cluster):
    seed = cluster.nodes["node-1"].seed_root / "data" / "m"
    cluster.apply(CATALOG)
    cluster.wait(
        lambda: len(cluster.replicas().replicas) == 1 and cluster.all_ready(), "1 replica ready", 120
    )
    status = m_status(cluster)
    assert status.size == sum(FILES.values()), "the fleet's manifest is node-1's complete one"
    assert status.holders == ("node-1",), status
    cluster.start_agent(cluster.nodes["node-3"])
    cluster.wait(
        lambda: "node-3" in m_status(cluster).differing, "ctl models naming node-3's differing folder", 30
    )
    status = m_status(cluster)
    assert status.differing == ("node-3",), status
    [shard] = cluster.replicas().replicas[0].shards
    assert shard.node == "node-1"
    header, _, row = cluster.ctl("models").stdout.splitlines()
    assert header.split()[-1] == "differing" and row.split()[-1] == "node-3", (header, row)

    events = cluster.client.request("GET", "/v1/admin/events", EventList).events
    made = [
        e.message for e in events if e.kind == "weights" and "manifest of seed:///data/m made by" in e.message
    ]
    assert len(made) == 1 and "made by node-1" in made[0], made
    about3 = [e.message for e in events if "node-3" in e.message and "differ" in e.message]
    assert len(about3) == 1, about3
    assert "weights.bin" in about3[0] and "extra.txt" in about3[0] and "config.json" not in about3[0], about3
    assert not any("node-2" in e.message and e.kind == "weights" for e in events), (
        "an empty folder is no copy"
    )

    # every node runs a replica: node-2 and node-3 on verified copies of node-1's files, never their folders
    cluster.apply(catalog_yaml({"m": model("seed:///data/m", replicas=3)}))
    cluster.wait(
        lambda: len(cluster.replicas().replicas) == 3 and cluster.all_ready(), "3 replicas ready", 180
    )
    expected = {name: file_sha256(seed / name) for name in FILES}
    for node in ("node-2", "node-3"):
        [shard] = [s for r in cluster.replicas().replicas for s in r.shards if s.node == node]
        models_dir = cluster.nodes[node].models_dir
        [copy] = [p for p in models_dir.iterdir() if not p.name.startswith(".")]
        assert str(copy) in shard.argv, (node, shard.argv)
        assert {p.name: file_sha256(p) for p in copy.iterdir()} == expected, node
    status = m_status(cluster)
    assert status.holders == ("node-1", "node-2", "node-3") and status.differing == ("node-3",), status
