"""Servers on one PostgreSQL database: one leads, standbys read and redirect, a paused leader is fenced."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import psycopg
import pytest

from llmgw import pki
from llmgw.dev.cluster import LocalCluster, program
from llmgw.testing.processes import free_port
from llmgw.testing.sockets import connections_to
from llmgw.wire import CreateKey, to_json

pytestmark = pytest.mark.timeout(240)

#: the servers' lease here (--lease is not a flag LocalCluster passes: the default, 6 s)
LEASE = 6.0


def admin(local: LocalCluster, port: int) -> httpx.Client:
    """An admin HTTP client of the server on ``port``."""
    context = pki.client_ssl_context(local.admin_tls.cert_path, local.admin_tls.key_path, local.ca.cert_path)
    return httpx.Client(base_url=f"https://127.0.0.1:{port}", verify=context, timeout=30)


def role(client: httpx.Client) -> str | None:
    """``leader`` or ``standby`` (reading from its view of the store), by how the server answers
    ``ctl nodes``; None while it cannot answer it (also a standby whose view is not read yet)."""
    try:
        reply = client.get("/v1/admin/nodes")
    except httpx.HTTPError:
        return None
    if reply.status_code != 200:
        return None
    return "standby" if "x-llmgw-standby" in reply.headers else "leader"


def leader_row(url: str) -> tuple[str, int]:
    with psycopg.connect(url) as conn:
        return conn.execute("SELECT address, epoch FROM leader").fetchone()


@pytest.fixture
def two_servers(tmp_path: Path, pg_url: str):
    """Servers A (leads: started first) and B (a standby) on one database, no agents: (cluster, ports)."""
    local = LocalCluster(tmp_path / "cluster", server_port=free_port(), store=pg_url)
    try:
        local.start_server()
        local.wait(lambda: local.client.request("GET", "/v1/admin/nodes"), "server A to lead")
        port_b = free_port()
        local.start_server(port=port_b, name="server-b")
        with admin(local, port_b) as b:
            local.wait(lambda: role(b) == "standby", "server B to answer as a standby")
        yield local, local.server_port, port_b
    finally:
        local.stop_all()


def test_standby_reads_from_the_store_and_answers_writes_naming_the_leader(two_servers):
    """A standby answers reads (marked as its view) and a write with 503 not_leader naming the leader."""
    local, port_a, port_b = two_servers
    with admin(local, port_b) as b:
        read = b.get("/v1/admin/events")
        reply = b.post("/v1/admin/keys", json=to_json(CreateKey("on-the-standby")))
    assert read.status_code == 200 and read.headers["x-llmgw-standby"].startswith("revision ")
    assert any(e["kind"] == "leader" for e in read.json()["events"]), "A's election, read from the store"
    assert reply.status_code == 503
    assert reply.json()["error"]["type"] == "not_leader"
    assert reply.headers["x-llmgw-leader"] == f"https://127.0.0.1:{port_a}"
    assert f"the leader is https://127.0.0.1:{port_a}" in reply.json()["error"]["message"]


def test_standby_takes_over_from_a_killed_leader_and_records_why(two_servers, pg_url):
    """kill -9 of the leader: the standby leads within the lease and a few seconds, and the events say why."""
    local, port_a, port_b = two_servers
    killed = time.monotonic()
    local.stop(local.server, signal.SIGKILL)
    with admin(local, port_b) as b:
        local.wait(lambda: role(b) == "leader", "server B to lead", LEASE + 10)
        took = time.monotonic() - killed
        events = b.get("/v1/admin/events").json()["events"]
    assert took < LEASE + 5
    assert leader_row(pg_url) == (f"https://127.0.0.1:{port_b}", 2)
    leads = [e["message"] for e in events if e["kind"] == "leader"]
    assert leads[0].startswith(f"https://127.0.0.1:{port_a} leads (epoch 1)")
    assert leads[1] == (
        f"https://127.0.0.1:{port_b} leads (epoch 2): "
        f"the lease of https://127.0.0.1:{port_a} (epoch 1) expired"
    )


def test_leader_paused_past_its_lease_writes_nothing_and_steps_down(two_servers, pg_url):
    """SIGSTOP the leader past its lease, B takes over, SIGCONT: A's pending write never lands; it leaves."""
    local, port_a, port_b = two_servers
    os.kill(local.server.pid, signal.SIGSTOP)
    try:
        with admin(local, port_b) as b:
            local.wait(lambda: role(b) == "leader", "server B to lead", LEASE + 15)
        # a write sent to the paused leader: it is read when A resumes, past its lease
        with admin(local, port_a) as a:
            import threading

            answers: list[httpx.Response | Exception] = []

            def create() -> None:
                try:
                    answers.append(a.post("/v1/admin/keys", json=to_json(CreateKey("written-by-a"))))
                except httpx.HTTPError as exc:
                    answers.append(exc)

            waiting = lambda: {c.client for c in connections_to(port_a) if c.unread}  # noqa: E731
            before = waiting()
            sender = threading.Thread(target=create)
            sender.start()
            local.wait(lambda: waiting() - before, "the request to wait in stopped A's socket", 10)
            os.kill(local.server.pid, signal.SIGCONT)
            sender.join(30)
        line = local.wait(
            lambda: next((x for x in local.tail("server", 100).splitlines() if "stepped down" in x), None),
            "server A to log that it stepped down",
            20,
        )
        assert "epoch 1" in line and ("ran out" in line or "over" in line)
        with psycopg.connect(pg_url) as conn:
            keys = conn.execute("SELECT count(*) FROM api_keys WHERE name = 'written-by-a'").fetchone()
            leaders = conn.execute("SELECT message FROM events WHERE kind = 'leader' ORDER BY id").fetchall()
        assert keys == (0,)
        assert len(leaders) == 2 and "epoch 2" in leaders[1][0]
        assert leader_row(pg_url) == (f"https://127.0.0.1:{port_b}", 2)
        assert answers and not (isinstance(answers[0], httpx.Response) and answers[0].status_code < 300)
        with admin(local, port_a) as a:
            local.wait(lambda: role(a) == "standby", "server A to answer as a standby", 20)
            reply = a.post("/v1/admin/keys", json=to_json(CreateKey("on-a-again")))
        assert reply.status_code == 503 and reply.headers["x-llmgw-leader"] == f"https://127.0.0.1:{port_b}"
    finally:
        os.kill(local.server.pid, signal.SIGCONT)


def test_ctl_servers_lists_the_leader_and_the_standby_through_either(two_servers):
    """`ctl servers` with both URLs, a standby's first: the leader, its epoch 1 and lease; B stands by."""
    local, port_a, port_b = two_servers
    url_a, url_b = f"https://127.0.0.1:{port_a}", f"https://127.0.0.1:{port_b}"
    ctl = [program("llmgw"), "ctl", "--server", f"{url_b},{url_a}", "--ca", str(local.ca.cert_path)]
    ctl += ["--cert", str(local.admin_tls.cert_path), "--key", str(local.admin_tls.key_path)]

    def listed() -> dict | None:
        done = subprocess.run([*ctl, "servers", "-o", "json"], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        data = json.loads(done.stdout)
        return data if len(data["servers"]) == 2 else None

    data = local.wait(listed, "both servers to have checked in", 20)
    leader, standby = data["servers"]
    assert data["store"] == "postgresql"
    assert (leader["address"], leader["role"], leader["epoch"]) == (url_a, "leader", 1)
    assert 0 < leader["expires_in"] <= LEASE and leader["lease_age"] >= 0
    assert (standby["address"], standby["role"], standby["epoch"]) == (url_b, "standby", None)
    table = subprocess.run([*ctl, "servers"], capture_output=True, text=True, timeout=60, check=True).stdout
    assert table.splitlines()[0].split() == [
        *("server", "role", "epoch", "leads", "for", "lease", "left", "last", "seen", "up")
    ]
