"""End to end with the state in PostgreSQL: ``llmgw server --store postgresql://...``, agents, sim engines."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest

from llmgw.dev.cluster import program
from llmgw.testing.catalogs import SMALL_AND_BIG_CATALOG
from llmgw.testing.load import ready_cluster
from llmgw.wire import CatalogText, EventList

pytestmark = pytest.mark.timeout(240)


def test_server_on_postgresql_killed_and_restarted_adopts_every_replica(tmp_path: Path, pg_url: str):
    """A server on PostgreSQL, killed -9 and restarted, keeps catalog and events and restarts no engine."""
    with ready_cluster(tmp_path, SMALL_AND_BIG_CATALOG, lost_after=4, store=pg_url) as local:
        assert "state in postgresql://" in local.tail("server", 200)
        before = {r.id: [s.pid for s in r.shards] for r in local.replicas().replicas}
        assert len(before) == 3

        local.stop(local.server, signal.SIGKILL)
        local.start_server()

        local.wait(local.all_adopted, "every shard to be reported again after the restart", 60)
        after = {r.id: [s.pid for s in r.shards] for r in local.replicas().replicas}
        assert after == before, "no engine was restarted"
        assert "big:" in local.client.request("GET", "/v1/admin/catalog", CatalogText).text
        events = local.client.request("GET", "/v1/admin/events", EventList).events
        assert any(e.kind == "node" and e.subject == "node-1" for e in events)


def test_sqlite_cluster_migrated_to_postgresql_keeps_running(tmp_path: Path, pg_url: str):
    """`llmgw server migrate`: a sqlite server's state copied into PostgreSQL; the new server adopts all."""
    with ready_cluster(tmp_path, SMALL_AND_BIG_CATALOG, lost_after=4) as local:
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

        local.wait(local.all_adopted, "every shard to be reported to the server on PostgreSQL", 60)
        assert {r.id: [s.pid for s in r.shards] for r in local.replicas().replicas} == before
        events = local.client.request("GET", "/v1/admin/events", EventList).events
        ids = [e.id for e in events]
        assert {e.id for e in events_before} <= set(ids), "the events were copied with their ids"
        assert any(e.kind == "leader" and e.id > max(ids[:-1]) for e in events), "new ids go on after them"
