"""Rollouts on a real cluster under load through the gateway: new args reach every shard, a bad one pauses."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw.dev.cluster import LocalCluster
from llmgw.testing.catalogs import LOAD_SIM, catalog_yaml, model, sim_profile
from llmgw.testing.load import GatewayLoad, routed_cluster
from llmgw.wire import RolloutList

pytestmark = pytest.mark.timeout(300)


def with_args(*more_args: str) -> str:
    """Two replicas of ``chat`` on fast sims given ``more_args`` too."""
    return catalog_yaml(
        {"chat": model("{models}/chat", replicas=2)}, one=sim_profile(1, *LOAD_SIM, *more_args)
    )


@pytest.fixture
def cluster(tmp_path: Path):
    """Server, 3 agents and a gateway; a two-replica model ready and routed."""
    with routed_cluster(tmp_path, with_args(), nodes=3) as local:
        yield local


def rollout_of(cluster: LocalCluster, model: str = "chat"):
    return cluster.client.request("GET", "/v1/admin/rollouts", RolloutList, params={"model": model}).rollouts[
        0
    ]


def test_new_args_roll_every_replica_under_load(cluster, tmp_path):
    """16 clients (half streaming); a catalog changing the args: every shard runs them, no request fails."""
    ctl = cluster.ctl
    before = {r.id: r.shards[0].pid for r in cluster.replicas().replicas}
    catalog = tmp_path / "new.yaml"
    catalog.write_text(with_args("--max-model-len", "4096").format(models=tmp_path / "models"))
    with GatewayLoad(cluster.gateway_url, 16) as load:
        load.wait_served(32, check=cluster.check)
        applied = ctl("apply", "--wait", "--timeout", "150", str(catalog))
        assert applied.returncode == 0, applied.stdout + applied.stderr
        assert "1 outdated" in applied.stdout or "2 outdated" in applied.stdout, applied.stdout
        load.wait_served(32, check=cluster.check)
    assert load.failures == [], load.report()
    replicas = cluster.replicas().replicas
    assert len(replicas) == 2 and not any(r.outdated or r.replaces for r in replicas)
    for replica in replicas:
        for shard in replica.shards:
            assert "--max-model-len" in shard.argv and "4096" in shard.argv, (replica.id, shard.argv)
            assert shard.pid not in before.values()  # new processes, not the old ones told new args
    status = ctl("rollout", "status", "chat")
    assert status.returncode == 0 and "done" in status.stdout and "2/2" in status.stdout, status.stdout


def test_args_the_engine_rejects_pause_the_rollout_and_undo_restores(cluster, tmp_path):
    """An unknown flag: the replacements exit, the rollout pauses naming the flag, the old replicas serve
    throughout, and `ctl rollout undo` goes back to the previous revision; no request fails."""
    ctl = cluster.ctl
    original = {r.id: r.shards[0].pid for r in cluster.replicas().replicas}
    bad = with_args("--bogus-flag").format(models=tmp_path / "models")
    with GatewayLoad(cluster.gateway_url, 16) as load:
        load.wait_served(32, check=cluster.check)
        cluster.apply(bad, "bad.yaml")
        cluster.wait(lambda: rollout_of(cluster).state == "paused", "the rollout to pause", 120)
        status = ctl("rollout", "status")
        assert status.returncode == 0, status.stderr
        assert "paused" in status.stdout and "--bogus-flag" in status.stdout, status.stdout
        assert "exited with code 2" in status.stdout, status.stdout
        replicas = cluster.replicas()
        assert {r.id: r.shards[0].pid for r in replicas.replicas} == original  # the old ones serve on
        assert all(r.outdated and r.state == "ready" for r in replicas.replicas)
        load.wait_served(32, check=cluster.check)
        undone = ctl("rollout", "undo", "chat")
        assert undone.returncode == 0, undone.stdout + undone.stderr
        assert "re-applied catalog revision 1 as revision 3" in undone.stdout, undone.stdout
        cluster.wait(lambda: rollout_of(cluster).state == "done", "the rollout to be done after undo", 30)
        load.wait_served(32, check=cluster.check)
    assert load.failures == [], load.report()
    replicas = cluster.replicas().replicas
    assert {r.id: r.shards[0].pid for r in replicas} == original and not any(r.outdated for r in replicas)
    assert all("--bogus-flag" not in s.argv for r in replicas for s in r.shards)
    history = ctl("catalog", "history")
    assert "(ctl rollout undo chat)" in history.stdout, history.stdout
