"""Two servers on PostgreSQL as ``ctl`` sees them: a replaced instance, and the store down under both."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from llmgw.dev.cluster import LocalCluster
from llmgw.testing.postgres import PostgresCluster
from llmgw.testing.processes import free_port
from llmgw.wire import CreateKey, KeyList
from tests.e2e.test_e2e_leader import admin, role
from tests.e2e.test_e2e_pg_outage import own_postgres  # noqa: F401 - a fixture

pytestmark = pytest.mark.timeout(360)


def two_servers(root: Path, url: str) -> tuple[LocalCluster, str, str]:
    """Server A (leads: started first, :attr:`LocalCluster.server`) and B (a standby) on ``url``; ``ctl``
    knows both, B first. Returns the cluster and the two URLs."""
    port_a, port_b = free_port(), free_port()
    local = LocalCluster(root, server_port=port_a, store=url)
    url_a, url_b = f"https://127.0.0.1:{port_a}", f"https://127.0.0.1:{port_b}"
    local.server_url = f"{url_b},{url_a}"
    local.start_server()
    with admin(local, port_a) as a:
        local.wait(lambda: role(a) == "leader", "server A to lead")
    local.start_server(port=port_b, name="server-b")
    with admin(local, port_b) as b:
        local.wait(lambda: role(b) == "standby", "server B to answer as a standby")
    return local, url_a, url_b


def listed(local: LocalCluster) -> list[tuple[str, str]]:
    """``ctl servers -o json``: (address, role) of each server listed."""
    done = local.ctl("servers", "-o", "json", timeout=60)
    assert done.returncode == 0, done.stderr
    return [(s["address"], s["role"]) for s in json.loads(done.stdout)["servers"]]


def test_a_server_killed_and_started_again_at_its_address_is_listed_once(tmp_path: Path, pg_url: str):
    """kill -9 of the standby, then of the leader, each started again at its address: as soon as the new
    instance answers, `ctl servers` lists one server per address (not the dead instance beside it)."""
    local, url_a, url_b = two_servers(tmp_path / "cluster", pg_url)
    port_a, port_b = (int(u.rsplit(":", 1)[1]) for u in (url_a, url_b))
    try:
        assert sorted(listed(local)) == sorted([(url_a, "leader"), (url_b, "standby")])
        server_b = next(p for name, p in local._processes if name == "server-b")
        local.stop(server_b, signal.SIGKILL)
        local.start_server(port=port_b, name="server-b-again")
        with admin(local, port_b) as b:
            local.wait(lambda: role(b) == "standby", "server B's new instance to answer as a standby")
        assert sorted(listed(local)) == sorted([(url_a, "leader"), (url_b, "standby")])

        local.stop(local.server, signal.SIGKILL)
        local.start_server(port=port_a, name="server-a-again")
        with admin(local, port_a) as a:
            local.wait(lambda: role(a) is not None, "server A's new instance to answer")
        addresses = [address for address, _ in listed(local)]
        assert sorted(addresses) == sorted([url_a, url_b]), addresses
    finally:
        local.stop_all()


def test_ctl_during_a_store_outage_says_so_and_reads_the_last_loaded_state(
    tmp_path: Path,
    own_postgres: PostgresCluster,  # noqa: F811
):
    """PostgreSQL killed under a leader and a standby: a read is answered from the standby's last loaded
    state with a note naming the store and the view's age; a write and `ctl servers` fail saying the store
    is unreachable; no server is named as its own leader, and no answer is a 500."""
    url = own_postgres.url(own_postgres.create_database())
    local, url_a, url_b = two_servers(tmp_path / "cluster", url)
    try:
        local.client.request("POST", "/v1/admin/keys", body=CreateKey("before-the-outage"))
        with admin(local, int(url_b.rsplit(":", 1)[1])) as b:
            local.wait(lambda: b.get("/v1/admin/keys").json()["keys"], "B's view to hold the key")
        own_postgres.crash()

        def read_from_the_last_state():
            done = local.ctl("keys", "list", "-o", "json", timeout=60)
            return done if "the store is unreachable" in done.stderr else None

        done = local.wait(read_from_the_last_state, "ctl to read the standby's last state", 60)
        assert done.returncode == 0, done.stderr
        assert [k["name"] for k in json.loads(done.stdout)] == ["before-the-outage"]
        assert f"{url_b} last loaded" in done.stderr and "checked" in done.stderr, done.stderr

        write = local.ctl("keys", "create", "during-the-outage", timeout=60)
        servers = local.ctl("servers", timeout=60)
        for failed in (write, servers):
            assert failed.returncode != 0
            assert "the store is unreachable" in failed.stderr, failed.stderr
            assert "cannot reach the store" in failed.stderr, failed.stderr
            assert f"leader: {url_a}" not in failed.stderr and "Traceback" not in failed.stderr
        logs = (local.logs / "server.log").read_text() + (local.logs / "server-b.log").read_text()
        assert "Traceback" not in logs and " 500 " not in logs
        own_postgres.restart()
        # the servers reconnect with a backoff: on a loaded machine (4 test workers on 2 cores) a leader
        # answered again after more than 60 s once, though it had taken the lease at once
        keys = local.wait(
            lambda: local.client.request("GET", "/v1/admin/keys", KeyList).keys, "a leader again", 120
        )
        assert [k.name for k in keys] == ["before-the-outage"]
    finally:
        local.stop_all()
