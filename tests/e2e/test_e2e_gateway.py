"""The gateway in front of a real cluster: clients keep being served through a drain."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw.dev.cluster import LocalCluster
from llmgw.testing.load import CHAT_CATALOG, GatewayLoad, gateway_models
from llmgw.testing.processes import free_port

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def cluster(tmp_path: Path):
    """Server, 3 agents and a gateway; a two-replica model ready and routed."""
    local = LocalCluster(tmp_path / "cluster", server_port=free_port(), lost_after=10, poll_timeout=1)
    try:
        (tmp_path / "models" / "chat").mkdir(parents=True)
        local.start(3)
        local.start_gateway(free_port())
        local.apply(CHAT_CATALOG.format(models=tmp_path / "models"))
        local.wait(local.all_ready, "both replicas to be ready")
        local.wait(lambda: gateway_models(local.gateway_url) == ["chat"], "the gateway to route the model")
        yield local
    finally:
        local.stop_all()


def test_drain_under_load_fails_no_request(cluster):
    """32 clients (half streaming) through the gateway for a whole drain: every request succeeds."""
    target = next(s.node for r in cluster.replicas().replicas for s in r.shards)
    with GatewayLoad(cluster.gateway_url, 32) as load:
        load.wait_served(64, check=cluster.check)
        cluster.client.request("POST", f"/v1/admin/nodes/{target}/drain")
        cluster.wait(
            lambda: not any(s.node == target for r in cluster.replicas().replicas for s in r.shards),
            f"{target} to be drained",
            120,
        )
        cluster.wait(cluster.all_ready, "every replica to be ready after the drain", 60)
        load.wait_served(64, check=cluster.check)
    assert load.failures == [], load.report()
    assert load.ok > 128
