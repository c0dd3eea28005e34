"""`ctl nodes lost NODE...` over the admin API: an operator declares nodes lost, overriding the server."""

from __future__ import annotations

import json

import httpx
import pytest
import trio
from click.testing import CliRunner
from llmgw_engine_sim import SimEngine

from llmgw.ctl.cli import ctl
from llmgw.models import NodeFacts
from llmgw.server.state.cluster import Settings
from llmgw.testing import make_gpus
from llmgw.testing.server import start_server
from llmgw.wire import SyncRequest, to_json


@pytest.fixture
async def server(nursery, test_pki, tmp_path):
    """A real `llmgw server` on 127.0.0.1 that node-1 and node-2 synced with; yields its URL."""
    config = test_pki.server_config(tmp_path / "state", settings=Settings(lost_after=300))
    url = await start_server(nursery, config, {"sim": SimEngine()})
    for node_id in ("node-1", "node-2"):
        facts = NodeFacts(node_id=node_id, agent_version="0", gpus=make_gpus(2, seed=node_id))
        request = SyncRequest(node_id=node_id, address="127.0.0.5", facts=facts, port_range=(21000, 21099))
        async with httpx.AsyncClient(verify=test_pki.context("node", node_id), timeout=10) as node:
            assert (await node.post(f"{url}/v1/agent/sync", json=to_json(request))).status_code == 200
    return url


async def run_ctl(test_pki, server: str, *args: str):
    """``llmgw ctl --server ... ARGS`` in a thread (the server runs in this one); the click Result."""
    issued = test_pki.client("admin", "ops")
    options = ["--server", server, "--ca", str(test_pki.ca.cert_path)]
    options += ["--cert", str(issued.cert_path), "--key", str(issued.key_path)]
    return await trio.to_thread.run_sync(lambda: CliRunner().invoke(ctl, [*options, *args]))


async def test_ctl_nodes_lost_declares_each_node_lost_and_says_who(server, test_pki):
    """`ctl nodes lost node-1` prints its new state; the node is lost and the event names the admin."""
    result = await run_ctl(test_pki, server, "nodes", "lost", "node-1")
    assert result.exit_code == 0, result.output
    assert result.output == "node-1: lost\n"
    listed = await run_ctl(test_pki, server, "nodes", "-o", "json")
    assert {n["node_id"]: n["state"] for n in json.loads(listed.output)} == {
        "node-1": "lost",
        "node-2": "ready",
    }
    events = await run_ctl(test_pki, server, "events")
    assert "node-1: lost at once: declared lost by ops; its replicas are rebuilt elsewhere" in events.output


async def test_unknown_node_is_a_404_naming_the_known_ones(server, test_pki):
    """Declaring an unknown node lost changes nothing and says which nodes there are."""
    result = await run_ctl(test_pki, server, "nodes", "lost", "node-9")
    assert result.exit_code == 1
    assert "no node 'node-9' (nodes: node-1, node-2)" in result.output
