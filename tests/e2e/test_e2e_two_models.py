"""A two-node and a single-node model under 32 clients through the gateway: no change loses a request.

One cluster, one load, the changes an operator makes in turn: drain the node of the two-node replica's
rank 0, then the node of its rank 1; roll both models to new args; remove a model (refused without
``--prune``, then pruned).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmgw.dev.cluster import LocalCluster
from llmgw.testing.catalogs import LOAD_SIM, catalog_yaml, model, sim_profile
from llmgw.testing.load import GatewayLoad, gateway_models, routed_cluster
from llmgw.testing.processes import pid_alive
from llmgw.wire import ReplicaStatus

NEW_ARGS = (*LOAD_SIM, "--max-model-len", "4096")

pytestmark = pytest.mark.timeout(600)


def catalog(*args: str, chat: bool = True) -> str:
    """``big`` on two nodes and, with ``chat``, two replicas of ``chat``; every sim started with ``args``."""
    models = {"big": model("{models}/big", "tp2")}
    if chat:
        models["chat"] = model("{models}/chat", replicas=2)
    return catalog_yaml(models, tp2=sim_profile(2, *args, nodes=2, stop_grace=15), one=sim_profile(1, *args))


@pytest.fixture
def cluster(tmp_path: Path):
    """Server, 4 agents on one fabric and a gateway; a two-node replica and two single-node ones routed."""
    with routed_cluster(tmp_path, catalog(*LOAD_SIM), nodes=4, fabric="ib-a") as local:
        yield local


def replicas_of(cluster: LocalCluster, model: str) -> list[ReplicaStatus]:
    return [r for r in cluster.replicas().replicas if r.model == model]


def settled(cluster: LocalCluster, count: int) -> bool:
    """``count`` replicas, all ready, none replacing another, outdated, or unplaced."""
    data = cluster.replicas()
    return (
        len(data.replicas) == count
        and cluster.all_ready()
        and not any(r.replaces or r.outdated for r in data.replicas)
    )


def test_drains_rollout_and_prune_under_load_fail_no_request(cluster, tmp_path):
    """32 clients (16 per model, half streaming) through every step; not one request fails."""
    models = tmp_path / "models"
    with GatewayLoad(cluster.gateway_url, 32, models=["big", "chat"]) as load:
        load.wait_served(64, check=cluster.check)

        # (b) drain the node holding rank 0 of the two-node replica, then the node holding its rank 1
        for rank in (0, 1):
            [big] = replicas_of(cluster, "big")
            node = big.shards[rank].node
            drained = cluster.ctl("drain", node, "--timeout", "180")
            assert drained.returncode == 0, drained.stdout + drained.stderr
            cluster.wait(lambda: settled(cluster, 3), f"every replica ready after draining {node}", 60)
            [moved] = replicas_of(cluster, "big")
            assert moved.id != big.id and node not in {s.node for s in moved.shards}
            cluster.wait(
                lambda old=big: not any(pid_alive(s.pid) for s in old.shards),
                f"{big.id}'s shards to exit",
                60,
            )
            assert cluster.ctl("uncordon", node).returncode == 0
            load.wait_served(64, check=cluster.check)
        assert load.failures == [], load.report()

        # (a) new args for both profiles: every replica is replaced, every shard runs them
        before = {s.pid for r in cluster.replicas().replicas for s in r.shards}
        rolled = tmp_path / "rolled.yaml"
        rolled.write_text(catalog(*NEW_ARGS).format(models=models))
        applied = cluster.ctl("apply", "--wait", "--timeout", "240", str(rolled))
        assert applied.returncode == 0, applied.stdout + applied.stderr
        cluster.wait(lambda: settled(cluster, 3), "the rollouts to settle", 30)
        for replica in cluster.replicas().replicas:
            assert len(replica.shards) == (2 if replica.model == "big" else 1)
            for shard in replica.shards:
                assert "--max-model-len" in shard.argv and "4096" in shard.argv, (replica.id, shard.argv)
                assert shard.pid not in before, (replica.id, shard.rank)
        status = cluster.ctl("rollout", "status")
        rows = [line.split()[:3] for line in status.stdout.splitlines()]
        assert ["big", "done", "1/1"] in rows and ["chat", "done", "2/2"] in rows, status.stdout
        load.wait_served(64, check=cluster.check)
        assert load.failures == [], load.report()

        # (d) a catalog without chat: refused without --prune, nothing changes; with it chat's replicas stop
        without = tmp_path / "without-chat.yaml"
        without.write_text(catalog(*NEW_ARGS, chat=False).format(models=models))
        kept = {r.id: [s.pid for s in r.shards] for r in cluster.replicas().replicas}
        refused = cluster.ctl("apply", str(without))
        assert refused.returncode == 1, refused.stdout + refused.stderr
        assert "removes 1 model" in refused.stderr and "chat (2 replicas)" in refused.stderr, refused.stderr
        assert "nothing changed" in refused.stderr and "--prune" in refused.stderr, refused.stderr
        history = cluster.ctl("catalog", "history", "-o", "json")
        assert max(r["revision"] for r in json.loads(history.stdout)) == 2, history.stdout
        assert {r.id: [s.pid for s in r.shards] for r in cluster.replicas().replicas} == kept
        chat = replicas_of(cluster, "chat")
        load.stop_model("chat")  # requests in flight must still end well
        pruned = cluster.ctl("apply", "--prune", "--wait", "--timeout", "120", str(without))
        assert pruned.returncode == 0, pruned.stdout + pruned.stderr
        assert "- model chat: removed: 2 replicas to stop" in pruned.stdout, pruned.stdout
        cluster.wait(lambda: not replicas_of(cluster, "chat"), "chat's replicas to be gone", 30)
        cluster.wait(
            lambda: not any(pid_alive(s.pid) for r in chat for s in r.shards), "chat's engines to exit", 60
        )
        cluster.wait(lambda: gateway_models(cluster.gateway_url) == ["big"], "the gateway to drop chat", 30)
        served = load.served["big"]
        load.wait_served(32, check=cluster.check)
        assert load.served["big"] > served
    assert load.failures == [], load.report()
    assert load.served["chat"] > 0 and load.served["big"] > 0
