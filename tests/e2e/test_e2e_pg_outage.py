"""PostgreSQL lost under a leader: it steps down saying why, the gateway serves on, a leader comes back."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from llmgw.dev.cluster import LocalCluster
from llmgw.testing.catalogs import CHAT_CATALOG
from llmgw.testing.load import GatewayLoad
from llmgw.testing.postgres import PostgresCluster, running_postgres
from llmgw.testing.processes import free_port
from llmgw.wire import CreateKey, KeyList
from llmgw.wire.servers import ControlServers

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def own_postgres() -> Iterator[PostgresCluster]:
    """A PostgreSQL cluster of this test's own (the session's is shared, and this one is crashed)."""
    with running_postgres("llmgw-pg-outage-") as cluster:
        yield cluster


def test_database_outage_under_a_leader(tmp_path: Path, own_postgres: PostgresCluster):
    """Kill PostgreSQL: the leader steps down naming the store error, 0 requests fail, 0 engines restart;
    start it again: a leader is elected with the next epoch and takes writes."""
    url = own_postgres.url(own_postgres.create_database())
    port_a, port_b = free_port(), free_port()
    local = LocalCluster(tmp_path / "cluster", server_port=port_a, lost_after=4, poll_timeout=1, store=url)
    local.server_url = f"https://127.0.0.1:{port_a},https://127.0.0.1:{port_b}"
    try:
        (tmp_path / "models" / "chat").mkdir(parents=True)
        local.start_server()
        local.wait(lambda: local.client.request("GET", "/v1/admin/keys", KeyList), "server A to lead")
        local.start_server(port=port_b, name="server-b")
        local.start_agent(local.add_node(1))
        local.start_gateway(free_port())
        local.apply(CHAT_CATALOG.format(models=tmp_path / "models"))
        local.wait(local.all_ready, "both replicas to be ready")
        before = {r.id: [s.pid for s in r.shards] for r in local.replicas().replicas}

        with GatewayLoad(local.gateway_url, 4) as load:
            local.wait(lambda: load.ok >= 16, "the load to get going", 60)
            own_postgres.crash()
            line = local.wait(
                lambda: next(
                    (x for x in local.tail("server", 200).splitlines() if "stepped down" in x), None
                ),
                "server A to step down",
                30,
            )
            served = load.ok
            local.wait(lambda: load.ok >= served + 16, "the gateway to serve with the database down", 60)
            own_postgres.restart()

            def leads_again() -> bool:
                servers = local.client.request("GET", "/v1/admin/servers", ControlServers).servers
                return any(s.role == "leader" and s.epoch == 2 for s in servers)

            local.wait(leads_again, "a server to lead again (epoch 2)", 60)
            # a write goes through (to the leader, once it loaded: meanwhile it answers 503 starting)
            local.wait(
                lambda: local.client.request("POST", "/v1/admin/keys", body=CreateKey("after-the-outage")),
                "a write to be taken",
                30,
            )

            local.wait(local.all_adopted, "the shards to be reported to the new leader", 60)
            served = load.ok
            local.wait(lambda: load.ok >= served + 16, "more requests after the outage", 60)
        assert load.failures == [], f"{len(load.failures)} failed of {load.ok + len(load.failures)}"
        assert "stepped down (epoch 1)" in line and "could not be renewed" in line, line
        assert "paused" not in line
        assert {r.id: [s.pid for s in r.shards] for r in local.replicas().replicas} == before, (
            "no engine restarted"
        )
        keys = local.client.request("GET", "/v1/admin/keys", KeyList).keys
        assert [k.name for k in keys] == ["after-the-outage"]
    finally:
        local.stop_all()
