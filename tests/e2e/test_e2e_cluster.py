"""End to end across real processes: ``llmgw server``, ``llmgw agent`` on 127.0.0.x, sim engines.

Each test gets its own :class:`LocalCluster` on a free port and stops every
process group it started, also when it fails.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from llmgw.dev.cluster import LocalCluster, program
from llmgw.testing.catalogs import SMALL_AND_BIG_CATALOG
from llmgw.testing.load import ready_cluster
from llmgw.testing.processes import pid_alive
from llmgw.wire import CatalogText, EventList, NodeList, ReplicaStatus

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def cluster(tmp_path: Path):
    """Server and 4 agents (nodes 1-2 on ib-a, 3 on ib-b, 4 an island), catalog applied and ready."""
    with ready_cluster(tmp_path, SMALL_AND_BIG_CATALOG, nodes=4, lost_after=4) as local:
        yield local


def replica(cluster: LocalCluster, replica_id: str) -> ReplicaStatus:
    return next(r for r in cluster.replicas().replicas if r.id == replica_id)


def pids(cluster: LocalCluster, replica_id: str) -> list[int]:
    return [s.pid for s in replica(cluster, replica_id).shards]


def test_two_node_replica_is_on_one_fabric(cluster):
    """The two shards of the two-node replica run on two nodes of one fabric, never the island."""
    big = replica(cluster, "big-0")
    nodes = [s.node for s in big.shards]
    assert sorted(nodes) == ["node-1", "node-2"]
    assert big.fabric == "ib-a"
    assert all(s.state in ("ready", "running") for s in big.shards)
    small_nodes = {s.node for r in cluster.replicas().replicas if r.model == "small" for s in r.shards}
    assert len(small_nodes) == 2, "the two replicas of one model should be on two nodes"


def test_killing_one_shard_rebuilds_the_whole_replica(cluster):
    """Killing a worker shard gets every shard of the replica replaced, and the replica ready again."""
    before = replica(cluster, "big-0")
    old_pids = pids(cluster, "big-0")
    os.kill(old_pids[1], signal.SIGKILL)
    cluster.wait(lambda: replica(cluster, "big-0").failures >= 1, "the replica's failure to be noticed", 30)
    cluster.wait(lambda: replica(cluster, "big-0").state == "ready", "the replica to be ready again", 60)
    after = replica(cluster, "big-0")
    assert after.attempt != before.attempt
    new_pids = pids(cluster, "big-0")
    assert not set(new_pids) & set(old_pids), "a shard of the failed attempt was kept"
    assert not any(pid_alive(pid) for pid in old_pids), "a shard of the failed attempt is still running"
    events = cluster.client.request("GET", "/v1/admin/events", EventList).events
    assert any(e.subject == "big-0" and "failed" in e.message for e in events)


def test_server_restart_adopts_running_replicas(cluster):
    """A server killed, down longer than ``lost_after`` and restarted keeps the catalog and adopts running
    replicas without restarting them. Agents retrying while it was down (their delay grows towards
    ``--backoff-max``, 5 s, beyond ``lost_after``, 4 s) try again within a quarter of ``lost_after``: every
    node syncs before the server could think it silent, so no silence episode starts at all."""
    before = {r.id: pids(cluster, r.id) for r in cluster.replicas().replicas}
    cluster.stop(cluster.server, signal.SIGKILL)
    time.sleep(8)  # the outage itself: long enough for the agents' retry delay to reach its ceiling
    cluster.start_server()

    cluster.wait(cluster.all_adopted, "every shard to be reported again after the restart", 60)
    after = {r.id: pids(cluster, r.id) for r in cluster.replicas().replicas}
    events = cluster.client.request("GET", "/v1/admin/events", EventList).events
    said = "\n".join(f"{e.kind} {e.subject}: {e.message}" for e in events[-30:])
    assert after == before, f"replicas restarted; the last events:\n{said}"
    silent = [e.message for e in events if "stopped syncing" in e.message]
    assert not silent, f"nodes slept through the server's return: {silent}"
    catalog = cluster.client.request("GET", "/v1/admin/catalog", CatalogText)
    assert "big:" in catalog.text


def test_lost_node_replicas_come_back_elsewhere(cluster):
    """A node whose agent stops syncing is declared lost and its replicas are ready elsewhere."""
    by_model: dict[str, set[str]] = {}
    for r in cluster.replicas().replicas:
        by_model.setdefault(r.model, set()).update(s.node for s in r.shards)
    # the two-node replica has no second ib-a pair to go to: lose a node it is not on
    victim = cluster.nodes[sorted(by_model["small"] - by_model["big"])[0]]
    os.kill(victim.process.pid, signal.SIGSTOP)
    try:
        cluster.wait(
            lambda: any(
                n.node_id == victim.node_id and n.state == "lost"
                for n in cluster.client.request("GET", "/v1/admin/nodes", NodeList).nodes
            ),
            f"{victim.node_id} to be declared lost",
            30,
        )
        cluster.wait(
            lambda: (
                cluster.all_ready()
                and not any(s.node == victim.node_id for r in cluster.replicas().replicas for s in r.shards)
            ),
            "every replica ready away from the lost node",
            60,
        )
    finally:
        os.kill(victim.process.pid, signal.SIGCONT)


def test_agent_killed_leaves_its_engine_to_the_next_agent(cluster):
    """An agent killed with SIGKILL leaves its engine running (for --orphan-grace). Here the new agent comes
    back after `lost_after` (4 s): the node was lost and its replica placed again, so the new agent adopts
    the old engine only to stop it (the server no longer wants it), and runs the new attempt: every replica
    ready, no engine left that no replica owns. (test_e2e_agent_restart: an agent back in time restarts
    nothing.)"""
    node = cluster.nodes["node-4"]
    on_node = [r for r in cluster.replicas().replicas if any(s.node == "node-4" for s in r.shards)]
    assert on_node, "the island should hold a single-node replica"
    shard = on_node[0].shards[0]
    cluster.stop(node.process, signal.SIGKILL)
    assert pid_alive(shard.pid), "the engine ended with its agent"
    cluster.wait(
        lambda: any(
            n.node_id == "node-4" and n.state == "lost"
            for n in cluster.client.request("GET", "/v1/admin/nodes", NodeList).nodes
        ),
        "node-4 to be declared lost while its agent is gone",
        30,
    )
    assert pid_alive(shard.pid), "the engine should outlive its agent while the node is lost"
    cluster.start_agent(node)
    cluster.wait(lambda: not pid_alive(shard.pid), "the engine no replica owns to be stopped", 90)
    cluster.wait(cluster.all_ready, "every replica to be ready again", 60)


def test_drain_moves_everything_without_losing_ready_replicas(cluster):
    """Draining a node moves all its replicas, and no model ever has fewer ready replicas than before."""

    def ready_counts() -> dict[str, int]:
        counts: dict[str, int] = {}
        for r in cluster.replicas().replicas:
            if r.state == "ready":
                counts[r.model] = counts.get(r.model, 0) + 1
        return counts

    by_model: dict[str, set[str]] = {}
    for r in cluster.replicas().replicas:
        by_model.setdefault(r.model, set()).update(s.node for s in r.shards)
    # the two-node replica has nowhere else to go (one ib-a pair), so drain a node it is not on
    target = sorted(by_model["small"] - by_model["big"])[0]
    baseline = ready_counts()
    cluster.client.request("POST", f"/v1/admin/nodes/{target}/drain")
    lowest = dict(baseline)

    def drained() -> bool:
        counts = ready_counts()
        for model, count in counts.items():
            lowest[model] = min(lowest.get(model, count), count)
        for model in baseline:
            lowest[model] = min(lowest[model], counts.get(model, 0))
        return not any(s.node == target for r in cluster.replicas().replicas for s in r.shards)

    cluster.wait(drained, f"{target} to be drained", 90)
    assert lowest == baseline, f"ready replicas dipped during the drain: {lowest} < {baseline}"
    cluster.wait(cluster.all_ready, "every replica to be ready after the drain", 60)


def test_ctl_against_the_running_cluster(cluster, tmp_path):
    """`llmgw ctl` with a config dir: nodes, replicas -o json, events, cordon, uncordon, apply errors."""
    import json
    import subprocess

    from llmgw.ctl.client import write_client_config

    config = tmp_path / "ctl"
    tls = cluster.admin_tls
    write_client_config(config, cluster.server_url, tls.ca_path, tls.cert_path, tls.key_path)
    exe = program("llmgw")

    def ctl(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [exe, "ctl", "--config-dir", str(config), *args], capture_output=True, text=True, timeout=60
        )

    nodes = ctl("nodes")
    assert nodes.returncode == 0, nodes.stderr
    assert "node-4" in nodes.stdout and "island" in nodes.stdout and "ib-a" in nodes.stdout
    shards = [s for r in json.loads(ctl("replicas", "-o", "json").stdout)["replicas"] for s in r["shards"]]
    assert all({"node", "rank", "state", "port", "pid"} <= set(s) for s in shards) and len(shards) == 4
    assert ctl("cordon", "node-3").stdout.strip() == "node-3: cordoned"
    assert any(
        n["node_id"] == "node-3" and n["state"] == "cordoned"
        for n in json.loads(ctl("nodes", "-o", "json").stdout)
    )
    assert ctl("uncordon", "node-3").stdout.strip() == "node-3: ready"
    assert "cordoned" in ctl("events").stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("models:\n  x:\n    source: /m\n    profile: nope\n")
    applied = ctl("apply", str(bad))
    assert applied.returncode == 1
    assert "models.x.profile: no profile named 'nope'" in applied.stderr
    assert cluster.client.request("GET", "/v1/admin/catalog", CatalogText).revision == 1, (
        "a bad catalog changed the state"
    )
    by_model: dict[str, set[str]] = {}
    for r in json.loads(ctl("replicas", "-o", "json").stdout)["replicas"]:
        by_model.setdefault(r["model"], set()).update(s["node"] for s in r["shards"])
    target = sorted(by_model["small"] - by_model["big"])[0]
    drained = ctl("drain", target)
    assert drained.returncode == 0, drained.stderr
    last = drained.stdout.splitlines()[-1]
    assert last == f"{target}: drained; it stays cordoned until `llmgw ctl uncordon {target}`"
