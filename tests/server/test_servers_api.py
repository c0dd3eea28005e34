"""``GET /v1/admin/servers`` on one server with sqlite: no election, and it says so."""

from __future__ import annotations

import httpx
from click.testing import CliRunner
from llmgw_engine_sim import SimEngine

from llmgw.ctl.cli import ctl
from llmgw.server.main import ServerConfig
from llmgw.server.state.cluster import Settings
from llmgw.testing.server import start_server


async def test_sqlite_server_lists_no_servers_and_ctl_says_it_leads_alone(nursery, test_pki, tmp_path):
    """On sqlite the document lists none (store 'sqlite') and `ctl servers` says the one server leads."""
    import trio

    config = ServerConfig(
        state_dir=tmp_path / "state",
        cert=test_pki.server.cert_path,
        key=test_pki.server.key_path,
        ca=test_pki.ca.cert_path,
        host="127.0.0.1",
        port=0,
        settings=Settings(),
        poll_timeout=0.5,
    )
    url = await start_server(nursery, config, {"sim": SimEngine()})
    async with httpx.AsyncClient(verify=test_pki.context("admin", "ops"), timeout=10) as client:
        reply = await client.get(f"{url}/v1/admin/servers")
    assert reply.status_code == 200 and reply.json() == {"store": "sqlite", "servers": []}
    issued = test_pki.client("admin", "ops")
    options = ["--server", url, "--ca", str(test_pki.ca.cert_path)]
    options += ["--cert", str(issued.cert_path), "--key", str(issued.key_path)]
    result = await trio.to_thread.run_sync(lambda: CliRunner().invoke(ctl, [*options, "servers"]))
    assert result.exit_code == 0, result.output
    assert result.output.startswith("one server, state in sqlite: it leads")
