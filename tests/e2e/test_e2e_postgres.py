"""End to end with the state in PostgreSQL: ``llmgw server --store postgresql://...``, agents, sim engines."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest

from llmgw.dev.cluster import LocalCluster, program
from llmgw.testing.load import SMALL_AND_BIG_CATALOG
from llmgw.testing.processes import free_port
from llmgw.wire import CatalogText, EventList

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
        local.apply(SMALL_AND_BIG_CATALOG.format(models=models))
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


def test_sqlite_cluster_migrated_to_postgresql_keeps_running(tmp_path: Path, pg_url: str):
    """`llmgw server migrate`: a sqlite server's state copied into PostgreSQL; the new server adopts all."""
    local = LocalCluster(tmp_path / "cluster", server_port=free_port(), lost_after=4, poll_timeout=1)
    try:
        models = tmp_path / "models"
        for name in ("small", "big"):
            (models / name).mkdir(parents=True)
        local.start(2)
        local.apply(SMALL_AND_BIG_CATALOG.format(models=models))
        local.wait(local.all_ready, "every replica to be ready")
        before = {r.id: [s.pid for s in r.shards] for r in local.replicas().replicas}
        events_before = local.client.request("GET", "/v1/admin/events", EventList).events
        local.stop(local.server)

        state = str(local.state_dir / "server")
        migrate = [program("llmgw"), "server", "migrate", "--from", state, "--to", pg_url]
        done = subprocess.run(migrate, capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0, done.stderr
        assert "copied" in done.stdout and "3 replicas" in done.stdout and "2 nodes" in done.stdout
        again = subprocess.run(migrate, capture_output=True, text=True, timeout=60, check=False)
        assert again.returncode == 1 and "already holds state (rows in " in again.stderr

        local.store = pg_url
        local.start_server()

        def adopted() -> bool:
            shards = [s for r in local.replicas().replicas for s in r.shards]
            return local.all_ready() and all(s.pid and s.state in ("ready", "running") for s in shards)

        local.wait(adopted, "every shard to be reported to the server on PostgreSQL", 60)
        assert {r.id: [s.pid for s in r.shards] for r in local.replicas().replicas} == before
        events = local.client.request("GET", "/v1/admin/events", EventList).events
        ids = [e.id for e in events]
        assert {e.id for e in events_before} <= set(ids), "the events were copied with their ids"
        assert any(e.kind == "leader" and e.id > max(ids[:-1]) for e in events), "new ids go on after them"
    finally:
        local.stop_all()
