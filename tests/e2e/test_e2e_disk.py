"""End to end: a node without disk room for a model's copy is never chosen, and ``ctl replicas`` says why.

Real ``llmgw server`` and ``llmgw agent`` processes; node-3's models
directory is a 16 MB tmpfs (a real filesystem that is really full for a
24 MB model, as ``statvfs`` reports it). Needs root for the mount, as CI has.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from llmgw.dev.cluster import LocalCluster
from llmgw.testing.processes import free_port
from llmgw.testing.require import REQUIRE_ROOT, require
from llmgw.wire import EventList, ModelList

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _root() -> None:
    """Skipped when not root, failed in CI (``LLMGW_REQUIRE_ROOT=1``)."""
    require(os.geteuid() == 0, REQUIRE_ROOT, "mounting node-3's small models filesystem needs root")


CATALOG = """
profiles:
  whole:
    engine: sim
    gpus_per_node: 8
models:
  seeded:
    source: seed:///data/seeded
    profile: whole
    replicas: {replicas}
"""


@pytest.fixture
def cluster(tmp_path: Path):
    """Server and 3 agents (uploads at 6 MB/s, so a copy takes seconds); 24 MB seeded on node-1, node-3's
    models directory on a 16 MB tmpfs."""
    local = LocalCluster(tmp_path / "cluster", server_port=free_port(), lost_after=8, poll_timeout=1)
    local.agent_args = ["--bandwidth-limit", "6"]
    small = local.add_node(3).models_dir
    small.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(small)], check=True)
    try:
        files = {f"model-{index}.safetensors": 12_000_000 for index in range(2)}
        local.add_node(1).seed("data/seeded", files)
        local.start(3)
        yield local
    finally:
        local.stop_all()
        subprocess.run(["umount", str(small)], check=False)


def test_a_node_without_disk_room_is_never_chosen_and_ctl_replicas_says_why(cluster):
    """One replica per node: node-1 holds the seed, node-2 stages a copy (shown as staging with progress),
    node-3 (16 MB free) never gets one; the third replica is unplaced, node-3's free bytes in the reason."""
    cluster.apply(CATALOG.format(replicas=1))
    cluster.wait(lambda: len(cluster.replicas().replicas) == 1 and cluster.all_ready(), "seeded-0 ready", 60)

    def size() -> int | None:
        return cluster.client.request("GET", "/v1/admin/models", ModelList).models[0].size

    assert cluster.wait(size, "the seed's manifest", 30) == 24_000_000
    cluster.apply(CATALOG.format(replicas=3))
    staging = []

    def copied() -> bool:
        replicas = cluster.replicas().replicas
        staging.extend(r for r in replicas if r.state == "staging" and r.staging is not None)
        return len(replicas) == 2 and all(r.state == "ready" for r in replicas)

    cluster.wait(copied, "node-2's copy made and its replica ready", 60)
    assert staging, "the replica copying its weights should show staging with its progress"
    assert staging[0].shards[0].node == "node-2" and 0 < staging[0].staging.bytes_total == 24_000_000
    nodes = sorted(s.node for r in cluster.replicas().replicas for s in r.shards)
    assert nodes == ["node-1", "node-2"]

    shown = cluster.ctl("replicas")
    assert shown.returncode == 0, shown.stderr
    unplaced = next(line for line in shown.stdout.splitlines() if line.startswith("unplaced: seeded-2"))
    assert "1 node has no disk room for seeded's 24 MB of weights (+5% headroom): node-3 (" in unplaced
    free = int(unplaced.split("node-3 (")[1].split(" MB free")[0])
    assert 15 <= free <= 17, unplaced
    events = cluster.client.request("GET", "/v1/admin/events", EventList).events
    assert not any("on node-3 (r0" in e.message for e in events), "node-3 should never be chosen"
    assert any("no disk room" in e.message and "node-3" in e.message for e in events), "an event says why"

    models = cluster.ctl("models")
    assert models.returncode == 0, models.stderr
    row = next(line for line in models.stdout.splitlines() if line.startswith("seeded"))
    assert "24 MB" in row and "node-1, node-2" in row, row


ROLLING = """
profiles:
  whole:
    engine: sim
    gpus_per_node: 8
models:
  chat:
    source: seed:///data/{version}
    profile: whole
    replicas: 2
    rollout: {{max_surge: 0, max_unavailable: 1}}
"""


def test_rollouts_stage_the_new_weights_first_and_unused_copies_are_evicted_lru(tmp_path: Path):
    """node-2's models dir is a 30 MB tmpfs. Rolling v1 -> v2 (12 MB each): node-2 copies v2 while both
    replicas serve, and its replica restarts only once the copy is there (never staging). Rolling v2 -> v3:
    node-2 needs room, so its agent evicts the unused v1 copy, never v2, which its replica runs."""
    local = LocalCluster(tmp_path / "cluster", server_port=free_port(), lost_after=8, poll_timeout=1)
    small = local.add_node(2).models_dir
    small.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=30m", "tmpfs", str(small)], check=True)
    try:
        node1 = local.add_node(1)
        for version in ("v1", "v2", "v3"):
            node1.seed(f"data/{version}", {"model.safetensors": 12_000_000})
        local.start(2)
        local.apply(ROLLING.format(version="v1"))
        local.wait(lambda: len(local.replicas().replicas) == 2 and local.all_ready(), "2 replicas on v1", 60)
        on_2 = next(r.id for r in local.replicas().replicas if r.shards[0].node == "node-2")

        seen: list[tuple[str, str]] = []  # (rollout state, node-2's replica state) at each look

        def rolled(version: str):
            def done() -> bool:
                data = local.replicas()
                assert any(r.state == "ready" for r in data.replicas), "a replica should serve throughout"
                rollout = next(r for r in data.rollouts if r.model == "chat")
                mine = next(r for r in data.replicas if r.id == on_2)
                seen.append((rollout.state, mine.state))
                return rollout.state == "done" and all(
                    r.state == "ready" and not r.outdated for r in data.replicas
                )

            return done

        local.apply(ROLLING.format(version="v2"))
        local.wait(rolled("v2"), "the rollout to v2", 60)
        assert ("staging", "ready") in seen, "node-2 copies v2 while its replica still serves v1"
        assert not any(state == "staging" for _, state in seen), "its replica never waits for a copy"

        local.apply(ROLLING.format(version="v3"))
        local.wait(rolled("v3"), "the rollout to v3", 60)
        events = local.client.request("GET", "/v1/admin/events", EventList).events
        evicted = [e.message for e in events if "evicted from node-2" in e.message]
        assert len(evicted) == 1 and evicted[0].startswith("seed:///data/v1: "), evicted
        assert "to make room for seed:///data/v3" in evicted[0]
        kept = {p.name for p in small.iterdir() if not p.name.startswith(".")}
        assert len(kept) == 2, "v2 (in use when v3 was copied) and v3 stay; v1 was evicted"
    finally:
        local.stop_all()
        subprocess.run(["umount", str(small)], check=False)
