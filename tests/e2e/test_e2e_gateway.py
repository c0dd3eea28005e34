"""The gateway in front of a real cluster: clients keep being served through a drain."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw.testing.catalogs import LOAD_SIM, catalog_yaml, model, sim_profile
from llmgw.testing.load import GatewayLoad, routed_cluster

pytestmark = pytest.mark.timeout(240)

#: two replicas of ``chat`` on sims paced for a load (``LOAD_SIM``)
CATALOG = catalog_yaml({"chat": model("{models}/chat", replicas=2)}, one=sim_profile(1, *LOAD_SIM))


@pytest.fixture
def cluster(tmp_path: Path):
    """Server, 3 agents and a gateway; a two-replica model ready and routed."""
    with routed_cluster(tmp_path, CATALOG, nodes=3) as local:
        yield local


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
