"""Failover of the control plane: two servers on PostgreSQL, agents, gateway and ctl knowing both."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from llmgw.dev.cluster import LocalCluster, program
from llmgw.testing.catalogs import LOAD_SIM, catalog_yaml, model, sim_profile
from llmgw.testing.load import GatewayLoad
from llmgw.testing.processes import free_port
from llmgw.wire import EventList

CATALOG = catalog_yaml(
    {"chat": model("{models}/chat", replicas=2), "big": model("{models}/big", "tp4x2", replicas=1)},
    one=sim_profile(1, *LOAD_SIM),
    tp4x2=sim_profile(4, nodes=2),
)


pytestmark = pytest.mark.timeout(300)


def shard_pids(local: LocalCluster) -> dict[str, list[int]]:
    return {r.id: [s.pid for s in r.shards] for r in local.replicas().replicas}


def routed(local: LocalCluster) -> bool:
    try:
        response = httpx.get(f"{local.gateway_url}/v1/models", timeout=2)
    except httpx.HTTPError:
        return False
    return response.status_code == 200 and "chat" in [m["id"] for m in response.json()["data"]]


def test_killing_the_leader_fails_no_request_and_restarts_no_engine(tmp_path: Path, pg_url: str):
    """kill -9 the leader under load: the standby leads, agents and gateway follow, 0 failures, 0 restarts."""
    port_a, port_b = free_port(), free_port()
    local = LocalCluster(tmp_path / "cluster", server_port=port_a, lost_after=4, poll_timeout=1, store=pg_url)
    url_a, url_b = f"https://127.0.0.1:{port_a}", f"https://127.0.0.1:{port_b}"
    # every client of the control plane (admin client, agents, gateway) gets both servers
    local.server_url = f"{url_a},{url_b}"
    try:
        for name in ("chat", "big"):
            (tmp_path / "models" / name).mkdir(parents=True)
        local.start_server()
        local.wait(lambda: local.client.request("GET", "/v1/admin/nodes") is not None, "server A to lead")
        local.start_server(port=port_b, name="server-b")
        for index in (1, 2, 3):
            local.start_agent(local.add_node(index))
        local.start_gateway(free_port())
        local.apply(CATALOG.format(models=tmp_path / "models"))
        local.wait(local.all_ready, "every replica to be ready")
        local.wait(lambda: routed(local), "the gateway to route the model")
        before = shard_pids(local)

        with GatewayLoad(local.gateway_url, 16) as load:
            local.wait(lambda: load.ok >= 32, "the load to get going", 60)
            killed = time.monotonic()
            local.stop(local.server, signal.SIGKILL)
            events = local.wait(
                lambda: [e for e in local.client.request("GET", "/v1/admin/events", EventList).events
                         if e.kind == "leader" and e.subject == url_b],
                "server B to lead",
                30,
            )  # fmt: skip
            took = time.monotonic() - killed

            local.wait(local.all_adopted, "every shard to be reported to server B", 60)
            served = load.ok
            local.wait(lambda: load.ok >= served + 32, "more requests after the takeover", 60)
        assert load.failures == [], f"{len(load.failures)} failed of {load.ok + len(load.failures)}"
        assert took < 15, f"server B took {took:.1f} s to lead"
        assert "epoch 2" in events[0].message
        assert shard_pids(local) == before, "no engine was restarted"

        # ctl with both servers keeps working; the first one is dead
        ctl = [program("llmgw"), "ctl", "--server", local.server_url, "--ca", str(local.ca.cert_path)]
        ctl += ["--cert", str(local.admin_tls.cert_path), "--key", str(local.admin_tls.key_path)]
        done = subprocess.run([*ctl, "nodes"], capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0, done.stderr
        assert all(f"node-{i}" in done.stdout for i in (1, 2, 3))

        # and the new leader rebuilds a killed shard
        victim = before["chat-0"][0]
        os.kill(victim, signal.SIGKILL)
        local.wait(
            lambda: shard_pids(local)["chat-0"] != [victim] and local.all_ready(),
            "the new leader to rebuild chat-0",
            60,
        )
    finally:
        local.stop_all()
