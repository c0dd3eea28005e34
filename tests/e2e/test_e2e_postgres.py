"""End to end with the state in PostgreSQL: ``llmgw server --store postgresql://...``, agents, sim engines."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from llmgw.dev.cluster import LocalCluster
from llmgw.testing.processes import free_port
from llmgw.wire import CatalogText, EventList

CATALOG = """
profiles:
  one:
    engine: sim
    gpus_per_node: 1
  tp4x2:
    engine: sim
    nodes: 2
    gpus_per_node: 4
models:
  small:
    source: {models}/small
    profile: one
    replicas: 2
  big:
    source: {models}/big
    profile: tp4x2
    replicas: 1
"""

pytestmark = pytest.mark.timeout(240)


def test_server_on_postgresql_killed_and_restarted_adopts_every_replica(tmp_path: Path, pg_url: str):
    """A server on PostgreSQL, killed -9 and restarted, keeps catalog and events and restarts no engine."""
    local = LocalCluster(
        tmp_path / "cluster", server_port=free_port(), lost_after=4, poll_timeout=1, store=pg_url
    )
    try:
        models = tmp_path / "models"
        for name in ("small", "big"):
            (models / name).mkdir(parents=True)
        local.start(2)
        local.apply(CATALOG.format(models=models))
        local.wait(local.all_ready, "every replica to be ready")
        assert "state in postgresql://" in local.tail("server", 200)
        before = {r.id: [s.pid for s in r.shards] for r in local.replicas().replicas}
        assert len(before) == 3

        local.stop(local.server, signal.SIGKILL)
        local.start_server()

        def adopted() -> bool:
            shards = [s for r in local.replicas().replicas for s in r.shards]
            return local.all_ready() and all(s.pid and s.state in ("ready", "running") for s in shards)

        local.wait(adopted, "every shard to be reported again after the restart", 60)
        after = {r.id: [s.pid for s in r.shards] for r in local.replicas().replicas}
        assert after == before, "no engine was restarted"
        assert "big:" in local.client.request("GET", "/v1/admin/catalog", CatalogText).text
        events = local.client.request("GET", "/v1/admin/events", EventList).events
        assert any(e.kind == "node" and e.subject == "node-1" for e in events)
    finally:
        local.stop_all()
