"""A gateway whose routes come from a server that went silent: a drain under way fails none of its requests.

The gateway reads its routes from a standby (listed first in its ``--server``),
which is then paused (SIGSTOP): the gateway waits out its poll limit on it
(2 × the longest wait it saw + 2 s) before it moves on to the leader, routing
by the old table meanwhile. The leader drains the nodes that run the model:
the originals leave the routes once their replacements are ready, and keep
running until the gateway reports a table without them.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from llmgw.dev.cluster import LocalCluster
from llmgw.pki import client_ssl_context
from llmgw.serverlist import STANDBY_HEADER
from llmgw.testing.catalogs import LOAD_SIM, catalog_yaml, model, sim_profile
from llmgw.testing.load import GatewayLoad, gateway_models
from llmgw.testing.processes import free_port
from llmgw.wire import EventList

CATALOG = catalog_yaml({"chat": model("{models}/chat", replicas=2)}, one=sim_profile(1, *LOAD_SIM))

pytestmark = pytest.mark.timeout(300)


def standing_by(url: str, local: LocalCluster) -> bool:
    """Whether the server at ``url`` answers, as a standby."""
    context = client_ssl_context(local.admin_tls.cert_path, local.admin_tls.key_path, local.ca.cert_path)
    try:
        with httpx.Client(verify=context, timeout=2) as client:
            reply = client.get(f"{url}/v1/admin/servers")
    except httpx.HTTPError:
        return False
    return reply.status_code == 200 and STANDBY_HEADER in reply.headers


def test_a_gateway_on_a_paused_standby_fails_no_request_while_a_drain_retires_replicas(
    tmp_path: Path, pg_url: str
):
    """Drain both nodes of a model while the gateway's routes server is paused: 0 failed requests, and
    the events say the originals waited for the gateway."""
    port_a, port_b = free_port(), free_port()
    local = LocalCluster(tmp_path / "cluster", server_port=port_a, poll_timeout=3, store=pg_url)
    url_a, url_b = f"https://127.0.0.1:{port_a}", f"https://127.0.0.1:{port_b}"
    local.server_url = f"{url_a},{url_b}"
    standby = None
    try:
        (tmp_path / "models" / "chat").mkdir(parents=True)
        local.start_server()
        local.wait(lambda: local.client.request("GET", "/v1/admin/nodes") is not None, "server A to lead")
        standby = local.start_server(port=port_b, name="server-b")
        local.wait(lambda: standing_by(url_b, local), "server B to stand by")
        for index in (1, 2, 3):
            local.start_agent(local.add_node(index))
        local.server_url = f"{url_b},{url_a}"  # the gateway reads its routes from the standby
        local.start_gateway(free_port())
        local.server_url = f"{url_a},{url_b}"
        local.apply(CATALOG.format(models=tmp_path / "models"))
        local.wait(local.all_ready, "both replicas to be ready")
        # the standby's routes follow the leader's ready replicas after its next load of the state
        local.wait(lambda: gateway_models(local.gateway_url) == ["chat"], "the gateway to route chat", 30)
        # replica/attempt -> its node (a drain may give an original's id to a replacement at once)
        originals = {f"{r.id}/{r.attempt}": r.shards[0].node for r in local.replicas().replicas}
        drained = sorted(set(originals.values()))

        with GatewayLoad(local.gateway_url, 8) as load:
            local.wait(lambda: load.ok >= 16, "the load to get going through the standby's routes", 60)
            os.killpg(standby.pid, signal.SIGSTOP)
            paused = time.monotonic()
            for node in drained:
                local.client.request("POST", f"/v1/admin/nodes/{node}/drain")

            def moved() -> bool:
                replicas = local.replicas().replicas
                on = {s.node for r in replicas for s in r.shards}
                return not on & set(drained) and local.all_ready()

            local.wait(moved, "both replicas to move off the drained nodes", 60)

            def stopped() -> list[str]:
                events = local.client.request("GET", "/v1/admin/events", EventList).events
                return [
                    e.message
                    for e in events
                    if e.message.endswith("stopping it")
                    and f"{e.subject}/{e.message.split()[1].rstrip(':')}" in originals
                ]

            waited = local.wait(lambda: len(stopped()) == 2 and stopped(), "both originals to stop", 60)
            moved_on = time.monotonic() - paused
            served = load.ok
            local.wait(lambda: load.ok >= served + 16, "requests after the originals stopped", 60)
        assert load.failures == [], f"{len(load.failures)} of {load.ok + len(load.failures)} failed"
        # the gateway routed by the old table for seconds: each original waited for it, then stopped
        assert all("gateway" in m for m in waited), (moved_on, waited)
    finally:
        if standby is not None and standby.poll() is None:
            os.killpg(standby.pid, signal.SIGCONT)
        local.stop_all()
